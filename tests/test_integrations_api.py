"""The integrations use kvrag through its public names only: no engine internals, no tensor code."""

import ast
import importlib
from pathlib import Path

import pytest

import kvrag

PUBLIC_MODULES = {"kvrag.chains", "kvrag.retrieval", "kvrag.vllm_client"}
CONNECTOR_MODULES = {"kvrag.locks", "kvrag.paths", "kvrag.store", "kvrag.quant", "kvrag.rope", "kvrag.remote",
                     "kvrag.vllm_client"}
"""What the vLLM connector, which runs inside vLLM and writes its paged caches, takes from kvrag: the store it
shares with kvrag's engines (and where it keeps files, and its 8- and 4-bit formats), the rotation, and no more
(tests/../integrations/vllm)."""
HARNESS = ("kvrag.eval", "kvrag.train", "kvrag.app")
"""The research harness and the `kvrag` command: the integrations' product code never imports them (their
tests may, to compare against the harness)."""
INTEGRATIONS = Path(__file__).resolve().parent.parent / "integrations"


@pytest.mark.parametrize("package", ["langchain_kvrag", "llama_index.llms.kvrag"])
def test_only_kvrags_public_names_are_imported_and_no_private_attribute_is_read(package):
    imported = set()
    for path in Path(importlib.import_module(package).__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] in ("kvrag", "torch") for a in node.names), (path, node.lineno)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("kvrag", "torch"):
                assert node.module == "kvrag" or node.module in PUBLIC_MODULES, (path, node.module)
                imported.add(node.module)
                if node.module == "kvrag":
                    assert {a.name for a in node.names} <= set(kvrag.__all__), (path, node.lineno)
                assert not any(a.name.startswith("_") for a in node.names), (path, node.lineno)
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                assert "engine" not in ast.unparse(node.value), (path, node.lineno, ast.unparse(node))
    assert "kvrag" in imported  # the files were read


def test_no_integration_imports_the_harness_or_the_app():
    files = [p for p in sorted(INTEGRATIONS.rglob("*.py"))
             if "tests" not in p.relative_to(INTEGRATIONS).parts and not any(d.endswith(".egg-info") for d in p.parts)]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]  # `from kvrag import eval`
            else:
                continue
            for module in modules:
                assert not module.startswith(tuple(f"{h}." for h in HARNESS)) and module not in HARNESS, (
                    f"{path.relative_to(INTEGRATIONS)}:{node.lineno} imports {module}")
    packages = {p.relative_to(INTEGRATIONS).parts[0] for p in files}
    assert packages == {"langchain", "llamaindex", "vllm"}, packages  # every integration's code was read


def test_the_vllm_connector_takes_only_the_store_the_rotation_and_paths_from_kvrag():
    imported = set()
    for path in sorted((INTEGRATIONS / "vllm" / "kvrag_vllm").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvrag":
                assert node.module in CONNECTOR_MODULES, (path.name, node.module)
                imported.add(node.module)
    assert {"kvrag.store", "kvrag.rope"} <= imported
