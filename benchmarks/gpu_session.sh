#!/usr/bin/env bash
# Every GPU check in one device call, on a machine whose image already has a CUDA torch and
# CuPy (the lent H100/H200: Python 3.12, torch 2.11 cu130, cupy-cuda13x, nvcc) but no network.
#
#   benchmarks/gpu_session.sh          # all stages below (~10 min on one H100)
#   STAGES="tests selfcheck" benchmarks/gpu_session.sh
#   BANDWIDTH_ARGS="--numel 1000000" ...    # options for the bandwidth stage
#
# Stages, each logged to $OUT/<stage>.log with its exit status in $OUT/status.tsv:
#   tests      pytest -m gpu (kernels vs reference bit for bit, no host sync per step, NCCL/cupy-nccl
#              overlap, fp16/bf16 loss parity)
#   selfcheck  the first-use kernel self-check a solver runs (dptrain.kernels.selfcheck), by itself
#   bandwidth  the fused update's effective bandwidth against the HBM peak (benchmarks/update_bandwidth.py)
#   resnet50   ResNet-50 fp16 `dptrain bench` against torch AMP + channels_last, same process order,
#              alternated (benchmarks/throughput.py --suite gpu)
#   nosync     the training step under torch.cuda.set_sync_debug_mode("error") (tests/gpu, -k no_host_sync)
# The script exits with the worst stage status, so a failed stage never reads as success.
#
# Wheels the image lacks (lmdb, nvidia-cuda-nvrtc/-runtime if CuPy brought none, ...) travel in .whl/
# and are installed into /tmp/site first; fetch them where pip has network, e.g.:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl lmdb nvidia-cuda-nvrtc nvidia-cuda-runtime
# Everything it writes goes under $OUT (default gpu_out/): logs, JSON lines, result tables.
set -uo pipefail
OUT=${OUT:-gpu_out}
STAGES=${STAGES:-"tests selfcheck bandwidth resnet50 nosync"}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
: > "$OUT/status.tsv"
worst=0

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing .whl/ failed" >&2; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout itself, no install step
export PYTHONUNBUFFERED=1

"$PY" - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for m in ("cupy", "lmdb", "PIL", "google.protobuf", "tqdm"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "ok"))
    except ImportError as e:
        print(m, "MISSING:", e)
try:
    from dptrain.kernels import nvrtc
    lib = nvrtc.find_library()
    print("nvrtc", lib, nvrtc.version(lib), "include", nvrtc.find_include(lib))
except Exception as e:  # report, the stages will fail with the details
    print("nvrtc MISSING:", e)
EOF

# run_stage NAME COMMAND...: run it with its output in $OUT/NAME.log; record and keep the worst status.
run_stage() {
    local name=$1
    shift
    case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name: $*" | tee "$OUT/$name.log"
    "$@" >> "$OUT/$name.log" 2>&1
    local rc=$?
    printf '%s\t%d\n' "$name" "$rc" | tee -a "$OUT/status.tsv"
    tail -n 5 "$OUT/$name.log"
    [ "$rc" -gt "$worst" ] && worst=$rc
    return 0
}

run_stage tests "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs tests/gpu
run_stage selfcheck "$PY" -c "
import torch
from dptrain.kernels import selfcheck
why = selfcheck.run(torch.cuda.current_device())
print('self-check:', why or 'kernels match the torch reference')
raise SystemExit(1 if why else 0)"
# shellcheck disable=SC2086  # BANDWIDTH_ARGS is a list of options (the tests shrink the buffer on a CPU)
run_stage bandwidth "$PY" benchmarks/update_bandwidth.py ${BANDWIDTH_ARGS:-}
run_stage resnet50 "$PY" benchmarks/throughput.py --suite gpu --repeats 2 --steps 30 --warmup 10 --out "$OUT"
run_stage nosync "$PY" -m pytest -q -m gpu -p no:cacheprovider -k no_host_sync tests/gpu

echo "worst stage status: $worst" | tee -a "$OUT/status.tsv"
exit "$worst"
