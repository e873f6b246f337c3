"""The GPU check's tooling on the CPU (docs/gpu.md): the offline bundle holds what FlashInfer's JIT
compiles the paged prefill from, ``scripts/gpu_check.sh --quick --dry-run`` passes end to end, the
check's steps are independent (a float32 failure never hides the bfloat16 run) and keep to their
budget."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from relaxkv_sglang import assets
from relaxkv_sglang.gpu_check import bundle, jit_needs
from relaxkv_sglang.gpu_check import repair, run

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def flashinfer_wheel() -> pathlib.Path:
    return assets.fetch_wheel(bundle.FLASHINFER_WHEEL)


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> pathlib.Path:
    """``.gpu/`` when this checkout has one (``make gpu-bundle``), else one built for the test."""
    here = bundle.BUNDLE_DIR
    if (here / bundle.TAR_NAME).is_file() and all((here / w.filename).is_file() for w in bundle.CARRIED_WHEELS):
        return here
    out = tmp_path_factory.mktemp("gpu-bundle")
    bundle.build(out)
    return out


def test_the_jit_needs_are_derived_from_flashinfers_own_jit_code(flashinfer_wheel):
    needs = jit_needs.wheel_needs(flashinfer_wheel)
    csrc = {p.rsplit("/", 1)[1] for p in needs.files if p.startswith("flashinfer/data/csrc/")}
    # the fa2 branch of gen_customize_batch_prefill_module: templates, host sources, paged header
    assert {"batch_prefill.cu", "batch_prefill_jit_binding.cu", "batch_prefill_paged_kernel_inst.jinja",
            "batch_prefill_ragged_kernel_inst.jinja", "batch_prefill_customize_config.jinja",
            "batch_prefill_paged.cuh", "tvm_ffi_utils.h"} <= csrc
    assert not any("sm90" in name for name in csrc)  # fa3's sources are not the plugin's
    assert "flashinfer/data/include/flashinfer/attention/prefill.cuh" in needs.files
    assert any(p.startswith("flashinfer/data/cccl/") for p in needs.files)
    assert needs.include_dirs[0].startswith("flashinfer/data/cccl/")  # CCCL's -I come first, as nvcc sees them
    assert "tvm/ffi/function.h" in needs.unresolved and "cuda_runtime.h" in needs.unresolved


def test_the_bundle_keeps_every_file_the_jit_needs(flashinfer_wheel):
    """`make gpu-bundle`'s list: fails if KEEP leaves out a file the paged prefill compiles from."""
    assert bundle.missing_from_bundle(flashinfer_wheel) == []
    assert bundle.check_wheels(flashinfer_wheel, assets.fetch_wheel(bundle.TVM_FFI_WHEEL)) > 100
    # the test can fail: a KEEP without FlashInfer's attention headers is caught
    lacking = bundle.missing_from_bundle(
        flashinfer_wheel, lambda m: bundle.kept(m) and not m.startswith("flashinfer/data/include/flashinfer/attention/"))
    assert "flashinfer/data/include/flashinfer/attention/prefill.cuh" in lacking


def _script(*args: str, env_extra: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, **env_extra}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.long
def test_gpu_check_script_dry_run_passes_end_to_end(bundle_dir, tmp_path):
    """The one command of docs/gpu.md, on a CPU: the bundle unpacked and checked as on the GPU
    machine, then every step of the quick check at small sizes (FlashInfer's torch model)."""
    proc = _script("--quick", "--dry-run", env_extra={"OUT": str(tmp_path), "RELAXKV_GPU_BUNDLE": str(bundle_dir)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "files FlashInfer's JIT reads for the fa2 paged prefill are present" in proc.stdout
    # every module `import flashinfer` needs, found by the import walk of the unpacked site, is there
    assert "every module import flashinfer needs is carried or in the GPU image" in proc.stdout
    assert "and bin/ has ninja" in proc.stdout
    assert f"bundle unpacked ({len(bundle.CARRIED_WHEELS)} wheels)" in proc.stdout
    assert sum(f.stat().st_size for f in bundle_dir.iterdir()) < 64 * 2**20  # what one device call carries
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["dry_run"] and result["all_ok"]
    assert [s["step"] for s in result["steps"]] == ["flashinfer", "repair", "cases", "repair timing 192",
                                                    "repair timing 256"]
    assert all(s["status"] == "passed" and s["s"] >= 0 for s in result["steps"])
    repair = {r["dtype"]: r for r in result["cases"] if r.get("kind") == "repair"}
    assert repair["float32"]["max_abs_err"] == 0.0 and 0 < repair["bfloat16"]["max_abs_err"] <= 0.1
    timing = [r for r in result["cases"] if r.get("kind") == "repair_timing"]
    assert len(timing) == 2 and all(r["relaxkv_fullctx_pairs"] > r["relaxkv_pairs"] > 0 for r in timing)
    assert (tmp_path / "gpu_check.log").read_text().count("gpu_check: step ") >= 10


def test_gpu_check_script_says_how_to_get_a_missing_bundle(tmp_path):
    proc = _script("--quick", "--dry-run", env_extra={"OUT": str(tmp_path), "RELAXKV_GPU_BUNDLE": str(tmp_path / "none")},
                   timeout=60)
    assert proc.returncode == 2 and "make gpu-bundle" in proc.stderr and "carry .gpu" in proc.stderr


@pytest.mark.long  # builds the bundle (~90 s) with the dry run
def test_an_incomplete_unpacked_bundle_is_named(bundle_dir, tmp_path, flashinfer_wheel):
    import tarfile

    with tarfile.open(bundle_dir / bundle.TAR_NAME) as tar:
        tar.extractall(tmp_path, members=[m for m in tar.getmembers() if m.name.startswith("flashinfer/jit/")
                                          or m.name.startswith("flashinfer/data/csrc/")], filter="data")
    with pytest.raises(bundle.BundleError, match="prefill.cuh|flashinfer/"):
        bundle.verify_site(tmp_path, flashinfer_wheel)
    with pytest.raises(bundle.BundleError):
        bundle.verify_site(tmp_path)  # by include names, without the wheel


def test_a_float32_failure_does_not_hide_the_bfloat16_run(monkeypatch):
    real = repair.repair_pass

    def failing_float32(w, case, stale, plan, ids, slots, place, dtype, warmup=False):
        if place.device.type == "cpu" and dtype == torch.float32 and warmup:
            raise RuntimeError("a blocking copy")
        return real(w, case, stale, plan, ids, slots, place, dtype, warmup)

    monkeypatch.setattr(repair, "repair_pass", failing_float32)
    rows = repair.run_repair("cpu", seed=1, case=repair.RepairCase(n_context=256, n_layers=2, n_chunks=4,
                                                                               query=16))
    assert [(r["step"], r["status"]) for r in rows] == [("repair float32", "error"), ("repair bfloat16", "passed")]
    assert rows[0]["error"].startswith("RuntimeError at ") and "a blocking copy" in rows[0]["error"]
    assert rows[1]["warmup_s"] > 0 and rows[1]["ok"]


def test_a_step_past_the_budget_is_not_run_and_the_json_says_so(tmp_path):
    out = tmp_path / "r.json"
    rc = run.main(["--dry-run", "--dry-run-device", "cpu", "--repair-only", "--budget-s", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 1 and not result["all_ok"]
    steps = {s["step"]: s for s in result["steps"]}
    assert steps["flashinfer"]["status"] == "passed"
    assert steps["repair"]["status"] == "not run" and "budget" in steps["repair"]["error"]
