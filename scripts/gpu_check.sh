#!/usr/bin/env bash
# The one prepared GPU run of the CUDA data path: `bash scripts/gpu_check.sh OUT_DIR` from the repository root.
#
# Made for a GPU machine with no network that has Python 3.12, torch (CUDA build), cupy-cuda12x/13x,
# cuda-bindings, numpy, xxhash, pyyaml, pytest and hypothesis, but perhaps not msgspec. In under 5 minutes
# (each step has a timeout, and all of them one budget, GPU_CHECK_BUDGET_S, default 290 s) it:
#   1. installs what is missing of the project's dependencies from a folder of wheels, never from the network:
#      $OFFLOAD_WHEELS, default .whl/ in the repository root (git-ignored). Prepare it beforehand, on any
#      machine with network access, for the GPU machine's Python:
#        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#            --platform manylinux_2_17_x86_64 -d .whl msgspec
#      then installs the project itself without dependencies (pip --no-deps --no-index --no-build-isolation),
#      over what the machine has; the steps below import this checkout (PYTHONPATH) either way;
#   2. records the versions and device attributes the CUDA path relies on (env.json, env.txt): driver, torch,
#      cupy, NVRTC, CUDA headers, cuda-bindings, SM count, CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, memlock;
#   3. runs `pytest -m gpu` (tests/cuda_path/test_worker_cuda.py: every copy path and layout bit exact, the race
#      tests on the staged, kernel and batched DMA paths, the calibration) -> pytest_gpu.log, pytest_gpu.xml;
#   4. runs the data-path benchmark on the GPU -> bench_cuda.json (benchmarks/bench_datapath.py --backend cuda:
#      the segment sweep 4 KiB..2 MiB per layout, id pattern and path with ratios to the contiguous copy, the
#      matmul slowdown per path, a 32-layer round trip byte-checked, DMA by piece size);
#   5. runs the round trips of every path under compute-sanitizer memcheck (--report-api-errors no: cuda-bindings
#      probes driver symbols through cuGetProcAddress, which memcheck would list as API errors) and racecheck,
#      where compute-sanitizer is found (PATH, /usr/local/cuda*/bin, the nvidia wheels) -> sanitizer_*.log;
#   6. with budget left, the CUDA tests that need no GPU (fakes, the real cuda-bindings into a libcuda stand-in)
#      on this machine's packages -> pytest_unit.log (CI runs them too).
# Every result lands in OUT_DIR, with summary.txt (one line per step: name, exit code, seconds) and
# gpu_check.log (this script's output). Exit 0 when every step passed (a missing compute-sanitizer is a skip),
# 1 otherwise. On a machine without a GPU it says so, writes OUT_DIR/no_gpu.txt and exits 0.
# GPU_CHECK_ASSUME_GPU=1 runs every step but the install even there (to check this script itself without
# touching the machine's packages; the GPU steps then skip or fail).
set -u

if [ $# -ne 1 ]; then
    echo "usage: bash scripts/gpu_check.sh OUT_DIR" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${OFFLOAD_WHEELS:-$ROOT/.whl}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-290}"
START_S=$SECONDS
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
cd "$ROOT" || exit 2
: > "$OUT/summary.txt"
FAILED=0

say() { echo "gpu_check: $*"; }

# ---- is there a GPU? ----------------------------------------------------------------------------------------
GPUS="$(nvidia-smi -L 2>/dev/null || true)"
TORCH_SEES="$(timeout 120 "$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo "?")"
ASSUME="${GPU_CHECK_ASSUME_GPU:-0}"
if [ "$ASSUME" != 1 ] && [ -z "$GPUS" ] && [ "$TORCH_SEES" != "?" ] && [ "$TORCH_SEES" -eq 0 ] 2>/dev/null; then
    say "no GPU here (nvidia-smi lists none, torch.cuda.is_available() is False): nothing to run"
    echo "no GPU: nvidia-smi lists none and torch sees 0 CUDA devices ($(date -u +%FT%TZ))" > "$OUT/no_gpu.txt"
    exit 0
fi
if [ "$ASSUME" != 1 ] && [ -z "$GPUS" ] && [ "$TORCH_SEES" = "?" ]; then
    say "no GPU here (no nvidia-smi) and torch does not import: nothing to run"
    echo "no GPU: no nvidia-smi, torch does not import ($(date -u +%FT%TZ))" > "$OUT/no_gpu.txt"
    exit 0
