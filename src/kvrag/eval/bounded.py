"""What an oversized prompt costs `kvrag serve`: how long the refusal takes, and how much it delays
another client's streamed chat sent at the same moment (its time against the same chat alone).

    python -m kvrag.eval.bounded [--home DIR] [--runs 3] [--max-tokens 32]

Starts `kvrag serve` on the default model (its own process, a free port) and prints one row per
prompt: the 5 MB prompt with a Content-Length and chunked (refused by the byte limit as it arrives), a
1 MB one (under the byte limit, more characters than the context window can hold: refused
untokenized), and one of 600,000 characters (tokenized on a pool thread, then refused as over the
window). Times are medians of `--runs`, taken by the client; the other chat is greedy, so its answer
is compared with the one it gets alone.
"""

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from .serving import Server

CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
QUESTION = "Name three things a lighthouse keeper does every day."


def streamed(url: str, max_tokens: int) -> tuple[float, str]:
    """(seconds, answer) of a streamed greedy chat."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens, "stream": True}
    start, text = time.perf_counter(), ""
    with httpx.stream("POST", url + CHAT, json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    return time.perf_counter() - start, text


def prompts() -> dict[str, object]:
    """The bodies sent, by name: a callable makes a fresh (chunked) body for each run."""
    def body(text: str) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 16}).encode()

    five_mb = body("lighthouse " * 480_000)
    size = f"{len(five_mb) / 1e6:.1f} MB"
    return {
        f"{size} prompt": five_mb,
        f"{size} prompt, chunked": lambda: (five_mb[i : i + 65536] for i in range(0, len(five_mb), 65536)),
        "1.0 MB of 'x' (under the byte limit)": body("x" * 1_000_000),
        "600,000 chars (under the character bound)": body("lighthouse " * 54_545),
    }


def run(url: str, runs: int, max_tokens: int, out=print) -> list[dict]:
    """Each run times the chat alone, then with the prompt sent at the same moment: on a shared machine the
    load drifts, and the ratio compares neighbours."""
    _, answer = streamed(url, max_tokens)  # warm-up: the worker's threads and the prompt's blocks
    out(f"the other client's chat: {QUESTION!r}, greedy, at most {max_tokens} tokens, streamed; medians of {runs}")
    out("| prompt | status | refused after | other chat alone | with the prompt | delay ratio | answer as alone |")
    out("|---|---:|---:|---:|---:|---:|---|")
    rows = []
    for name, payload in prompts().items():
        refusals, alone, others, statuses, same = [], [], [], set(), True
        for _ in range(runs):
            alone.append(streamed(url, max_tokens)[0])
            result = {}

            def big():
                content = payload() if callable(payload) else payload
                start = time.perf_counter()
                response = httpx.post(url + CHAT, content=content, headers=JSON, timeout=600)
                result.update(status=response.status_code, seconds=time.perf_counter() - start)

            thread = threading.Thread(target=big)
            thread.start()  # both at once: the big one first
            seconds, text = streamed(url, max_tokens)
            thread.join()
            refusals.append(result["seconds"])
            others.append(seconds)
            statuses.add(result["status"])
            same &= text == answer
        row = {"prompt": name, "status": "/".join(map(str, sorted(statuses))), "refused": statistics.median(refusals),
               "alone": statistics.median(alone), "other": statistics.median(others), "same": same}
        row["ratio"] = row["other"] / row["alone"]
        rows.append(row)
        out(f"| {name} | {row['status']} | {row['refused']:.3f} s | {row['alone']:.2f} s | {row['other']:.2f} s | "
            f"{row['ratio']:.2f}x | {'yes' if same else 'no'} |")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", help="KVRAG_HOME of the server (default: a temporary directory)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        server = Server(Path(args.home or scratch), max_batch=16)
        try:
            run(server.url, args.runs, args.max_tokens)
        finally:
            server.close()


if __name__ == "__main__":
    main()
