#!/usr/bin/env bash
# Every GPU check in one device call that fits its window, on a machine whose image already has a
# CUDA torch and CuPy (the lent H100/H200: Python 3.12, torch 2.11 cu130, cupy-cuda13x) but no network.
#
#   benchmarks/gpu/gpu_session.sh                        # the default stages, limits of 8 min together (one device call)
#   STAGES="resnet50_more" benchmarks/gpu/gpu_session.sh # a second call: CUDA graphs, bf16 (5 min)
#   STAGES="selfcheck tests" benchmarks/gpu/gpu_session.sh
#   STAGES="sweep" LIMIT_SWEEP_S=400 benchmarks/gpu/gpu_session.sh
#
# A lent GPU's 15 minutes hold both calls, the second made at once (the machine stays warm for
# ~30 s between calls; a new start costs ~30 s and needs 4 minutes left): about 30 s of start,
# the first call's 8 minutes of limits and ~20 s of set-up and packing, then the second call's
# 300 s: the best case, 30 s short of the 15 minutes. Lower LIMIT_RESNET50_MORE_S to what `status`
# says is left less ~40 s, so the stage's own limit, not the device call's, ends it and the cases
# it finished are packed and summarised.
#
# Stages run in the order STAGES gives, each under its own time limit (LIMIT_<STAGE>_S seconds),
# printed as it starts. A stage past its limit is killed with its whole process group (children
# too) and reported as "timeout", status 124. Default stages and limits (480 s together; with the
# environment probe (30 s at most), a SIGKILL 5 s after each SIGTERM and the packing, under a device
# call's 600 s; selfcheck gets about twice its 17 s on the H200 of 2026-11-27, tests its 39 s there
# and one cold compile of a small model; data allows for one cold torch.compile of ResNet-50, about
# 50 s there, which resnet50's dptrain runs then load from the cache, so resnet50 pays one cold
# compile (the compiled peer's); the NVRTC build of the kernels is cached after the first stage):
#   selfcheck  30 s   the kernels' first-use self-check a solver runs (dptrain.kernels.selfcheck)
#   tests     125 s   pytest -m gpu tests/gpu: kernels vs reference bit for bit, no host sync per step,
#                     cupy-nccl, fp16/bf16 loss parity, a CUDA-graph step against eager; each test under
#                     pytest-timeout (PYTEST_TIMEOUT_S, default 60; the CUDA-graph test, last, has its own 90 s
#                     for its cold compile) where the plugin is installed (carried in .whl/), else under the
#                     stage limit alone
#   bandwidth  35 s   the update and grad-norm kernels against a same-size device copy (update_bandwidth.py;
#                     BANDWIDTH_ARGS adds options)
#   data      155 s   ResNet-50 fp16 from an LMDB of photo-like JPEGs vs synthetic (data_stage.py): DATA_IMAGES
#                     (1500) JPEGs of DATA_SIZE (500) px, data-bench at the defaults (without its call-count
#                     pass), bench from the LMDB and bench --synthetic (50 timed steps each); each tool's output
#                     streamed into the log and a partial record after each step, so a cut keeps what was
#                     measured; DATA_ARGS adds options (e.g. "--no-train --set data.batch_size=8")
#   resnet50  135 s   ResNet-50 fp16: dptrain bench (model.compile "auto": compiled) vs torch AMP + channels_last,
#                     eager and under torch.compile (default mode), alternated; dptrain loads its compile from
#                     the cache the data stage filled, the compiled peer's cold compile takes about a minute
#                     (without a data stage that trained first, give it LIMIT_RESNET50_S=180); throughput.py
#                     --suite gpu --only RESNET50_ONLY; RESNET50_ARGS, default "--repeats 1 --steps 30 --warmup 10"
# Opt-in stages (name them in STAGES):
#   resnet50_more 300 s   fp16 with model.compile = "reduce-overhead" against the peer in torch.compile's
#                     mode of that name (both CUDA graphs), first, so that a cut spares them (never run on a
#                     GPU yet), then bf16 against the eager and compiled peers: four cold compiles, cases in
#                     RESNET50_MORE_ONLY's order; RESNET50_MORE_ONLY="segments" runs fp16 compiled in
#                     segments as several solvers cut the model (model.compile_graphs = "segments")
#                     against the compiled peer instead
#   sweep     480 s   ResNet-50 fp16 `dptrain bench --synthetic` at each batch of SWEEP_BATCHES (32 64 128 256),
#                     compiled as dptrain's CUDA default is (a compile per batch):
#                     the step time in the batch, step(b) = fixed + b x per_image, fitted in the summary; the
#                     scaling model's strong scaling takes sweep.log (benchmarks.scaling --batch-points)
#   autocast  300 s   ResNet-50 in precision.mode = "autocast" (O1: fp32 weights under torch.autocast, gradients
#                     reduced in 16 bits) against torch AMP, fp16 and bf16, eager and compiled peers (throughput.py
#                     --suite autocast_gpu; AUTOCAST_ONLY picks cases): beside resnet50's storage cases, O1 or O2
#   byo       300 s   the user's models by import path: torchvision's ViT-B/16 and ConvNeXt-T, batch 128, bf16,
#                     against the eager and compiled peers (--suite byo_gpu; BYO_ONLY, default the bf16 cases);
#                     needs torchvision in the image
#   shard     200 s   ResNet-50 fp16 with reducer.shard = "optimizer" against unsharded, one GPU (the one-rank
#                     path): images/s and state_bytes_per_rank (--suite shard_gpu)
#   sleep             sleeps GPU_SESSION_TEST_SLEEP_S seconds in a child process, under LIMIT_SLEEP_S (default 2):
#                     only for tests of the limits (tests/unit/test_gpu_session.py); unknown unless that is set
#
# Output: three files in $OUT (default gpu_out/; the device tool brings back at most 8), rewritten
# after every stage, so a run cut off from outside still leaves the stages so far:
#   summary.txt           one screen: each stage's status and time, the figures against their goals
#                         (benchmarks/gpu/session_summary.py), the exit code
#   status.tsv            stage, status, seconds, limit; one line per stage
#   gpu_session.tar.gz    session/: env.txt, status.tsv, summary.txt, each <stage>.log, result tables
# Everything else (the session folder while it fills, the data stage's JPEGs and LMDB) lives in a new
# folder under SCRATCH (default $TMPDIR or /tmp), removed at the end. The exit code is the worst stage
# status, so a failed stage never reads as success; a SIGTERM or SIGINT to the script kills the
# running stage's group, packs what is done, and exits 143.
#
# Wheels the image lacks (lmdb, nvidia-cuda-nvrtc/-runtime if CuPy brought none, pytest-timeout) travel
# in .whl/ (WHEELS) and are installed into the scratch folder first; fetch them where pip has
# network: `make gpu-wheels` (lmdb and pytest-timeout for Python 3.12), or for NVRTC too, e.g.:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl lmdb nvidia-cuda-nvrtc nvidia-cuda-runtime pytest-timeout
set -uo pipefail
OUT=${OUT:-gpu_out}
STAGES=${STAGES:-"selfcheck tests bandwidth data resnet50"}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}  # the folder of wheels to install first (the tests point it at an empty one)
KILL_AFTER_S=${KILL_AFTER_S:-5}  # SIGKILL this long after the SIGTERM of a timed-out stage
declare -A LIMIT=([selfcheck]=30 [tests]=125 [bandwidth]=35 [data]=155 [resnet50]=135 [resnet50_more]=300
                  [sweep]=480 [autocast]=300 [byo]=300 [shard]=200 [sleep]=2)