fi
say "GPUs: ${GPUS:-none listed by nvidia-smi}; torch sees ${TORCH_SEES} CUDA device(s)"

# run_step NAME TIMEOUT_S COMMAND...: runs with the smaller of its timeout and the budget left; logs a summary line
run_step() {
    local name="$1" limit="$2"
    shift 2
    local left=$((BUDGET_S - (SECONDS - START_S)))
    if [ "$left" -lt 15 ]; then
        say "$name: skipped, the ${BUDGET_S} s budget is spent"
        echo "$name skipped-budget 0" >> "$OUT/summary.txt"
        FAILED=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "$name: up to ${limit} s: $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "$name $rc $((SECONDS - t0))" >> "$OUT/summary.txt"
    say "$name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -ne 0 ] && FAILED=1
    return 0
}

# ---- 1. install over what the machine has ------------------------------------------------------------------
install_missing() {
    local missing
    missing="$("$PY" - <<'EOF'
import importlib.util
wanted = {"msgspec": "msgspec", "xxhash": "xxhash", "yaml": "pyyaml", "numpy": "numpy", "pytest": "pytest",
          "hypothesis": "hypothesis"}
print(" ".join(pip for module, pip in wanted.items() if importlib.util.find_spec(module) is None))
EOF
)"
    if [ -n "$missing" ]; then
        echo "gpu_check: installing from $WHEELS: $missing"
        "$PY" -m pip install --no-index --find-links "$WHEELS" $missing || return 1
    fi
    "$PY" -m pip install --no-deps --no-index --no-build-isolation --find-links "$WHEELS" "$ROOT" \
        > "$OUT/pip_install_project.log" 2>&1 \
        || echo "gpu_check: the project did not install (pip_install_project.log); the steps import this checkout"
    return 0
}
export PY WHEELS ROOT OUT
export -f install_missing
if [ "$ASSUME" = 1 ]; then
    say "install: skipped (GPU_CHECK_ASSUME_GPU=1: this machine's packages stay as they are)"
    echo "install skipped-assume-gpu 0" >> "$OUT/summary.txt"
else
    run_step install 120 bash -c install_missing
fi

# ---- 2. versions and device attributes ------------------------------------------------------------------------
run_step environment 90 "$PY" - "$OUT" <<'EOF'
import json, platform, resource, shutil, sys
out = sys.argv[1]
env: dict = {"python": platform.python_version()}

def attempt(key, fn):
    try:
        env[key] = fn()
    except Exception as exc:  # recorded, never fatal: the point is to see what is there
        env[key] = f"unavailable: {type(exc).__name__}: {exc}"

import torch
env["torch"], env["torch_cuda"] = torch.__version__, torch.version.cuda
attempt("memlock_soft_hard", lambda: list(resource.getrlimit(resource.RLIMIT_MEMLOCK)))
for mod in ("numpy", "msgspec", "xxhash", "yaml", "pytest", "hypothesis", "cupy"):
    attempt(mod, lambda mod=mod: __import__(mod).__version__)
attempt("cuda_bindings", lambda: __import__("importlib.metadata").metadata.version("cuda-bindings"))
attempt("cupy_runtime_version", lambda: __import__("cupy").cuda.runtime.runtimeGetVersion())
attempt("cupy_nvrtc_version", lambda: list(__import__("cupy").cuda.nvrtc.getVersion()))
attempt("cuda_headers_dir", lambda: __import__("cuda.pathfinder", fromlist=["x"]).find_nvidia_header_directory("cudart"))
attempt("compute_sanitizer", lambda: shutil.which("compute-sanitizer"))

def devices():
    from cuda.bindings import driver as drv
    err, version = drv.cuDriverGetVersion()
    env["driver_version"] = int(version)
    names = ["MULTIPROCESSOR_COUNT", "CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM", "UNIFIED_ADDRESSING",
             "CAN_MAP_HOST_MEMORY", "HOST_REGISTER_SUPPORTED", "COMPUTE_CAPABILITY_MAJOR",
             "COMPUTE_CAPABILITY_MINOR", "ASYNC_ENGINE_COUNT"]
    out = []
    for d in range(torch.cuda.device_count()):
        row = {"index": d, "name": torch.cuda.get_device_name(d),
               "total_memory_gib": round(torch.cuda.get_device_properties(d).total_memory / 2**30, 1)}
        for name in names:
            attr = getattr(drv.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}", None)
            if attr is not None:
                err, value = drv.cuDeviceGetAttribute(attr, d)
                row[name.lower()] = int(value) if int(err) == 0 else f"error {int(err)}"
        out.append(row)
    return out

