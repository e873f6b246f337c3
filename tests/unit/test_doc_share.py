"""Docstrings and comments say what the code cannot: at most 20% of each room's non-blank lines, and no
module docstring over 25 lines (scripts/doc_share.py measures; history goes to docs/experiments/)."""

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "doc_share.py"
_spec = importlib.util.spec_from_file_location("doc_share", SCRIPT)
doc_share = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(doc_share)


def test_each_room_keeps_its_docs_short():
    rooms = doc_share.rooms()
    assert {"relaxkv_sglang/forward", "relaxkv_sglang/runtime", "the top-level modules"} <= set(rooms)
    over = []
    for name, paths in rooms.items():
        doc, total, long_docs = doc_share.share(paths)
        if doc > doc_share.MAX_SHARE * total:
            over.append(f"{name}: {doc}/{total} = {doc / total:.1%}")
        over += [f"{name}: module docstring {item} lines" for item in long_docs]
    assert not over, "over the docs' share (scripts/doc_share.py):\n" + "\n".join(over)


def test_the_count_sees_docstrings_and_comments(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Doc,\n\ntwo lines of it."""\n\nx = 1  # why\n\n\ndef f():\n    """One."""\n    return x\n')
    assert doc_share.counts(module) == (6, 4, 3)  # of 6 non-blank lines: the module doc (2 of its 3), the comment, f's doc