for stage in $STAGES; do
    if [ -z "${LIMIT[$stage]:-}" ] || { [ "$stage" = sleep ] && [ -z "${GPU_SESSION_TEST_SLEEP_S:-}" ]; }; then
        echo "unknown stage '$stage' in STAGES; known: ${!LIMIT[*]} (sleep needs GPU_SESSION_TEST_SLEEP_S)" >&2
        exit 2
    fi
    var="LIMIT_${stage^^}_S"
    LIMIT[$stage]=${!var:-${LIMIT[$stage]}}
done

rm -f "$OUT/summary.txt" "$OUT/status.tsv" "$OUT/gpu_session.tar.gz"
mkdir -p "$OUT"
SCRATCH_DIR=$(mktemp -d "${SCRATCH:-${TMPDIR:-/tmp}}/gpu_session.XXXXXX") || exit 1
WORK="$SCRATCH_DIR/session"
mkdir -p "$WORK"
: > "$WORK/status.tsv"
worst=0
total=0
for stage in $STAGES; do total=$((total + LIMIT[$stage])); done
limits=$(for stage in $STAGES; do printf '%s %s s, ' "$stage" "${LIMIT[$stage]}"; done)
echo "gpu_session: stages '$STAGES'; limits ${limits}$total s together"

if compgen -G "$WHEELS/*.whl" > /dev/null; then
    # all at once (wheels that share a top-level folder, such as nvidia-cuda-nvrtc and -runtime in
    # nvidia/, install together only so); if that fails, one at a time, so that a wheel that does not
    # suit this Python costs only its own module (the environment probe below says which are missing)
    pip_target=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SCRATCH_DIR/site")
    if ! "${pip_target[@]}" "$WHEELS"/*.whl 2> "$SCRATCH_DIR/pip.err"; then
        tail -n 1 "$SCRATCH_DIR/pip.err" >&2
        for wheel in "$WHEELS"/*.whl; do
            "${pip_target[@]}" "$wheel" 2>&1 | tail -n 1 >&2 || true
        done
    fi
    export PYTHONPATH=$SCRATCH_DIR/site${PYTHONPATH:+:$PYTHONPATH}
elif ! "$PY" -c "import lmdb" 2> /dev/null; then
    echo "no .whl/ and no lmdb: the data stage and tests/gpu/test_data_gpu.py will fail; run 'make gpu-wheels'" \
        "where pip has network and carry .whl/ with the call" >&2
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout itself, no install step
export PYTHONUNBUFFERED=1

timeout -k 5 30 "$PY" - <<'EOF' 2>&1 | tee "$WORK/env.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for m in ("cupy", "lmdb", "PIL", "google.protobuf", "tqdm", "pytest_timeout"):
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

# pack: the summary and the archive in $OUT, from what the session folder holds now.
pack() {
    "$PY" -m benchmarks.gpu.session_summary "$WORK" --stages "$STAGES" > "$WORK/summary.txt" 2>&1 \
        || echo "session_summary.py failed; see status.tsv" >> "$WORK/summary.txt"
    cp "$WORK/summary.txt" "$WORK/status.tsv" "$OUT/"
    tar -czf "$OUT/gpu_session.tar.gz.tmp" -C "$SCRATCH_DIR" session \
        && mv "$OUT/gpu_session.tar.gz.tmp" "$OUT/gpu_session.tar.gz"
}

# run_stage NAME COMMAND...: run it under its limit with its output in session/NAME.log; record
# status, seconds and limit; a timeout is status 124 whichever signal ended it.
run_stage() {
    local name=$1 limit=${LIMIT[$1]}
    shift
    local log="$WORK/$name.log" rc
    stage_start=$SECONDS
    echo "== $name: limit $limit s: $*" | tee "$log"
    # timeout runs the command in a process group of its own and signals the whole group;
    # the kill afterwards takes whatever the stage left running in it (orphaned children)
    timeout --kill-after="$KILL_AFTER_S" "$limit" "$@" >> "$log" 2>&1 < /dev/null &
    stage_pid=$! stage_name=$name
    wait "$stage_pid"
    rc=$?
    kill -KILL -- "-$stage_pid" 2> /dev/null
    stage_pid=
    local secs=$((SECONDS - stage_start))
    if [ "$rc" -eq 124 ] || { [ "$rc" -eq 137 ] && [ "$secs" -ge "$limit" ]; }; then
        rc=124
        echo "== $name: timeout after $secs s (limit $limit s); killed with its process group" | tee -a "$log"
    fi
    printf '%s\t%d\t%d\t%d\n' "$name" "$rc" "$secs" "$limit" | tee -a "$WORK/status.tsv"
    tail -n 5 "$log"
    [ "$rc" -gt "$worst" ] && worst=$rc
    pack
}

# A signal to the script (the device call's own limit): end the running stage, record it as
# interrupted (status 143), and keep what is done.
stage_pid=
stage_name=
stage_start=0
on_signal() {
    if [ -n "$stage_pid" ]; then
        kill -TERM -- "-$stage_pid" 2> /dev/null
        sleep 1
        kill -KILL -- "-$stage_pid" 2> /dev/null
        printf '%s\t%d\t%d\t%d\n' "$stage_name" 143 $((SECONDS - stage_start)) "${LIMIT[$stage_name]}" \
            | tee -a "$WORK/status.tsv"
    fi
    echo "worst stage status: 143 (interrupted)" >> "$WORK/status.tsv"
    pack
    rm -rf "$SCRATCH_DIR"
    exit 143
}
trap on_signal TERM INT

pytest_timeout=()
if "$PY" -c "import pytest_timeout" 2> /dev/null; then
    pytest_timeout=(--timeout="${PYTEST_TIMEOUT_S:-60}" --timeout-method=thread)
else
    echo "pytest-timeout is not installed: the tests stage runs under its stage limit alone"
fi

for stage in $STAGES; do
    case $stage in
    selfcheck)
        run_stage selfcheck "$PY" -c "
import torch
from dptrain.kernels import selfcheck
why = selfcheck.run(torch.cuda.current_device())
print('self-check:', why or 'kernels match the torch reference')
raise SystemExit(1 if why else 0)" ;;
    tests)
        # -v: each result is in the log as it happens, so a stage cut off at its limit still says
        # which tests passed; a module that fails to import costs its own tests, not the others
        run_stage tests "$PY" -m pytest -v -m gpu -p no:cacheprovider -rfEs --continue-on-collection-errors \
            ${pytest_timeout[@]+"${pytest_timeout[@]}"} tests/gpu ;;
    bandwidth)
        # shellcheck disable=SC2086  # BANDWIDTH_ARGS is a list of options (the tests shrink the buffer on a CPU)
        run_stage bandwidth "$PY" -m benchmarks.solvers.update_bandwidth ${BANDWIDTH_ARGS:-} ;;
    data)
        # shellcheck disable=SC2086  # DATA_ARGS is a list of options
        run_stage data "$PY" -m benchmarks.data.data_stage --work "$SCRATCH_DIR/data" --images "${DATA_IMAGES:-1500}" \
            --size "${DATA_SIZE:-500}" ${DATA_ARGS:-} ;;
    resnet50)
        # shellcheck disable=SC2086  # RESNET50_ARGS is a list of options
        run_stage resnet50 "$PY" -m benchmarks.throughput.throughput --suite gpu \
            ${RESNET50_ARGS:---repeats 1 --steps 30 --warmup 10} --tag fp16 --out "$WORK" \
            --only "${RESNET50_ONLY:-fp16 vs torch AMP,fp16 vs torch.compile + torch AMP}" ;;
    resnet50_more)
        # shellcheck disable=SC2086  # RESNET50_ARGS is a list of options
        run_stage resnet50_more "$PY" -m benchmarks.throughput.throughput --suite gpu \
            ${RESNET50_ARGS:---repeats 1 --steps 30 --warmup 10} --tag more --out "$WORK" \
            --only "${RESNET50_MORE_ONLY:-reduce-overhead,bf16}" ;;
    autocast)
        # shellcheck disable=SC2086  # RESNET50_ARGS is a list of options
        run_stage autocast "$PY" -m benchmarks.throughput.throughput --suite autocast_gpu \
            ${RESNET50_ARGS:---repeats 1 --steps 30 --warmup 10} --tag autocast --out "$WORK" \
            --only "${AUTOCAST_ONLY:-autocast fp16 vs torch AMP,autocast bf16 vs torch autocast}" ;;
    byo)
        # shellcheck disable=SC2086  # RESNET50_ARGS is a list of options
        run_stage byo "$PY" -m benchmarks.throughput.throughput --suite byo_gpu \
            ${RESNET50_ARGS:---repeats 1 --steps 30 --warmup 10} --tag byo --out "$WORK" \
            --only "${BYO_ONLY:-ViT-B/16 bf16,ConvNeXt-T bf16}" ;;
    shard)
        # shellcheck disable=SC2086  # RESNET50_ARGS is a list of options
        run_stage shard "$PY" -m benchmarks.throughput.throughput --suite shard_gpu \
            ${RESNET50_ARGS:---repeats 1 --steps 30 --warmup 10} --tag shard --out "$WORK" ;;
    sweep)
        run_stage sweep bash -c 'for b in ${SWEEP_BATCHES:-32 64 128 256}; do
            "$0" -m dptrain bench --config launch/configs/resnet50_imagenet.toml --synthetic --steps 30 --warmup 10 \
                --set data.batch_size=$b --set "train.run_dir=\"$1/sweep_$b\"" || exit; done' "$PY" "$SCRATCH_DIR" ;;
    sleep)
        run_stage sleep "$PY" -c "
import subprocess, sys, time
child = subprocess.Popen(['sleep', sys.argv[1]])
print('child pid', child.pid, flush=True)
time.sleep(float(sys.argv[1]))" "$GPU_SESSION_TEST_SLEEP_S" ;;
    esac
done

echo "worst stage status: $worst" >> "$WORK/status.tsv"
pack
rm -rf "$SCRATCH_DIR"
cat "$OUT/summary.txt"
exit "$worst"
