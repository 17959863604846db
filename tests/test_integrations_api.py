"""The integrations use kvrag through its public names only: no engine internals, no tensor code."""

import ast
import importlib
from pathlib import Path

import pytest

import kvrag

PUBLIC_MODULES = {"kvrag.app.retrieval", "kvrag.app.split", "kvrag.eval", "kvrag.eval.chains", "kvrag.eval.metrics"}


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
