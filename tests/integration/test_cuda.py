"""The GPU path with real processes: nccl on one GPU, CUDA tensors under gloo, GPU errors.

Every test needs ``torch.cuda.is_available()`` and skips without it, in CI too (CI has
no GPU). They are run on a GPU node by ``bash bench/device_check.sh`` (which sets
``PYTHONPATH``: the repository need not be installed) and need exactly one visible GPU
for the shared-GPU test; nothing here needs a network, Slurm or MPI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT, script
from tests.helpers.processes import clean_env, hpc_run, run_group

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (torch.cuda.is_available() is False); "
                              "run `bash bench/device_check.sh` on a GPU node"),
]


def _env() -> dict[str, str]:
    """clean_env() with this checkout importable by every child (not installed there)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return clean_env(PYTHONPATH=path)


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out}"
    return out


@pytest.mark.timeout(100)
def test_one_rank_binds_cuda0_with_nccl() -> None:
    """Default init on a GPU: cpu:gloo,cuda:nccl, cuda:0, CUDA collectives, syncs are
    no-ops at ws 1."""
    out = _ok(hpc_run(1, [script("cuda_probe.py"), "--mode", "nccl"], timeout=90,
                      env=_env()))
    lines = [line.split("PROBE ", 1)[1] for line in out.splitlines() if "PROBE " in line]
    assert len(lines) == 1, out
    row = json.loads(lines[0])
    assert row["backend"] == "cpu:gloo,cuda:nccl", row  # CPU tensors over gloo
    assert row["device"] == "cuda:0" and row["current_device"] == 0, row
    assert row["tensor_device"] == "cuda:0" and row["param_device"] == "cuda:0", row
    assert row["allreduce"] == [1.0, 2.0, 3.0, 4.0], row
    assert row["async_allreduce_ok"] and row["broadcast"] == 7, row
    assert row["weights_unchanged"] and row["grads_unchanged"], row
    print(f"probe: {row}")  # the device log shows the GPU and NCCL version


@pytest.mark.timeout(150)
def test_sync_model_and_gradients_on_cuda_tensors_under_gloo() -> None:
    """Two ranks on one GPU with gloo: broadcast/means of CUDA models, mean CUDA grads."""
    out = _ok(hpc_run(2, [script("sync_model_check.py"), "--device", "cuda:0"],
                      timeout=120, env=_env()))
    lines = [line for line in out.splitlines() if "RESULT" in line]
    assert len(lines) == 2, out
    # 15 tensors x 4 flag combinations x 3 bucket layouts, each checked on every rank
    assert all("RESULT ok" in line and "device=cuda:0 checks=240" in line
               for line in lines), out
    out = _ok(hpc_run(2, [script("cuda_sync.py"), "--device", "cuda:0"], timeout=120,
                      env=_env()))
    lines = [line for line in out.splitlines() if "RESULT" in line]
    assert len(lines) == 2, out
    assert all("RESULT ok" in line and "device=cuda:0" in line and "grad_checks=" in line
               for line in lines), out


@pytest.mark.timeout(90)
def test_two_ranks_on_one_gpu_fail_fast_with_hint() -> None:
    """Default backend, two ranks, one visible GPU: refused before NCCL, naming both."""
    env = _env()
    if torch.cuda.device_count() > 1:  # keep one of them visible
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    t0 = time.monotonic()
    proc = hpc_run(2, [script("cuda_probe.py"), "--mode", "shared"], timeout=60, env=env)
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "UNREACHABLE" not in out, out
    assert "LaunchEnvironmentError" in out, out
    assert "ranks 0 and 1 would share one GPU under nccl: " in out, out
    assert torch.cuda.get_device_name(0) in out, out
    assert "rank 1: rank 0 aborted start-up: ranks 0 and 1 would share" in out, out
    assert "HINT: start one task per GPU" in out and "backend='gloo'" in out, out
    assert elapsed < 60, f"took {elapsed:.0f}s"


