"""Fixtures for the LlamaIndex integration's tests: the real default model, loaded once per session.

The shared engine keeps what earlier tests stored, so a test that counts computed blocks indexes
passages of its own (made by the `fresh_passages` fixture).
"""

import uuid

import pytest
from kvrag import KVEngine

from llama_index.llms.kvrag import KVRagLLM, default_embed_model


@pytest.fixture(scope="session")
def engine(kvrag_home) -> KVEngine:
    return KVEngine.shared()


@pytest.fixture(scope="session")
def llm(engine) -> KVRagLLM:
    return KVRagLLM(engine=engine, mode="block", max_new_tokens=40)


@pytest.fixture(scope="session")
def embed_model():
    return default_embed_model()


@pytest.fixture
def fresh_passages():
    """Makes passages no other test has indexed: fresh_passages(n)."""

    def make(n: int) -> list[str]:
        tag = uuid.uuid4().hex[:8]
        return [f"Record {tag}-{i}: the harbour master's ledger lists {i + 3} ships arriving on day {i} of the season." for i in range(n)]

    return make