attempt("devices", devices)

def runtime():
    from worker_side.backends.cuda.runtime import TorchCudaRuntime
    rt = TorchCudaRuntime()
    info = {"supports_batch": rt.supports_batch, "supports_kernel": rt.supports_kernel,
            "kernel_error": rt.kernel_error, "num_sms": rt.num_sms(0), "can_use_host_pointer": rt.can_use_host_pointer(0)}
    rt.close()
    return info

attempt("torch_cuda_runtime", runtime)
text = json.dumps(env, indent=2, default=str)
print(text)
open(f"{out}/env.json", "w").write(text + "\n")
open(f"{out}/env.txt", "w").write("".join(f"{k}: {v}\n" for k, v in env.items()))
EOF

# ---- 3. pytest -m gpu -------------------------------------------------------------------------------------
run_step pytest_gpu 90 "$PY" -m pytest -m gpu -q -rfE -p no:cacheprovider tests/cuda_path/test_worker_cuda.py \
    --junitxml="$OUT/pytest_gpu.xml" -o log_level=INFO > "$OUT/pytest_gpu.log" 2>&1
tail -n 25 "$OUT/pytest_gpu.log"

# ---- 4. the data-path benchmark ------------------------------------------------------------------------------
run_step bench_cuda 130 bash -c "'$PY' benchmarks/bench_datapath.py --backend cuda --json --batch-mib 128 --reps 3 \
    > '$OUT/bench_cuda.json' 2> '$OUT/bench_cuda.err'"
"$PY" benchmarks/gpu_report.py "$OUT/bench_cuda.json" | tee "$OUT/bench_report.txt"

# ---- 5. the kernel under compute-sanitizer ---------------------------------------------------------------------
SANITIZER="$(command -v compute-sanitizer || true)"
if [ -z "$SANITIZER" ]; then
    SANITIZER="$( (ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null;
                   "$PY" -c 'import glob, site; [print(p) for d in site.getsitepackages() for p in glob.glob(d + "/nvidia/**/compute-sanitizer", recursive=True)]' 2>/dev/null) \
                 | while read -r p; do [ -x "$p" ] && [ -f "$p" ] && echo "$p"; done | head -n 1)"
fi
if [ -n "$SANITIZER" ]; then
    SELECT="test_round_trip_bit_exact and dtype0 and not pageable"  # float16: every other path, every layout
    for tool in memcheck racecheck; do
        extra=""
        [ "$tool" = memcheck ] && extra="--report-api-errors no"
        run_step "sanitizer_$tool" 60 "$SANITIZER" --tool "$tool" $extra --target-processes all --error-exitcode 3 \
            "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/cuda_path/test_worker_cuda.py -k "$SELECT" \
            > "$OUT/sanitizer_$tool.log" 2>&1
        tail -n 8 "$OUT/sanitizer_$tool.log"
    done
else
    say "compute-sanitizer not found (PATH, /usr/local/cuda*/bin, nvidia wheels): sanitizer steps skipped"
    echo "sanitizer skipped-not-found 0" >> "$OUT/summary.txt"
fi

# ---- 6. the CUDA tests that need no GPU (CI runs them too: only with budget left) ------------------------------
if [ $((BUDGET_S - (SECONDS - START_S))) -lt 45 ]; then
    say "pytest_unit: skipped (optional; under 45 s of the budget left; CI runs these tests)"
    echo "pytest_unit skipped-optional 0" >> "$OUT/summary.txt"
else
run_step pytest_unit 40 "$PY" -m pytest -q -p no:cacheprovider -m "not gpu" tests/cuda_path/test_cuda_kernel_source.py \
    tests/cuda_path/test_cuda_runtime_fakes.py tests/cuda_path/test_cuda_bindings_stub.py tests/cuda_path/test_cuda_backend_rules.py \
    tests/cuda_path/test_cuda_calibration.py \
    > "$OUT/pytest_unit.log" 2>&1
tail -n 5 "$OUT/pytest_unit.log"
fi

say "summary (step, exit code, seconds), $((SECONDS - START_S)) s in all:"
cat "$OUT/summary.txt"
exit "$FAILED"
