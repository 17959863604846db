"""Shared by the core's tests and the integrations' tests (one pytest session runs them all)."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def kvrag_home(tmp_path_factory):
    """Every test session gets its own KVRAG_HOME: nothing is read from or left in ~/.cache."""
    home = tmp_path_factory.mktemp("kvrag-home")
    old = os.environ.get("KVRAG_HOME")
    os.environ["KVRAG_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("KVRAG_HOME", None)
    else:
        os.environ["KVRAG_HOME"] = old


@pytest.fixture
def encoded(engine, monkeypatch) -> list:
    """Token ids of every block `engine` (the requesting directory's fixture) computes during the test:
    `blocks.encode` is the one place a block's KV is computed."""
    calls, encode = [], engine.blocks.encode

    def counting(ids, *args, **kwargs):
        calls.append(ids)
        return encode(ids, *args, **kwargs)

    monkeypatch.setattr(engine.blocks, "encode", counting)
    return calls
