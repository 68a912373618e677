"""dptrain against its peers (torch AMP, DDP + AMP), measured in the same run.

Each case runs dptrain's ``bench`` and the peer (benchmarks/throughput/peer.py) alternately,
``--repeats`` times, and reports the median images/s of each and their ratio. Results go
to ``benchmarks/results/throughput_<hardware>_<yyyymmdd>.md`` with every raw JSON line.

    python -m benchmarks.throughput.throughput                 # CPU cases (2 cores: a few minutes)
    python -m benchmarks.throughput.throughput --suite layout  # dptrain's default layout vs DDP with and without channels_last
    python -m benchmarks.throughput.throughput --suite buckets # reducer.bucket_mb = "auto" vs a sweep of fixed caps
    python -m benchmarks.throughput.throughput --suite gpu     # GPU cases (one GPU)
    python -m benchmarks.throughput.throughput --dry-run       # print the commands only
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dptrain import hostmem

REPO = Path(__file__).resolve().parents[2]
BASE_CONFIG = REPO / "launch" / "configs" / "resnet50_synthetic.toml"


@dataclass
class Case:
    name: str
    world_size: int
    model: str
    width: int
    num_classes: int
    image_size: int
    batch_size: int
    precision: str  # dptrain storage == peer autocast dtype
    channels_last: bool | None
    """None: dptrain's default ("auto") and the peer's default (NCHW)."""
    peer: bool = True
    extra_sets: list[str] = field(default_factory=list)
    peer_channels_last: bool | None = None
    """The peer's layout when it differs from dptrain's (None: the same; NCHW for dptrain's default)."""
    peer_env: dict[str, str] = field(default_factory=dict)
    """Environment variables for the peer's processes only."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for dptrain's processes only."""
    peer_compile: str | None = None
    """The peer under torch.compile in this mode ("default", "reduce-overhead"); None: eager."""
    model_args: dict[str, Any] = field(default_factory=dict)
    """``model.args`` of an import-path ``model`` (the user's own), given to both sides."""
    phase_steps: int = 3
    """bench's --phase-steps: the steps its phase times (update_ms and the others) average over."""


KEEP_MALLOC_ENV = {"GLIBC_TUNABLES": f"glibc.malloc.mmap_threshold={hostmem.MMAP_THRESHOLD_BYTES}:"
                                     f"glibc.malloc.trim_threshold={hostmem.TRIM_THRESHOLD_BYTES}"}
"""glibc's malloc settings that dptrain's ``train.host_malloc = "keep"`` applies (dptrain/hostmem.py), as
environment variables: what the peer gets when it is given the same allocator behaviour."""


FUSED = ["solver.cpu_fused_update=true"]
"""dptrain's CPU update compiled by inductor into one pass; the warm-up steps absorb the compile."""
COMPILE = ["model.compile=true"]
"""dptrain's model compiled in segments (``dptrain.train.compiled``); the warm-up steps follow its compile."""
INPLACE_ENV = {"DPTRAIN_KERNELS": "inplace"}
"""dptrain's CPU update as in-place torch passes, the fallback where update.cu cannot be built for the host."""


def cpu_cases(quick: bool) -> list[Case]:
    w, b = (16, 16) if quick else (64, 32)
    common = dict(model="resnet18_cifar", width=w, num_classes=10, image_size=32, batch_size=b, channels_last=False)
    cases = [
        Case("1 solver, bf16 storage vs autocast bf16", 1, precision="bf16", **common),
        Case("1 solver, bf16 storage (in-place update) vs autocast bf16", 1, precision="bf16", env=INPLACE_ENV,
             **common),
        Case("2 solvers, bf16 storage vs DDP + autocast bf16", 2, precision="bf16", **common),
        Case("2 solvers, fp32 vs DDP fp32", 2, precision="fp32", **common),
    ]
    for mb in (1, 5, 25, 100):
        cases.append(Case(f"bucket sweep {mb} MB, 2 solvers bf16", 2, precision="bf16", peer=False,
                          extra_sets=[f"reducer.bucket_mb={mb}", f"reducer.first_bucket_mb={min(mb, 1)}"],
                          **common))
    return cases


def layout_cases() -> list[Case]:
    """The issue's layout comparison: ResNet-18 CIFAR width 32, batch 32, 2 solvers; dptrain with its
    defaults against DDP without and with channels_last, in bf16 (native-bf16 CPUs) and fp32."""
    common = dict(model="resnet18_cifar", width=32, num_classes=10, image_size=32, batch_size=32)
    cases = []
    for prec in ("bf16", "fp32"):
        peer = "DDP + autocast bf16" if prec == "bf16" else "DDP fp32"
        cases += [Case(f"2 solvers {prec}, dptrain defaults vs {peer}", 2, precision=prec, channels_last=None, **common),
                  Case(f"2 solvers {prec}, dptrain defaults vs {peer} + channels_last", 2, precision=prec,
                       channels_last=None, peer_channels_last=True, **common),
                  # the same allocator settings for the peer: how much of the lead is dptrain's host_malloc
                  Case(f"2 solvers {prec}, dptrain defaults vs {peer} + channels_last + dptrain's malloc settings", 2,
                       precision=prec, channels_last=None, peer_channels_last=True, peer_env=KEEP_MALLOC_ENV,
                       **common),
                  Case(f"2 solvers {prec}, dptrain host_malloc=system (peer NHWC)", 2, precision=prec,
                       channels_last=None, peer=False, extra_sets=["train.host_malloc=system"], **common),
                  Case(f"2 solvers {prec}, dptrain cpu_fused_update=true (peer NHWC)", 2, precision=prec,
                       channels_last=None, peer=False, extra_sets=FUSED, **common),
                  Case(f"2 solvers {prec}, dptrain DPTRAIN_KERNELS=inplace (peer NHWC)", 2, precision=prec,
                       channels_last=None, peer=False, env=INPLACE_ENV, **common),
                  Case(f"2 solvers {prec}, dptrain channels_last=false (peer NCHW)", 2, precision=prec,
                       channels_last=False, peer=False, **common),
                  Case(f"2 solvers {prec}, dptrain channels_last=true (peer NHWC)", 2, precision=prec,
                       channels_last=True, peer=False, **common),
                  # torch.compile on both sides: the compiled peer, and dptrain's model.compile against it
                  Case(f"2 solvers {prec}, dptrain defaults vs {peer} + channels_last + torch.compile", 2,
                       precision=prec, channels_last=None, peer_channels_last=True, peer_compile="default", **common),
                  Case(f"2 solvers {prec}, dptrain model.compile=true vs {peer} + channels_last + torch.compile", 2,
                       precision=prec, channels_last=None, peer_channels_last=True, peer_compile="default",
                       extra_sets=COMPILE, **common),
                  # the cut forced either way, whatever "auto" picks on the CPU: one graph, or segments that overlap
                  *[Case(f"2 solvers {prec}, dptrain model.compile=true + compile_graphs={graphs} vs {peer} + "
                         "channels_last + torch.compile", 2, precision=prec, channels_last=None, peer_channels_last=True,
                         peer_compile="default", extra_sets=[*COMPILE, f"model.compile_graphs={graphs}"], **common)
                    for graphs in ("whole", "segments")]]
    return cases


def bucket_cases() -> list[Case]:
    """``reducer.bucket_mb = "auto"`` against fixed caps, 2 solvers fp32 (runs on any CPU)."""
    common = dict(model="resnet18_cifar", width=32, num_classes=10, image_size=32, batch_size=32,
                  channels_last=True, precision="fp32", peer=False)  # layout pinned: not what is compared
    cases = [Case(f"buckets {mb} MB, 2 solvers fp32", 2, extra_sets=[f"reducer.bucket_mb={mb}",
                                                                     f"reducer.first_bucket_mb={min(mb, 1)}"], **common)
             for mb in (1, 5, 25, 100)]
    # the default cap with the buffers laid out in the observed gradient order, as auto lays them out: what
    # the layout alone gives, apart from auto's boundaries
    replan = Case("buckets 25 MB + replan, 2 solvers fp32", 2, extra_sets=["reducer.bucket_mb=25",
                                                                           "reducer.replan=true"], **common)
    return [*cases, replan, Case("buckets auto, 2 solvers fp32", 2, extra_sets=["reducer.bucket_mb=auto"], **common)]


def gpu_cases() -> list[Case]:
    """ResNet-50, batch 256, NHWC on both sides; dptrain at its defaults (``model.compile = "auto"``:
    compiled on CUDA) against the eager peer and the compiled one, in torch.compile's default mode
    and, for fp16, in "reduce-overhead" (CUDA graphs) against dptrain's ``model.compile =
    "reduce-overhead"``. One dptrain run per round serves every peer of its precision and settings
    (see main)."""
    common = dict(model="resnet50", width=64, num_classes=1000, image_size=224, batch_size=256, channels_last=True)
    cases = []
    for prec, amp in (("fp16", "torch AMP (autocast + GradScaler)"), ("bf16", "torch autocast bf16")):
        cases += [Case(f"ResNet-50 {prec} vs {amp}", 1, precision=prec, **common),
                  Case(f"ResNet-50 {prec} vs torch.compile + {amp}", 1, precision=prec, peer_compile="default",
                       **common)]
    cases.append(Case("ResNet-50 fp16 vs torch.compile reduce-overhead + torch AMP", 1, precision="fp16",
                      peer_compile="reduce-overhead", extra_sets=["model.compile=reduce-overhead"], **common))
    # the cut several solvers compile (one graph per bucket-sized block), measured on one GPU: what it costs
    # against the one graph a single solver compiles (the "fp16 vs torch.compile" case)
    cases.append(Case("ResNet-50 fp16, segments vs torch.compile + torch AMP (autocast + GradScaler)", 1,
                      precision="fp16", peer_compile="default", extra_sets=["model.compile_graphs=segments"],
                      **common))
    return cases


VIT = "examples.vit:VisionTransformer"
"""The user's own model of examples/: a vision transformer dptrain knows nothing of."""
VIT_CPU_ARGS = {"image_size": 32, "patch_size": 4, "dim": 192, "depth": 6, "heads": 3, "mlp_ratio": 4.0}
"""A ViT-Tiny's width and heads, 6 blocks, on 32x32 images (65 tokens): a transformer step the 2-core
CPU runs in tenths of a second."""


def vit_cases(quick: bool) -> list[Case]:
    """The user's ViT (no BatchNorm: LayerNorm, attention, MLP) with 2 gloo solvers against DDP + autocast,
    the peer NCHW and channels_last (only the patch embedding is a convolution), eager and compiled, and
    dptrain with torch's attention dispatch (``model.attention = "torch"``: what the rest gains without
    the measured kernel choice)."""
    args = {**VIT_CPU_ARGS, **({"dim": 48, "depth": 2} if quick else {})}
    common = dict(model=VIT, width=64, num_classes=10, image_size=32, batch_size=32, model_args=args)
    cases = []
    for prec, peer in (("bf16", "DDP + autocast bf16"), ("fp32", "DDP fp32")):
        cases += [Case(f"ViT 2 solvers {prec} vs {peer}", 2, precision=prec, channels_last=False, **common),
                  Case(f"ViT 2 solvers {prec} vs {peer} + channels_last", 2, precision=prec, channels_last=False,
                       peer_channels_last=True, **common)]
    cases.append(Case("ViT 2 solvers bf16, model.attention=torch vs DDP + autocast bf16", 2, precision="bf16",
                      channels_last=False, extra_sets=["model.attention=torch"], **common))  # without the kernel choice
    cases.append(Case("ViT 2 solvers bf16, model.compile=true vs DDP + autocast bf16 + torch.compile", 2,
                      precision="bf16", channels_last=False, peer_compile="default", extra_sets=COMPILE, **common))
    return cases


AUTOCAST = ["precision.mode=autocast"]
"""dptrain's O1: fp32 weights under torch.autocast, gradients reduced in the autocast dtype by default."""


def autocast_cases(quick: bool) -> list[Case]:
    """O1 beside O2 on 2 gloo solvers, bf16, against DDP + autocast bf16 (the same numerics as O1):
    ResNet-18 CIFAR width 32 and the ViT of the vit suite; dptrain in autocast mode with bf16 and with
    fp32 on the wire (``reducer.dtype``), and in storage mode; and autocast mode compiled
    (``model.compile``) against the peer under torch.compile."""
    resnet = dict(model="resnet18_cifar", width=8 if quick else 32, num_classes=10, image_size=32, batch_size=32,
                  channels_last=None)
    vit = dict(model=VIT, width=64, num_classes=10, image_size=32, batch_size=32, channels_last=False,
               model_args={**VIT_CPU_ARGS, **({"dim": 48, "depth": 2} if quick else {})})
    cases = []
    for name, common in (("ResNet-18 CIFAR", resnet), ("ViT", vit)):
        peer = "vs DDP + autocast bf16" + (" + channels_last" if common is resnet else "")
        extra = dict(peer_channels_last=True) if common is resnet else {}
        cases += [Case(f"{name} 2 solvers, autocast bf16 (bf16 on the wire) {peer}", 2, precision="bf16",
                       extra_sets=AUTOCAST, **extra, **common),
                  Case(f"{name} 2 solvers, autocast bf16 (fp32 on the wire) {peer}", 2, precision="bf16",
                       extra_sets=[*AUTOCAST, "reducer.dtype=fp32"], **extra, **common),
                  Case(f"{name} 2 solvers, storage bf16 {peer}", 2, precision="bf16", **extra, **common),
                  Case(f"{name} 2 solvers, autocast bf16, model.compile=true {peer} + torch.compile", 2,
                       precision="bf16", extra_sets=[*AUTOCAST, *COMPILE], peer_compile="default", **extra, **common)]
    return cases


def autocast_gpu_cases() -> list[Case]:
    """ResNet-50 at batch 256, NHWC, on one GPU: dptrain's autocast mode (O1: fp32 weights, torch.autocast)
    against torch AMP, fp16 with its GradScaler and bf16, eager and compiled peers; beside the storage
    cases of the gpu suite, the O1-or-O2 comparison on a zoo model (gpu_session.sh's autocast stage)."""
    common = dict(model="resnet50", width=64, num_classes=1000, image_size=224, batch_size=256, channels_last=True)
    cases = []
    for prec, amp in (("fp16", "torch AMP (autocast + GradScaler)"), ("bf16", "torch autocast bf16")):
        cases += [Case(f"ResNet-50 autocast {prec} vs {amp}", 1, precision=prec, extra_sets=AUTOCAST, **common),
                  Case(f"ResNet-50 autocast {prec} vs torch.compile + {amp}", 1, precision=prec,
                       peer_compile="default", extra_sets=AUTOCAST, **common)]
    return cases


def shard_cases(quick: bool) -> list[Case]:
    """ZeRO-1 on 2 gloo solvers: ResNet-18 CIFAR width 32, bf16, AdamW, unsharded against sharded with the
    gathers waited in forward and at the step; dptrain alone (the issue's goals compare dptrain with itself:
    throughput, the update's time per step, ``state_bytes_per_rank``)."""
    common = dict(model="resnet18_cifar", width=8 if quick else 32, num_classes=10, image_size=32, batch_size=32,
                  precision="bf16", channels_last=None, peer=False, phase_steps=12)
    adamw = ["solver.type=adamw", "solver.base_lr=0.001"]
    return [Case("ResNet-18 CIFAR 2 solvers bf16 AdamW, unsharded", 2, extra_sets=adamw, **common),
            Case("ResNet-18 CIFAR 2 solvers bf16 AdamW, sharded, gathers waited in forward", 2,
                 extra_sets=[*adamw, "reducer.shard=optimizer", "reducer.gather_wait=forward"], **common),
            Case("ResNet-18 CIFAR 2 solvers bf16 AdamW, sharded, gathers waited at the step", 2,
                 extra_sets=[*adamw, "reducer.shard=optimizer", "reducer.gather_wait=step"], **common)]


def shard_gpu_cases() -> list[Case]:
    """ResNet-50 fp16, batch 256, one GPU (the one-rank communicator path of ``reducer.shard``): sharded
    against unsharded dptrain, no peer (gpu_session.sh's shard stage)."""
    common = dict(model="resnet50", width=64, num_classes=1000, image_size=224, batch_size=256, channels_last=True,
                  precision="fp16", peer=False)
    return [Case("ResNet-50 fp16 unsharded", 1, **common),
            Case("ResNet-50 fp16 sharded (reducer.shard = optimizer)", 1, extra_sets=["reducer.shard=optimizer"],
                 **common)]


def user_model_gpu_cases() -> list[Case]:
    """torchvision's ViT-B/16 and ConvNeXt-T (the user's models, by import path) at batch 128, NHWC, against
    the eager and the compiled peer, in bf16 (the ViT recipes' choice: fp16 attention overflows) and fp16.
    Opt-in (gpu_session.sh's byo stage): needs torchvision in the image."""
    cases = []
    for model, name in (("torchvision.models:vit_b_16", "ViT-B/16"), ("torchvision.models:convnext_tiny", "ConvNeXt-T")):
        common = dict(model=model, width=64, num_classes=1000, image_size=224, batch_size=128, channels_last=True)
        for prec, amp in (("bf16", "torch autocast bf16"), ("fp16", "torch AMP (autocast + GradScaler)")):
            cases += [Case(f"{name} {prec} vs {amp}", 1, precision=prec, **common),
                      Case(f"{name} {prec} vs torch.compile + {amp}", 1, precision=prec, peer_compile="default",
                           **common)]
    return cases


SUITES = {"cpu": cpu_cases, "layout": lambda quick: layout_cases(), "buckets": lambda quick: bucket_cases(),
          "gpu": lambda quick: gpu_cases(), "vit": vit_cases, "autocast": autocast_cases, "byo_gpu": lambda quick: user_model_gpu_cases(),
          "autocast_gpu": lambda quick: autocast_gpu_cases(), "shard_gpu": lambda quick: shard_gpu_cases(),
          "shard": shard_cases}
"""The suites by name, each called with ``--quick`` (the CPU suite's tiny widths)."""
GPU_SUITES = ("gpu", "byo_gpu", "autocast_gpu", "shard_gpu")
"""The suites run on a GPU (every other suite's dtypes are filtered for the CPU's native kernels)."""


def launcher(world_size: int) -> list[str]:
    if world_size == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}"]


