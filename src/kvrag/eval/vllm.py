"""vLLM with and without kvrag's connector, started for real (`kvrag bench vllm`, the tests).

vLLM runs from its own virtualenv (./run builds .venv-vllm; KVRAG_VLLM_PYTHON names another interpreter)
on the weights kvrag's engine answers with, exported once (`kvrag export`), so that both engines answer
with one model.
"""

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from kvrag.eval.scaleout import stop_process

SERVED_NAME = "kvrag-default"


def vllm_python() -> Path:
    """The interpreter of vLLM's environment: $KVRAG_VLLM_PYTHON, else .venv-vllm in kvrag's checkout."""
    if os.environ.get("KVRAG_VLLM_PYTHON"):
        return Path(os.environ["KVRAG_VLLM_PYTHON"])
    return Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"


def export(directory: Path, **engine_options) -> Path:
    """The default model with its adapter, as `kvrag export` writes it, once per directory."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        from kvrag import KVEngine, loading

        engine = KVEngine.shared(**engine_options)
        with loading.quietly():
            engine.model.save_pretrained(directory)
            engine.tokenizer.save_pretrained(directory)
    return directory


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A running vLLM server: `url`, `model` (the served name), `log` (its output, a file), `home`."""

    def __init__(self, url: str, log: Path, home: Path | None, process: subprocess.Popen):
        self.url, self.log, self.home, self.process, self.model = url, log, home, process, SERVED_NAME

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def call(self, path: str, body: dict | None = None, timeout: float = 600) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())


@contextmanager
def vllm_server(model: Path, log_dir: Path, *, connector: bool = True, home: Path | None = None,
                dtype: str = "float32", max_model_len: int = 4096, kv_cache_gib: int = 1,
                extra: tuple[str, ...] = (), timeout: float = 900):
    """vLLM's OpenAI-compatible server on 127.0.0.1 and a free port, eager (no compilation: ready in about a
    minute), with kvrag's connector keeping KV under `home` unless `connector` is False; stopped after."""
    python = vllm_python()
    if not python.exists():
        raise RuntimeError(f"no vLLM environment at {python.parent.parent}: `./run test` or `./run bench vllm` builds "
                           "it (or set KVRAG_VLLM_PYTHON)")
    from kvrag_vllm.client import transfer_config

    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    log = log_dir / f"vllm-{port}.log"
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
               SERVED_NAME, "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager", "--host",
               "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
               *extra]
    if connector:
        command += ["--kv-transfer-config", transfer_config(home=str(home) if home else None)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited ({process.returncode}); its log ends:\n{log.read_text(errors='replace')[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM at {url} not ready within {timeout:.0f} s; its log: {log}")
            time.sleep(0.5)
        yield Server(url, log, Path(home) if home else None, process)
    finally:
        stop_process(process, timeout=30)
