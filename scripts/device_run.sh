#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine whose python3 has torch, CuPy, numpy,
# safetensors and pytest but not this project's other needs (it cannot reach an index):
#   OUT=DIR [PY=python3] [QUICK=1] scripts/device_run.sh [--quick]   run the steps below
#   scripts/device_run.sh --fetch-wheels     (here, online) download .device-wheels/ from uv.lock
# Steps, each under `timeout` (a failing step does not stop the next), each writing
# $OUT/<step>.txt as it goes, so a run cut short still returns what it printed:
#   env              the carried wheels installed, then nvidia-smi, versions, the CUDA toolchain
#   gpu_tests        pytest -m gpu over the test files with gpu-marked tests
#   gpu_kernels      bench.gpu_kernels --quick: NVRTC/ptxas table, correctness, bandwidth
#   engine_backends  bench.engine_backends: engine tokens/s, torch vs cuda backend, fp8 vs bf16 KV
#   hf_pipeline      bench.hf_pipeline --device auto: headroom vs transformers generate
# then $OUT/summary.txt (each step's exit code, seconds and verdict line). Without a GPU every
# step still runs: the GPU parts say so (gpu_kernels exits 77) and the CPU paths print tables.
# Knobs: PY (the python, default python3), QUICK=1 (tiny sizes, for a dry run on a CPU host),
# FULL=1 (gpu_kernels' whole correctness sweep), STEPS (comma list, default all), BUDGET_S
# (seconds for all steps, default 450: each step's timeout is cut to what is left).
# Exit 0 when every step ran and exited 0 or 77 (no GPU), else 1.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
# The wheels a device python 3.12 lacks (or has at other versions), at uv.lock's versions.
WHEELS=(transformers huggingface-hub tokenizers regex httpx2 httpcore2 truststore anyio idna h11
  sniffio pydantic pydantic-core annotated-types typing-inspection typing-extensions)

locked_version() {  # the version uv.lock pins for package $1
  awk -v name="name = \"$1\"" '$0 == name { getline; gsub(/version = |"/, ""); print; exit }' \
    "$root/uv.lock"
}

fetch_wheels() {
  local specs=() p v
  for p in "${WHEELS[@]}"; do
    v=$(locked_version "$p")
    [ -n "$v" ] || { echo "$p is not in uv.lock" >&2; return 1; }
    specs+=("$p==$v")
  done
  rm -rf .device-wheels
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .device-wheels "${specs[@]}" || return 1
  du -sh .device-wheels
}

if [ "${1:-}" = --fetch-wheels ]; then
  fetch_wheels
  exit
fi
[ "${1:-}" = --quick ] && QUICK=1
QUICK=${QUICK:-0}
PY=${PY:-python3}
OUT=${OUT:-/tmp/device-out}
BUDGET_S=${BUDGET_S:-450}
STEPS=${STEPS:-gpu_tests,gpu_kernels,engine_backends,hf_pipeline}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$root/contract:$root/engine:$root/sidecar:$root/operator:$root"
names=() codes=() secs=()

