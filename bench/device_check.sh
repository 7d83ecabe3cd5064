#!/usr/bin/env bash
# The GPU checks in one go, for a lent GPU node (one GPU is enough): versions, the NCCL
# check (bench/nccl_check.py: every sync collective through a real one-rank NCCL group,
# host syncs counted, overlap memory, two pretrains' digests, two ranks on one GPU where
# NCCL >= 2.30), the NCCL hang check (bench/nccl_hang_check.py: two NCCL ranks, rank 1's
# GPU sleeps in a kernel before an all_reduce and the watchdog's warning must name it;
# two GPUs, or one with NCCL >= 2.30, else skipped), the tracker's cost per NCCL
# collective (bench/tracker_overhead.py), the CUDA integration tests, and the one-GPU
# overhead benchmark. Needs no
# network, Slurm or MPI, and no install: the checkout is put on PYTHONPATH.
#
#   OUT=/some/dir bash bench/device_check.sh          # from the repository root
#
# Everything is also written to $OUT/device_check.log (plus $OUT/test_cuda.xml).
# PYTHON picks the interpreter (default python3; it needs torch, pytest, pytest-timeout,
# scikit-learn). Budget: the step timeouts add up to under 7 minutes (expected 3-4 on an
# H200, the NCCL hang check about 30 s of it), so one run and a rerun fit 15 minutes of
# device time.
# Exit status: 0 when every step passed; 1 when a step failed; 3 at once when CUDA is
# unavailable (a GPU check that passes without a GPU would prove nothing). Once CUDA is
# there it never stops early: every step's result is logged.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/device_out}  # relative to the repository root when relative
mkdir -p "$OUT" || exit 2
exec > >(tee "$OUT/device_check.log") 2>&1
tee_pid=$!
finish() {  # let tee write the last lines before the caller reads the log
    exec 1>&- 2>&-
    wait "$tee_pid" 2>/dev/null
    exit "$1"
}

PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export HPC_CONNECT_TIMEOUT=${HPC_CONNECT_TIMEOUT:-30}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
start=$SECONDS

step() { printf '\n===== %s (t=%ds) =====\n' "$1" "$((SECONDS - start))"; }

step "machine"
date -u +%FT%TZ
hostname
git log -1 --format='commit %H %s' 2>/dev/null || echo "commit: not a git checkout"
if command -v nvidia-smi >/dev/null; then
    timeout 30 nvidia-smi -L
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used \
        --format=csv
else
    echo "nvidia-smi: not on PATH"
fi
echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}"

step "versions"
timeout 120 "$PY" - <<'EOF'
import platform, sys
print("python", sys.version.split()[0], platform.platform())
import torch
print("torch", torch.__version__, "cuda build", torch.version.cuda,
      "cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
try:
    v = torch.cuda.nccl.version()
    print("nccl", ".".join(map(str, v)) if isinstance(v, tuple) else v)
except Exception as e:
    print("nccl: unavailable:", type(e).__name__, e)
import torch.distributed as dist
print("distributed: nccl", dist.is_nccl_available(), "gloo", dist.is_gloo_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} {p.total_memory >> 20} MiB sm_{p.major}{p.minor} uuid {p.uuid}")
from importlib.metadata import PackageNotFoundError, version
for dist_name in ("pytest", "pytest-timeout", "scikit-learn", "numpy", "matplotlib", "tqdm"):
    try:
        print(dist_name, version(dist_name))
    except PackageNotFoundError:
        print(dist_name, "not installed")
EOF
rc_versions=$?

step "CUDA available?"
if ! timeout 120 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'; then
    echo "device_check: FAIL: no CUDA device (torch.cuda.is_available() is False, or torch"
    echo "did not import; see 'versions' above). This script checks the NCCL path and"
    echo "proves nothing without a GPU."
    echo "HINT: run it on a GPU node (srun --gpus=1 bash bench/device_check.sh) with a"
    echo "CUDA build of torch (PYTHON=/path/to/python)."
    finish 3
fi

step "hpc imports from the checkout (PYTHONPATH)"
timeout 60 "$PY" -m hpc --help | head -n 3
timeout 120 "$PY" -m hpc env
step "hpc demo on one rank (default backend)"
timeout 120 "$PY" -m hpc run --nproc 1 -- "$PY" -m hpc demo
rc_demo=$?

step "bench/nccl_check.py (NCCL collectives on one GPU)"
timeout 240 "$PY" bench/nccl_check.py
rc_nccl=$?

step "bench/nccl_hang_check.py (the watchdog names a rank whose GPU is stuck before an all_reduce)"
timeout 150 "$PY" bench/nccl_hang_check.py
rc_hang=$?
case $rc_hang in
    0) hang_verdict="PASS" ;;
    77) hang_verdict="SKIPPED (one GPU, NCCL < 2.30: no two NCCL ranks; NOT verified)" ;;
    124) hang_verdict="TIMEOUT" ;;
    *) hang_verdict="FAIL" ;;
esac

step "bench/tracker_overhead.py (the tracker's cost per collective, CUDA events included)"
timeout 90 "$PY" bench/tracker_overhead.py --calls 5000 --rounds 3
rc_overhead=$?

step "pytest tests/integration/test_cuda.py"
timeout 240 "$PY" -m pytest -p no:cacheprovider -v -rs -s --timeout 120 \
    --junitxml="$OUT/test_cuda.xml" tests/integration/test_cuda.py
rc_tests=$?

step "bench/gpu_check.py --repeats 3"
timeout 150 "$PY" bench/gpu_check.py --repeats 3
rc_gpu=$?
case $rc_gpu in
    0) gpu_verdict="PASS" ;;
    77) gpu_verdict="SKIPPED (no CUDA device)" ;;
    1) gpu_verdict="FAIL (overhead above target)" ;;
    124) gpu_verdict="TIMEOUT" ;;
    *) gpu_verdict="ERROR" ;;
esac

step "summary"
echo "versions rc=$rc_versions demo rc=$rc_demo"
echo "nccl_check rc=$rc_nccl ($([ "$rc_nccl" = 0 ] && echo passed || echo FAILED))"
echo "pytest test_cuda.py rc=$rc_tests ($([ "$rc_tests" = 0 ] && echo passed || echo FAILED))"
echo "nccl_hang_check rc=$rc_hang: $hang_verdict"
echo "tracker_overhead rc=$rc_overhead (figures only, no target)"
echo "gpu_check rc=$rc_gpu: $gpu_verdict"
echo "total ${SECONDS}s; log $OUT/device_check.log"
# nccl_hang_check's skip (77) does not fail the run: this machine cannot hold two NCCL
# ranks; the summary line above says it was not verified.
if [ "$rc_versions" = 0 ] && [ "$rc_demo" = 0 ] && [ "$rc_nccl" = 0 ] \
        && { [ "$rc_hang" = 0 ] || [ "$rc_hang" = 77 ]; } \
        && [ "$rc_tests" = 0 ] && [ "$rc_gpu" = 0 ]; then
    finish 0
fi
finish 1