def dptrain_sets(c: Case) -> list[str]:
    """The ``--set`` overrides of :data:`BASE_CONFIG` that make dptrain's side of ``c``."""
    layout = "auto" if c.channels_last is None else str(c.channels_last).lower()  # the recipe sets true
    return [f"model.name={json.dumps(c.model)}", f"model.width={c.width}", f"model.num_classes={c.num_classes}",
            *[f"model.args.{k}={json.dumps(v)}" for k, v in c.model_args.items()],
            f"model.channels_last={layout}",
            f"data.image_size={c.image_size}", f"data.batch_size={c.batch_size}", f"precision.storage={c.precision}",
            *c.extra_sets]


def dptrain_cmd(c: Case, steps: int, warmup: int) -> list[str]:
    sets = dptrain_sets(c)
    return [*launcher(c.world_size), "-m", "dptrain", "bench", "--config", str(BASE_CONFIG), "--synthetic",
            f"--steps={steps}", f"--warmup={warmup}", f"--phase-steps={c.phase_steps}", *[f"--set={s}" for s in sets]]


def peer_cmd(c: Case, steps: int, warmup: int) -> list[str]:
    cmd = [*launcher(c.world_size), "-m", "benchmarks.throughput.peer", f"--model={c.model}",
           f"--width={c.width}", f"--num-classes={c.num_classes}", f"--precision={c.precision}",
           f"--batch-size={c.batch_size}", f"--image-size={c.image_size}", f"--steps={steps}", f"--warmup={warmup}"]
    cmd += [f"--compile={c.peer_compile}"] if c.peer_compile else []
    cmd += [f"--model-args={json.dumps(c.model_args)}"] if c.model_args else []
    return cmd + (["--channels-last"] if (c.peer_channels_last if c.peer_channels_last is not None
                                          else c.channels_last) else [])


