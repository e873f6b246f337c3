"""runtime/records.py: one attribute per SGLang object, one kind of record on it."""

import ast
import pathlib
import types

import pytest
import torch

from relaxkv_sglang.runtime import records
from relaxkv_sglang.runtime.failures import InvariantError

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "relaxkv_sglang"


def test_record_made_once_and_kept():
    obj = types.SimpleNamespace()
    assert records.record(obj, records.CacheState, create=False) is None
    held = records.record(obj, records.CacheState)
    held.gate = "verdict"
    assert records.record(obj, records.CacheState) is held and vars(obj) == {records.ATTR: held}
    records.detach(obj)
    assert records.record(obj, records.CacheState, create=False) is None


def test_an_object_holds_one_kind_of_record():
    obj = types.SimpleNamespace()
    records.attach(obj, records.BatchState())
    with pytest.raises(InvariantError, match="SimpleNamespace holds a BatchState, not a CacheState"):
        records.record(obj, records.CacheState)


def test_module_record_bypasses_its_attribute_machinery():
    module = torch.nn.Linear(2, 2)
    records.attach(module, records.ReaderState("ctx"))
    assert records.record(module, records.ReaderState).context == "ctx"
    assert records.ATTR not in dict(module.named_children()) and len(list(module.parameters())) == 2


def _relaxkv_attribute_names(source: str) -> list[int]:
    """Lines of ``source`` naming an attribute of its own on another object: a getattr-family call
    with a "relaxkv..." literal, or a module constant ``..._ATTR``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.endswith("_ATTR") for t in node.targets):
            found.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in {"getattr", "setattr", "hasattr", "delattr"} and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).lstrip("_").startswith("relaxkv")):
            found.append(node.lineno)
    return found


def test_no_other_relaxkv_attribute_on_sglang_objects():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.name != "state.py" for line in _relaxkv_attribute_names(path.read_text())]
    assert not found, f"state on an object outside runtime/records.py: {found}"


def test_attribute_finder_sees_both_forms():
    assert _relaxkv_attribute_names('_X_ATTR = "relaxkv_x"\ngetattr(w, "relaxkv_cache", None)\ngetattr(w, "name")') == [1, 2]
