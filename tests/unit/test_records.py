"""runtime/records.py: one attribute per SGLang object, one record per kind on it."""

import ast
import dataclasses
import pathlib
import types

import torch

from relaxkv_sglang.runtime import records

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "relaxkv_sglang"


@dataclasses.dataclass
class Counter:
    n: int = 0


@dataclasses.dataclass
class Note:
    text: str = ""


def test_record_made_once_and_kept():
    obj = types.SimpleNamespace()
    assert records.record(obj, Counter, create=False) is None
    held = records.record(obj, Counter)
    held.n = 3
    assert records.record(obj, Counter) is held and list(vars(obj)) == [records.ATTR]
    records.detach(obj, Counter)
    assert records.record(obj, Counter, create=False) is None and vars(obj) == {}


def test_an_object_holds_one_record_per_kind():
    obj = types.SimpleNamespace()
    note = records.attach(obj, Note("x"))
    counter = records.record(obj, Counter)
    assert records.record(obj, Note) is note and records.record(obj, Counter) is counter
    records.attach(obj, Note("y"))  # replaces that kind only
    assert records.record(obj, Note).text == "y" and records.record(obj, Counter) is counter
    records.detach(obj, Note)
    assert records.record(obj, Note, create=False) is None and records.record(obj, Counter) is counter


def test_module_record_bypasses_its_attribute_machinery():
    module = torch.nn.Linear(2, 2)
    records.attach(module, Note("ctx"))
    assert records.record(module, Note).text == "ctx"
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
                      if path != PACKAGE / "runtime" / "records.py" for line in _relaxkv_attribute_names(path.read_text())]
    assert not found, f"state on an object outside runtime/records.py: {found}"


def test_attribute_finder_sees_both_forms():
    assert _relaxkv_attribute_names('_X_ATTR = "relaxkv_x"\ngetattr(w, "relaxkv_cache", None)\ngetattr(w, "name")') == [1, 2]
