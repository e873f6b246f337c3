"""The server's settings: one parse of the environment, one line for a bad value, and no other
module of the package reading the environment (read from the source, AST)."""

from __future__ import annotations

import ast
import pathlib

import pytest

from relaxkv_sglang.runtime import settings
from relaxkv_sglang.repair.policies import DEFAULT_POLICY, SERVER_POLICIES
from relaxkv_sglang.request.schema import check_default_policy
from relaxkv_sglang.runtime.settings import ServerSettings, server_settings

PACKAGE = pathlib.Path(settings.__file__).resolve().parents[1]  # relaxkv_sglang/


def test_unset_variables_give_the_defaults():
    s = ServerSettings.from_env({"PATH": "/bin"})
    assert s == ServerSettings()
    assert (s.default_policy, s.default_budget, s.quality, s.calibration) == ("prefix", None, "medium", None)
    assert s.default_policy == DEFAULT_POLICY  # the registry's default, though settings sit below it
    assert (s.discovery_index, s.admission_hold, s.weights_fingerprint, s.rope_override) == (False, True, "sampled", None)
    assert dict(s.environment) == {}


def test_each_variable_sets_its_field():
    env = {"RELAXKV_DEFAULT_POLICY": "relaxkv", "RELAXKV_DEFAULT_BUDGET": "0.2", "RELAXKV_QUALITY": "High",
           "RELAXKV_CALIBRATION": "none", "RELAXKV_DISCOVERY_INDEX": "yes", "RELAXKV_ADMISSION_HOLD": "off",
           "RELAXKV_WEIGHTS_FINGERPRINT": "full", "RELAXKV_TEST_ROPE_OVERRIDE": '{"base": 20000}',
           "RELAXKV_CHUNK_DIR": "/tmp/chunks", "HOME": "/root"}
    s = ServerSettings.from_env(env)
    assert (s.default_policy, s.default_budget, s.quality, s.calibration) == ("relaxkv", 0.2, "high", "none")
    assert (s.discovery_index, s.admission_hold, s.weights_fingerprint) == (True, False, "full")
    assert s.rope_override == {"base": 20000}
    assert dict(s.environment) == {k: v for k, v in env.items() if k.startswith("RELAXKV_")}  # HOME is not ours
    assert ServerSettings.from_env({"RELAXKV_DEFAULT_BUDGET": "auto"}).default_budget == "auto"
    for policy in SERVER_POLICIES:
        served = ServerSettings.from_env({"RELAXKV_DEFAULT_POLICY": policy})
        assert served.default_policy == policy
        check_default_policy(served)


@pytest.mark.parametrize("name, value, says", [
    ("RELAXKV_DEFAULT_POLICY", "bogus", "not one of full, prefix"),  # checked at startup against the registry
    ("RELAXKV_DEFAULT_BUDGET", "lots", "could not convert"),
    ("RELAXKV_DEFAULT_BUDGET", "1.5", "relaxkv_budget"),
    ("RELAXKV_QUALITY", "best", "best"),
    ("RELAXKV_DISCOVERY_INDEX", "maybe", "must be 1 or 0"),
    ("RELAXKV_ADMISSION_HOLD", "2", "must be 1 or 0"),
    ("RELAXKV_WEIGHTS_FINGERPRINT", "fast", "must be sampled or full"),
    ("RELAXKV_TEST_ROPE_OVERRIDE", "[1]", "must be a JSON object"),
    ("RELAXKV_TEST_ROPE_OVERRIDE", "{", "Expecting"),
])
def test_a_bad_value_is_one_line_naming_the_variable(name, value, says):
    with pytest.raises(SystemExit) as exc:
        check_default_policy(ServerSettings.from_env({name: value}))
    line = str(exc.value)
    assert line.startswith(f"relaxkv-sglang: {name}={value!r}: ") and says in line and "\n" not in line


def test_the_process_reads_its_environment_once(settings_env, monkeypatch):
    settings_env(RELAXKV_DEFAULT_POLICY="pic")
    first = server_settings()
    assert first.default_policy == "pic"
    monkeypatch.setenv("RELAXKV_DEFAULT_POLICY", "full")  # changed after startup: nothing changes
    assert server_settings() is first and server_settings().default_policy == "pic"
    settings_env(RELAXKV_DEFAULT_POLICY="relaxkv")  # a new start reads it again
    assert server_settings().default_policy == "relaxkv"


def test_child_environment_and_the_asset_root(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAXKV_QUALITY", "low")
    env = settings.child_environment(NO_COLOR="1")
    assert env["RELAXKV_QUALITY"] == "low" and env["NO_COLOR"] == "1"
    monkeypatch.setenv("RELAXKV_CACHE", str(tmp_path))
    assert settings.asset_cache_root() == tmp_path
    monkeypatch.delenv("RELAXKV_CACHE")
    assert settings.asset_cache_root() == pathlib.Path.home() / ".cache" / "relaxkv-sglang"


_ENV_NAMES = ("environ", "environb", "getenv", "getenvb", "putenv")


def _environment_reads(source: str, name: str) -> list[str]:
    """``name:line`` of every use of ``os.environ``, ``os.getenv``/``putenv`` or an import of them."""
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        if (isinstance(node, ast.Attribute) and node.attr in _ENV_NAMES) or (
                isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in _ENV_NAMES for a in node.names)):
            found.append(f"{name}:{node.lineno}")
    return found


def test_no_module_but_settings_reads_the_environment():
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "runtime/settings.py"
                 for hit in _environment_reads(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert offenders == [], f"read the environment through relaxkv_sglang/runtime/settings.py: {offenders}"
    assert _environment_reads((PACKAGE / "runtime/settings.py").read_text(), "runtime/settings.py")  # the scan sees reads


def test_the_scan_finds_every_form_of_read():
    source = "import os\nfrom os import getenv\nx = os.environ.get('A')\ny = os.getenv('B')\nz = os.path.join('a')\n"
    assert sorted(_environment_reads(source, "m.py")) == ["m.py:2", "m.py:3", "m.py:4"]


def test_the_api_doc_lists_every_setting():
    """docs/api.md's table of the RELAXKV_* variables names every field and the variable behind it."""
    import dataclasses
    import re

    doc = (PACKAGE.parent / "docs" / "api.md").read_text()
    table = doc[doc.index("## Server settings"):].split("\n## ")[0]
    rows = re.findall(r"^\| (.+?) \| `(\w+)` \|", table, flags=re.M)
    assert {field for _, field in rows} == {f.name for f in dataclasses.fields(ServerSettings)}
    named = {re.sub(r"`", "", variable) for variable, field in rows if field != "environment"}
    assert named == {value for name, value in vars(settings).items()
                     if name.endswith("_ENV") and name != "CACHE_ROOT_ENV"}