def select(cases: list[Case], only: str, *, cpu: bool, allow_slow_dtypes: bool) -> list[Case]:
    """The cases whose name contains ``only`` (or any of several, comma-separated; all for ""), in the
    order ``only`` names them (a case once, where it first matches; the suite's order among the cases
    one text matches), so a run cut off at its limit has run the cases named first; and on the CPU
    (``cpu``) unless ``allow_slow_dtypes`` only those whose storage dtype has native kernels here; the
    others are named on stderr (they would time the reference fallback, not dptrain)."""
    wanted = [w.strip() for w in only.split(",")] if only else [""]
    cases = list({id(c): c for w in wanted for c in cases if w in c.name}.values())
    if not cpu or allow_slow_dtypes:
        return cases
    from dptrain.precision import cpu_native_support

    slow = [c for c in cases if not cpu_native_support(c.precision)]
    if slow:
        print(f"skipping {len(slow)} case(s) whose storage dtype has no native kernels on this CPU "
              f"(they would time the reference fallback, not dptrain): {', '.join(c.name for c in slow)}; "
              f"--allow-slow-dtypes runs them anyway", file=sys.stderr)
    return [c for c in cases if c not in slow]


def run_json(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """Run a benchmark command (with ``env`` added to this environment); return the last JSON line it printed."""
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=3600,
                          env={**os.environ, **env} if env else None)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    try:
        return json.loads(lines[-1])
    except ValueError as e:
        raise RuntimeError(f"{' '.join(cmd)} printed a line that is not JSON ({e}): {lines[-1][:200]}") from e


