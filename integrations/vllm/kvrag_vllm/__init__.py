"""kvrag inside vLLM: a KV connector that reuses indexed passages' KV wherever a prompt holds them.

`transfer_config()` is the --kv-transfer-config to start vLLM with; `index(url, texts)` indexes passages
through a running server (both are kvrag.vllm_client's, which apps use without vLLM installed).
docs/vllm.md in kvrag's repository tells the whole story.
"""

from kvrag.vllm_client import index, transfer_config

__all__ = ["index", "transfer_config"]
