"""Indexing passages through a running vLLM server that has kvrag's connector (standard library only).

Each passage is sent alone as a one-token completion marked `{"kvrag": "index"}`: vLLM prefills it and the
connector keeps its KV. The short runs that join passages in prompts (a blank line, a "---" rule) are
indexed the same way, as the server's tokenizer cuts them between two passages, so that a prompt can be
supplied from its header through its last passage.
"""

import json
import urllib.request
from collections.abc import Iterable

SEPARATORS = ("\n\n", "\n", "\n\n---\n\n", "\n---\n", "\n\n\n")
"""What LangChain's and LlamaIndex's prompts (and kvrag's own) put between two passages."""
_PROBE = ("Alpha.", "Beta")


def transfer_config(home: str | None = None, memory_budget: int | None = None, remote: str | None = None) -> str:
    """The --kv-transfer-config that loads the connector: KV under `home`/vllm (default KVRAG_HOME), at most
    `memory_budget` bytes of it in memory (default 1 GiB), shared through the Redis tier at `remote` (default
    $KVRAG_REMOTE; its MAC secret from $KVRAG_SECRET_FILE or $KVRAG_SECRET, as kvrag's engines take it)."""
    extra = {k: v for k, v in (("home", home), ("memory_budget", memory_budget), ("remote", remote)) if v is not None}
    config = {"kv_connector": "KVRagConnector", "kv_connector_module_path": "kvrag_vllm.connector",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    if extra:
        config["kv_connector_extra_config"] = extra
    return json.dumps(config)


class Server:
    """The few calls indexing needs, on `url` (http://HOST:PORT, with or without /v1)."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None, timeout: float = 600):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.api_key, self.timeout = api_key, timeout
        self.model = model or self.call("GET", "/v1/models")["data"][0]["id"]

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.loads(response.read())

    def tokens(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        return self.call("POST", "/tokenize", body)["tokens"]

    def keep(self, ids: list[int]) -> None:
        """Prefill `ids` alone; the connector stores their KV."""
        self.call("POST", "/v1/completions", {"model": self.model, "prompt": ids, "max_tokens": 1,
                                              "kv_transfer_params": {"kvrag": "index"}})

    def glue(self, separator: str) -> list[int]:
        """The tokens `separator` becomes between two passages (a blank line alone is one token, between
        two sentences often two)."""
        before, after = (self.tokens(p) for p in _PROBE)
        joined = self.tokens(separator.join(_PROBE))
        if joined[: len(before)] != before or joined[len(joined) - len(after) :] != after:
            return []
        return joined[len(before) : len(joined) - len(after)]


def index(url: str, texts: Iterable[str], *, model: str | None = None, api_key: str | None = None,
          separators: Iterable[str] = SEPARATORS) -> int:
    """Index `texts` (and the `separators` between passages) through the vLLM server at `url`; returns how
    many passages were sent. A passage is found in a prompt by its tokens, so it is indexed as apps paste it:
    its text as is, less leading and trailing whitespace."""
    server = Server(url, model, api_key)
    for separator in separators:
        glue = server.glue(separator)
        if glue:
            server.keep(glue)
    count = 0
    for text in texts:
        if text.strip():  # without the whitespace around it, which a prompt's separator takes into its own tokens
            server.keep(server.tokens(text.strip()))
            count += 1
    return count
