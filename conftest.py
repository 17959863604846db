"""Shared by the core's tests and the integrations' tests (one pytest session runs them all)."""

import os

import pytest
from servers import chroma  # noqa: F401 - the fixture: a `chroma run` server per test module (tests/servers.py)


def pytest_addoption(parser):
    parser.addoption("--device", action="append", default=None,
                     help="device a test that takes the `device` fixture runs on (repeatable; default: cpu, and cuda "
                          "when torch sees one)")


def devices(config) -> list[str]:
    import torch

    return config.getoption("device") or ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc):
    """`device`: every device there is, so the invariant, store and mode tests run on a GPU where there is one."""
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", devices(metafunc.config))


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


@pytest.fixture(scope="session", autouse=True)
def answer_in_process():
    """`kvrag ask` answers in its own process in every test (no model process kept warm after the test's home is
    gone); the tests of keeping it warm ask for that themselves."""
    old = os.environ.get("KVRAG_KEEP_WARM")
    os.environ["KVRAG_KEEP_WARM"] = "0"
    yield
    if old is None:
        os.environ.pop("KVRAG_KEEP_WARM", None)
    else:
        os.environ["KVRAG_KEEP_WARM"] = old


@pytest.fixture(scope="session", autouse=True)
def kernels_built(kvrag_home):
    """The C kernels built once per session into its KVRAG_HOME, ahead of every request, as ./run's set-up does."""
    from kvrag import kernels

    return kernels.build()


@pytest.fixture
def encoded(engine, monkeypatch) -> list:
    """Token ids of every block `engine` (the requesting directory's fixture) computes during the test:
    `blocks.encode_many` is the one place a block's KV is computed."""
    calls, encode_many = [], engine.blocks.encode_many

    def counting(ids_list, *args, **kwargs):
        calls.extend(ids_list)
        return encode_many(ids_list, *args, **kwargs)

    monkeypatch.setattr(engine.blocks, "encode_many", counting)
    return calls


_in_e2e_test = [False]


def pytest_configure(config):
    """The real default model loads only in tests marked e2e, so that `pytest -m "not e2e"` is model-free.

    Checked in every run, not only under that filter: asking for the shared engine is refused as well as
    loading the model, since an earlier e2e test may have loaded it already."""
    from kvrag import KVEngine, loading

    def refuse_outside_e2e(model):
        if model is None and not _in_e2e_test[0]:
            raise AssertionError("a test not marked @pytest.mark.e2e uses the real default model")

    shared, load = KVEngine.shared.__func__, loading.load

    def guarded_shared(cls, model=None, **kwargs):
        refuse_outside_e2e(model)
        return shared(cls, model, **kwargs)

    def guarded_load(model=None, **kwargs):
        refuse_outside_e2e(model)
        return load(model, **kwargs)

    KVEngine.shared, loading.load = classmethod(guarded_shared), guarded_load


def pytest_runtest_setup(item):
    _in_e2e_test[0] = item.get_closest_marker("e2e") is not None