PROGRESS_KEYS = ("compiled", "cuda_graphs", "compile_s", "startup_s", "peak_mem_bytes", "state_bytes_per_rank",
                 "update_ms", "gather_ms")
"""Fields of a run's record repeated in its progress line, beside images/s: what
benchmarks/gpu/session_summary.py reads from a stage log (whether dptrain really ran compiled, and
each side's peak memory), even when the stage is cut off before the results file is written."""


def progress_line(case: str, side: str, rec: dict | None, error: str | None = None) -> str:
    """The line printed after each run: images/s (None for a run that failed, with its error)."""
    out = {"case": case, side: rec["images_per_s"] if rec else None}
    out.update({k: rec[k] for k in PROGRESS_KEYS if rec and rec.get(k) is not None})
    return json.dumps({**out, "error": error} if error else out)


def _median_of(records: list[dict], key: str) -> float | None:
    """The median of a field over the records that have it (None: none has)."""
    xs = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def render(rows: list[dict], machine: str, date: str, raw: list[dict]) -> str:
    out = [f"# dptrain vs peers: throughput ({date})", "", f"Machine: {machine}", "",
           "Median images/s over the repeats; both sides measured alternately in the same run, same model, "
           "batch, data (synthetic, on the device) and process count; the cases run round-robin, every other "
           "round in reverse order (and the peer first), so no run always follows the same one.", "",
           "| case | world | dptrain img/s | peer | peer img/s | ratio | dptrain exposed comm ms | dptrain update ms "
           "| dptrain state MB per rank |",
           "|---|---|---|---|---|---|---|---|---|"]
    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    for r in rows:  # "-": no such side, or every run of it failed
        ratio = f"{r['dptrain_ips'] / r['peer_ips']:.3f}x" if r["peer_ips"] and r["dptrain_ips"] else "-"
        out.append(f"| {r['case']} | {r['world_size']} | {num(r['dptrain_ips'])} | {r['peer_name'] or '-'} | "
                   f"{num(r['peer_ips'])} | {ratio} | {num(r['exposed_comm_ms'])} | {num(r.get('update_ms'))} | "
                   f"{num(r.get('state_mb'))} |")
    out += ["", "Raw JSON lines:", "", "```"] + [json.dumps(x) for x in raw] + ["```", ""]
    return "\n".join(out)


