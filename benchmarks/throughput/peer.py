"""The peer dptrain is measured against: plain PyTorch DDP + torch.amp, same model and data.

Runs under torchrun (or alone for world size 1) and prints one JSON line from rank 0 with
``images_per_s``. Precision modes:
  fp32        fp32 weights, no autocast
  bf16        fp32 weights, autocast(bfloat16)                      (torch AMP for bf16)
  fp16        fp32 weights, autocast(float16) + GradScaler          (torch AMP for fp16)
With ``--compile [MODE]`` the (DDP-wrapped) model runs under torch.compile: the compiled peer.
``startup_s`` is the time from the start of main() to the first timed step (compile included).
The optimizer is torch.optim.SGD (momentum, weight decay; foreach on CPU, fused on CUDA).
Data: dptrain's synthetic source and device-side normalisation, so input cost is identical.

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m benchmarks.throughput.peer \
        --model resnet18_cifar --width 32 --precision bf16 --batch-size 32 --image-size 32
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dptrain.data.base import DeviceFeeder
from dptrain.data.sampling import SampleOrder
from dptrain.data.sources.builtin import synthetic_source
from dptrain.inductor import prepare as prepare_inductor
from dptrain.models import build_model
from dptrain.train.compiled import cudagraph_skips
from dptrain.train.outputs import training_loss

AUX_LOSS_WEIGHT = 0.3
"""``model.aux_loss_weight``'s default, for models with auxiliary heads."""


def make_step(model_name: str, width: int, num_classes: int, precision: str, batch_size: int, image_size: int,
              channels_last: bool, device: torch.device, rank: int = 0, world: int = 1,
              bucket_mb: float = 25.0, compile_mode: str | None = None,
              model_args: dict[str, Any] | None = None) -> Callable[[], None]:
    """One training step of the peer (DDP when ``world`` > 1: the process group must be up).
    ``model_name`` and ``model_args`` as dptrain's ``model.name`` and ``model.args`` (a zoo entry or an
    import path: dptrain's own builder, so both sides train the same module); the loss is dptrain's too
    (the logits of a tuple or dict output, plus its auxiliary heads'). ``compile_mode``: the model
    (DDP-wrapped, so torch's DDPOptimizer splits the graph at the buckets) under torch.compile in that
    mode ("default", "reduce-overhead", ...); None: eager."""
    cuda = device.type == "cuda"
    torch.manual_seed(1)
    model = build_model(model_name, num_classes=num_classes, width=width, channels_last=channels_last,
                        args=model_args).to(device)
    if world > 1:
        model = DDP(model, device_ids=[device.index] if cuda else None, bucket_cap_mb=bucket_mb,
                    gradient_as_bucket_view=True)
    if compile_mode is not None:
        prepare_inductor()  # the same compile caches as dptrain's, so both sides start alike
        model = torch.compile(model, mode=None if compile_mode == "default" else compile_mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4,
                          **({"fused": True} if cuda else {"foreach": True}))
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    src = synthetic_source(num_classes, image_size, 1_000_000, 1, device)
    feeder = DeviceFeeder(src.train_batches(SampleOrder(rank, world, batch_size, 1), 0), device=device,
                          dtype=torch.float32, mean=src.mean, scale=src.scale, channels_last=channels_last)

    def step() -> None:
        x, y = next(feeder)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = training_loss(model(x), y, label_smoothing=0.0, aux_weight=AUX_LOSS_WEIGHT)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def cuda_graph_fields(compile_mode: str | None, cuda: bool, skips: int) -> dict[str, bool | int]:
    """Under torch.compile's "reduce-overhead" mode, whether the step ran as CUDA graphs (on CUDA, with
    none of its graphs skipped) and how many graphs cudagraph trees declined to record, which they do
    with no error (dptrain's bench reports the same of its own side); nothing in other modes."""
    if compile_mode != "reduce-overhead":
        return {}
    return {"cuda_graphs": cuda and skips == 0, "cuda_graph_skips": skips}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18_cifar", help="a zoo entry or \"package.module:callable\"")
    ap.add_argument("--model-args", type=json.loads, default={}, metavar="JSON",
                    help="keyword arguments of an import-path model, as dptrain's [model.args]")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--num-classes", type=int, default=10)
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    ap.add_argument("--batch-size", type=int, default=32, help="per process")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                    help="torch.compile the (DDP) model, in MODE (default: torch's default mode)")
    args = ap.parse_args()

    started = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # as dptrain's train.cudnn_benchmark default
    else:
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    step = make_step(args.model, args.width, args.num_classes, args.precision, args.batch_size, args.image_size,
                     args.channels_last, device, rank, world, args.bucket_mb, args.compile, args.model_args)

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)  # the timed steps' peak, as dptrain bench reports it
    startup_s = time.perf_counter() - started
    times = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    graphs = cuda_graph_fields(args.compile, cuda, cudagraph_skips())  # at start-up and in the timed steps
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        g = args.batch_size * world
        print(json.dumps({
            "peer": f"{'DDP + ' if world > 1 else ''}{'torch.compile + ' if args.compile else ''}"
                    f"{'fp32' if args.precision == 'fp32' else 'autocast ' + args.precision}"
                    f"{'' if args.compile in (None, 'default') else ' (' + args.compile + ')'}",
            "startup_s": round(startup_s, 2),
            "images_per_s": round(g * args.steps / sum(times), 2),
            "step_ms_median": round(1000 * statistics.median(times), 3),
            "world_size": world, "batch_size": args.batch_size, "model": args.model,
            "precision": args.precision, "peak_mem_bytes": peak, **graphs,
        }), flush=True)


if __name__ == "__main__":
    main()