@pytest.mark.timeout(60)
def test_env_lists_the_gpu() -> None:
    proc = run_group([sys.executable, "-m", "hpc", "env"], timeout=50, env=_env(), cwd=ROOT)
    out = _ok(proc)
    cuda = [line for line in out.splitlines() if line.startswith("cuda=")]
    assert len(cuda) == 1, out
    assert torch.cuda.get_device_name(0) in cuda[0], out



@pytest.mark.timeout(120)
def test_check_times_the_gpu(tmp_path: Path) -> None:
    """hpc check on one GPU: bf16 GEMM and copy timed with CUDA events, the GPU named,
    the 1-rank ring over NCCL; the figures are plausible for any datacenter GPU."""
    out = _ok(hpc_run(1, [sys.executable, "-m", "hpc", "check", "--out", str(tmp_path)],
                      timeout=110, env=_env()))
    data = json.loads((tmp_path / "hpc-check.json").read_text())
    (row,) = data["ranks"]
    assert row["device"] == "cuda:0" and row["gpus"] >= 1, row
    assert row["gpu_name"] == torch.cuda.get_device_name(0), row
    assert row["gemm"] > 5e12, row   # bf16 8192^3: tens to hundreds of TFLOP/s
    assert row["copy"] > 1e11, row   # HBM: hundreds of GB/s at least
    assert data["settings"]["backend"].endswith("nccl") and data["findings"] == [], data
    assert "VERDICT: OK" in out, out
    print(f"hpc check on {row['gpu_name']}: GEMM {row['gemm'] / 1e12:.0f} TFLOP/s, "
          f"copy {row['copy'] / 1e9:.0f} GB/s")

def _pretrain(out_dir: Path, *args: str) -> str:
    cmd = [sys.executable, "-m", "hpc", "pretrain", "--out", str(out_dir), "--no-progress",
           *args]
    return _ok(hpc_run(1, cmd, timeout=120, env=_env()))


@pytest.mark.timeout(400)
def test_pretrain_on_cuda_checkpoints_and_resumes(tmp_path: Path) -> None:
    """One epoch on the GPU; the checkpoint holds CUDA tensors and loads weights_only."""
    run = tmp_path / "run"
    log = _pretrain(run, "--epochs", "1")
    res = json.loads((run / "result.json").read_text())
    assert res["status"] == "completed" and res["world_size"] == 1, res
    assert res["step"] == 44, res  # 1437 // 32 full batches of 32 (digits train split)
    # 10 classes: chance is 0.1; one CPU epoch gives about 0.57 best, 0.47 mean
    assert 0.3 <= res["val_acc_best"] <= 1.0, res
    assert res["train_loss"] == res["train_loss"] and res["train_loss"] < 5, res
    assert "pretrain completed at step 44: val acc best" in log, log
    ckpt = Path(res["checkpoint"])
    payload = torch.load(ckpt, weights_only=True)  # no map_location: devices as saved
    devices = {t.device.type for t in payload["model"].values()}
    assert devices == {"cuda"}, f"model saved from {devices}, expected the GPU"
    assert "cuda" in payload["rng"][0], "the CUDA RNG state was not captured"
    cpu = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert cpu["step"] == 44 and cpu["world_size"] == 1
    print(f"pretrain on {torch.cuda.get_device_name(0)}: val acc best "
          f"{res['val_acc_best']:.3f} mean {res['val_acc_mean']:.3f}, "
          f"{res['samples_per_s']:.0f} samples/s")

    # stop mid-epoch with a checkpoint, then resume it on the GPU (weights, optimizer,
    # CUDA RNG state back onto the device)
    part = tmp_path / "part"
    _pretrain(part, "--epochs", "1", "--max-steps", "20")
    first = json.loads((part / "result.json").read_text())
    assert first["status"] == "stopped" and first["step"] == 20, first
    log = _pretrain(part, "--epochs", "1")
    second = json.loads((part / "result.json").read_text())
    assert second["status"] == "completed" and second["step"] == 44, second
    assert second["resumed_from"].endswith("ckpt-00000020.pt"), second
    assert "CUDA RNG not restored" not in log, log
    assert 0.3 <= second["val_acc_best"] <= 1.0, second