def report_path(out: str, kind: str, suite: str, device: str, tag: str) -> tuple[Path, str]:
    """``<out>/<kind>_<suite>_<hardware>_<yyyymmdd>[_<tag>].md`` (its folder made) and the date: the
    hardware is the CPU count for the CPU suites, the device's name for the GPU one."""
    hw = (f"cpu{len(os.sched_getaffinity(0))}" if suite not in GPU_SUITES
          else re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_"))
    date = datetime.date.today().strftime("%Y%m%d")
    path = Path(out) / f"{kind}_{suite}_{hw}_{date}{'_' + tag if tag else ''}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path, date


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny widths (smoke run)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--dry-run", action="store_true", help="print the commands and run nothing")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this text (or any of "
                    "several, comma-separated)")
    ap.add_argument("--allow-slow-dtypes", action="store_true",
                    help="run bf16/fp16 CPU cases even where the CPU has no native kernels for them")
    ap.add_argument("--tag", default="", help="suffix of the results file name, e.g. peers or buckets")
    args = ap.parse_args()
    cases = SUITES[args.suite](args.quick)
    cases = select(cases, args.only, cpu=args.suite not in GPU_SUITES, allow_slow_dtypes=args.allow_slow_dtypes)
    if args.suite == "buckets":
        from dptrain.distributed.buckets.probe import AUTO_DONE_ITER

        if args.warmup < AUTO_DONE_ITER:  # bench times auto's plan only after its probe and check
            print(f"--warmup {args.warmup} -> {AUTO_DONE_ITER}: every case warms up as long as the auto plan's "
                  "probe and check", file=sys.stderr)
            args.warmup = AUTO_DONE_ITER
    if not cases:
        print("no case to run", file=sys.stderr)
        return 2
    if args.dry_run:
        for c in cases:
            print(" ".join([*(f"{k}={v}" for k, v in c.env.items()), *dptrain_cmd(c, args.steps, args.warmup)]))
            if c.peer:
                print(" ".join([*(f"{k}={v}" for k, v in c.peer_env.items()), *peer_cmd(c, args.steps, args.warmup)]))
        return 0
    raw, failed = [], 0
    for rep in range(args.repeats):  # round-robin: a slow spell on a shared host lands on every case alike
        # and every other round in reverse order (ABBA), so that no run always follows the same one
        # one run per distinct command and round: cases that differ only in the peer share it (a failed
        # one too: its failure is reported for each case, not paid for again)
        ran: dict[str, dict | Exception] = {}
        for c in (cases if rep % 2 == 0 else cases[::-1]):
            sides = [("dptrain", dptrain_cmd), *([("peer", peer_cmd)] if c.peer else [])]
            for side, cmd in (sides if rep % 2 == 0 else sides[::-1]):
                argv, env = cmd(c, args.steps, args.warmup), c.peer_env if side == "peer" else c.env
                key = json.dumps([argv, env])
                shared = key in ran
                if not shared:
                    try:
                        ran[key] = run_json(argv, env)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:  # the other runs still count
                        ran[key] = e
                        failed += 1
                        print(str(e), file=sys.stderr)
                rec = ran[key]
                if isinstance(rec, Exception):
                    why = str(rec).strip().splitlines()
                    print(progress_line(c.name, side, None, why[-1] if why else type(rec).__name__), flush=True)
                    continue
                raw.append({"case": c.name, "side": side, "repeat": rep, **({"shared_run": True} if shared else {}),
                            **rec})
                print(progress_line(c.name, side, rec), flush=True)
    if not raw:
        print(f"every run failed ({failed})", file=sys.stderr)
        return 1
    rows = []
    for c in cases:
        ours = [r for r in raw if r["case"] == c.name and r["side"] == "dptrain"]
        theirs = [r for r in raw if r["case"] == c.name and r["side"] == "peer"]
        rows.append({"case": c.name, "world_size": c.world_size,
                     "dptrain_ips": statistics.median(r["images_per_s"] for r in ours) if ours else None,
                     "peer_ips": statistics.median(r["images_per_s"] for r in theirs) if theirs else None,
                     "peer_name": theirs[-1].get("peer") if theirs else None,
                     "exposed_comm_ms": statistics.median(r["exposed_comm_ms"] for r in ours) if ours else None,
                     "update_ms": _median_of(ours, "update_ms"),
                     "state_mb": (_median_of(ours, "state_bytes_per_rank") or 0) / 1e6 or None})
    ours = next((r for r in raw if r["side"] == "dptrain"), None)  # bench's record names the machine
    device = ours["device"] if ours else "unknown device"
    machine = f"{device}; {platform.platform()}; torch {ours['versions']['torch'] if ours else '?'}"
    path, date = report_path(args.out, "throughput", args.suite, device, args.tag)
    path.write_text(render(rows, machine, date, raw))
    print(f"wrote {path}")
    if failed:
        print(f"{failed} run(s) failed; the table has the others", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
