#!/usr/bin/env bash
# The GPU checks in as few device calls as possible, on a machine whose image already has a
# CUDA torch and CuPy (as the lent H100/H200 do) but no network.
#
#   benchmarks/gpu_session.sh tests   # pytest -m gpu, the update-kernel bandwidth, one bench line (~5 min)
#   benchmarks/gpu_session.sh bench   # the GPU throughput suite vs torch AMP (~7 min)
#
# Run it from the repository root. Wheels that the image lacks (lmdb, and anything else
# `pip check` would miss) travel in .whl/ and are installed into /tmp/site first; fetch them
# on a machine with pip access with, for example:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl lmdb
# Logs and result files go to $OUT (default gpu_out/); results are also written under
# benchmarks/results/ as usual, and copied to $OUT so they come back from a lent machine.
set -uo pipefail
stage=${1:-tests}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

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
EOF

case "$stage" in
tests)
    "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$OUT/pytest_gpu.log"
    "$PY" benchmarks/update_bandwidth.py 2>&1 | tee "$OUT/update_bandwidth.jsonl"
    "$PY" -m dptrain bench --config launch/configs/resnet50_synthetic.toml --synthetic --steps 30 --warmup 10 \
        --trace "$OUT/trace" 2>&1 | tee "$OUT/bench_resnet50_fp16.log"
    ;;
bench)
    "$PY" benchmarks/throughput.py --suite gpu --repeats 2 --steps 30 --warmup 10 2>&1 | tee "$OUT/throughput_gpu.log"
    cp benchmarks/results/throughput_gpu_*.md "$OUT/" 2>/dev/null
    ;;
*)
    echo "usage: $0 tests|bench" >&2
    exit 2
    ;;
esac