install_wheels() {  # onto PYTHONPATH (after the sources, before site-packages)
  local site=${TMPDIR:-/tmp}/headroom-device-site whl=()
  shopt -s nullglob
  whl=(.device-wheels/*.whl)
  shopt -u nullglob
  if [ ${#whl[@]} -eq 0 ]; then
    echo "wheels: none in .device-wheels/ (name it in carry): the python's own packages are used"
    return 0
  fi
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    echo "wheels: built for CPython 3.12, $PY is $("$PY" -V 2>&1): not installed"
    return 0
  fi
  rm -rf "$site"
  if "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --no-cache-dir --target "$site" "${whl[@]}"; then
    export PYTHONPATH="$PYTHONPATH:$site"
    echo "wheels: ${#whl[@]} installed into $site"
  else
    echo "wheels: pip install failed (exit $?): the python's own packages are used"
  fi
}

environment() {
  date -u
  uname -srm
  echo "cpus: $(nproc)"
  free -g 2>/dev/null | head -2
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv 2>/dev/null
  echo "python: $(command -v "$PY") $("$PY" -V 2>&1)"
  timeout 120 "$PY" - <<'EOF'
import importlib

for name in ("torch", "cupy", "numpy", "safetensors", "pydantic", "pytest", "hypothesis",
             "transformers", "tokenizers", "huggingface_hub", "regex"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')} ({mod.__file__})")
    except Exception as exc:
        print(f"{name}: not importable: {exc!r:.200}")
try:
    import torch

    print(f"torch CUDA {torch.version.cuda}, GPU visible: {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        print(f"device: {torch.cuda.get_device_name()}, sm_{major}{minor}")
    from cupy.cuda import runtime

    print(f"cupy: CUDA runtime {runtime.runtimeGetVersion()}, driver {runtime.driverGetVersion()}")
except Exception as exc:
    print(f"torch/cupy: {exc!r:.200}")
try:
    from headroom.engine.attention import cuda_backend as cb
    from headroom.engine.kernels import compile as kc

    print(f"headroom cuda backend available: {cb.cuda_available()}")
    print(f"toolchain: {kc.toolchain().describe()}; ptxas: {kc.find_ptxas()}")
except Exception as exc:
    print(f"headroom toolchain: {exc!r:.300}")
EOF
}

record() {  # record NAME CODE SECONDS
  names+=("$1")
  codes+=("$2")
  secs+=("$3")
}

step() {  # step NAME SECONDS CMD...: CMD under timeout, its output shown and in $OUT/NAME.txt
  local name=$1 limit=$2 t0=$SECONDS rc left
  shift 2
  case ",$STEPS," in *",$name,"*) ;; *) return 0 ;; esac
  left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "=== $name: skipped, ${left} s of the ${BUDGET_S} s budget left" | tee "$OUT/$name.txt"
    record "$name" skipped 0
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (timeout ${limit} s): $*" | tee "$OUT/$name.txt"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.txt"
  rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt"
  record "$name" "$rc" $((SECONDS - t0))
}

meaning() {
  case $1 in
    0) echo ok ;;
    1) echo "MISS or failure" ;;
    2 | 4) echo "usage or collection error" ;;
    5) echo "no tests selected" ;;
    77) echo "no GPU (GPU part skipped)" ;;
    124 | 137) echo "timed out" ;;
    skipped) echo "not run" ;;
    *) echo "failed" ;;
  esac
}

# Not in a pipeline: install_wheels exports PYTHONPATH to the steps.
echo "device_run: QUICK=$QUICK FULL=${FULL:-0} PY=$PY BUDGET_S=$BUDGET_S STEPS=$STEPS" \
  >"$OUT/env.txt"
install_wheels >>"$OUT/env.txt" 2>&1
environment >>"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "$QUICK" = 1 ]; then
  engine_args=(--device auto --models tiny --batches "1,8" --new-tokens 8)
  hf_args=(--device auto --requests 8 --rounds 2 --no-prefix)
else
  engine_args=(--device auto)
  hf_args=(--device auto --requests 128 --rounds 2)
fi
kernel_args=(--quick)
[ "${FULL:-0}" = 1 ] && kernel_args=()
# Only the files with gpu-marked tests: collecting all of tests/ imports kopf, kubernetes and
# aiohttp, which the device python lacks.
mapfile -t gpu_files < <(grep -l 'mark\.gpu' tests/test_*.py)
if [ ${#gpu_files[@]} -gt 0 ]; then
  step gpu_tests 90 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu "${gpu_files[@]}"
fi
step gpu_kernels 150 "$PY" -m bench.gpu_kernels "${kernel_args[@]}"
step engine_backends 120 "$PY" -m bench.engine_backends "${engine_args[@]}"
if "$PY" -c 'import tokenizers, transformers' >/dev/null 2>&1; then
  step hf_pipeline 120 "$PY" -m bench.hf_pipeline "${hf_args[@]}"
elif [[ ",$STEPS," == *,hf_pipeline,* ]]; then
  echo "=== hf_pipeline: transformers/tokenizers not importable by $PY (carry .device-wheels)" \
    | tee "$OUT/hf_pipeline.txt"
  record hf_pipeline skipped 0
fi

status=0
{
  echo "device_run summary ($(date -u), ${SECONDS} s in all; QUICK=$QUICK)"
  printf '%-16s %-8s %6s  %-26s %s\n' step exit seconds meaning "last verdict line"
  for i in "${!names[@]}"; do
    verdict=$(grep -h '^verdicts:' "$OUT/${names[$i]}.txt" 2>/dev/null | tail -n 1)
    [ -z "$verdict" ] && verdict=$(grep -E '(passed|failed|skipped|error)' \
      "$OUT/${names[$i]}.txt" 2>/dev/null | grep -v '^===' | tail -n 1)
    printf '%-16s %-8s %6s  %-26s %s\n' "${names[$i]}" "${codes[$i]}" "${secs[$i]}" \
      "$(meaning "${codes[$i]}")" "${verdict:0:160}"
  done
} | tee "$OUT/summary.txt"
for c in "${codes[@]}"; do
  case $c in 0 | 77) ;; *) status=1 ;; esac
done
exit $status
