"""Where a training step's CPU time goes: dptrain's ``Trainer.train_step`` against the peer's plain
PyTorch loop (``benchmarks/throughput/peer.py``: the same model, data, learning rate, momentum and weight
decay, fixed rate), one process, per operator.

One process only: no reducer hooks, no DDP, no collectives; so it separates the compute side of
a gap from the communication side, not more. Both sides share the process's allocator, with glibc's
defaults (``train.host_malloc`` is applied by dptrain's process setup, which this tool skips). The
times are operators' self CPU times (Python and other host time outside the operators is not in them).

Both run in this process, alternately (every other round the peer first), so a drift of the
host's speed falls on both alike; each round profiles ``--steps`` steps of each after a short
warm-up (``torch.profiler``, CPU self time per operator). The report gives the step total and the
convolutions per round, then the operators by their largest median self time, with call counts
(deterministic: a count that differs is work one side does and the other does not).

    python -m benchmarks.throughput.op_profile                       # ResNet-18 CIFAR width 32, batch 32, fp32 NHWC
    python -m benchmarks.throughput.op_profile --threads 1           # as each of 2 solvers on 2 cores
    python -m benchmarks.throughput.op_profile --layout nchw --rounds 2
    python -m benchmarks.throughput.op_profile --precision bf16 --threads 1   # bf16 storage vs autocast bf16
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[2]
CONV_OPS = ("aten::convolution_backward", "aten::mkldnn_convolution")


def op_times(step: Callable[[], None], steps: int, warmup: int) -> dict[str, tuple[float, float]]:
    """operator -> (calls per step, self CPU ms per step) over ``steps`` profiled steps."""
    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            step()
    return {e.key: (e.count / steps, e.self_cpu_time_total / steps / 1e3) for e in p.key_averages()}


def dptrain_step(args: argparse.Namespace, run_dir: str) -> tuple[Callable[[], None], Callable[[], None]]:
    from dptrain.config import load_config
    from dptrain.distributed.comm import Communicator
    from dptrain.topology import Topology
    from dptrain.train import Trainer

    cfg = load_config(str(REPO / "launch" / "configs" / "resnet50_synthetic.toml"), [
        f"model.name={args.model}", f"model.width={args.width}", "model.num_classes=10",
        f"model.channels_last={str(args.layout == 'nhwc').lower()}", f"data.image_size={args.image_size}",
        f"data.batch_size={args.batch_size}", f"precision.storage={args.precision}", "data.source=synthetic",
        "solver.base_lr=0.01", "solver.lr_policy=fixed", "solver.warmup_iter=0", "solver.momentum=0.9",
        "solver.weight_decay=0.0005", "solver.display=0", f"train.run_dir={json.dumps(run_dir)}",
        *[f"model.args.{k}={json.dumps(v)}" for k, v in args.model_args.items()], *args.set])
    t = Trainer(cfg, Communicator.from_env(Topology(), 60, torch.device("cpu")))
    return t.train_step, t.close


def peer_step(args: argparse.Namespace) -> Callable[[], None]:
    """The peer's own step (``benchmarks/throughput/peer.py``: fp32, or autocast for bf16/fp16), in this process."""
    from benchmarks.throughput.peer import make_step

    return make_step(args.model, args.width, 10, args.precision, args.batch_size, args.image_size,
                     args.layout == "nhwc", torch.device("cpu"), model_args=args.model_args or None)


def report(rounds: list[dict[str, dict[str, tuple[float, float]]]], top: int) -> str:
    def total(t: dict[str, tuple[float, float]]) -> float:
        return sum(ms for _, ms in t.values())

    def conv(t: dict[str, tuple[float, float]]) -> float:
        return sum(t.get(k, (0.0, 0.0))[1] for k in CONV_OPS)

    out = ["Per round, operator self CPU ms per step (all operators, and the convolutions):", "",
           "| round | dptrain op ms | peer op ms | dptrain / peer | dptrain conv ms | peer conv ms |",
           "|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(rounds):
        d, p = r["dptrain"], r["peer"]
        out.append(f"| {i} | {total(d):.1f} | {total(p):.1f} | {total(d) / total(p):.3f} | {conv(d):.1f} "
                   f"| {conv(p):.1f} |")
    ratio = statistics.median(total(r["dptrain"]) / total(r["peer"]) for r in rounds)
    out += ["", f"Median dptrain / peer operator time per step: {ratio:.3f}.", "",
            "Per operator, medians over the rounds (calls and self CPU ms per step):", "",
            "| operator | dptrain calls | dptrain ms | peer calls | peer ms |", "|---|---:|---:|---:|---:|"]
    med: dict[str, dict[str, tuple[float, float]]] = {"dptrain": {}, "peer": {}}  # medians over the rounds
    for side in med:
        for k in {k for r in rounds for k in r[side]}:
            vals = [r[side].get(k, (0.0, 0.0)) for r in rounds]
            med[side][k] = (statistics.median(c for c, _ in vals), statistics.median(ms for _, ms in vals))
    keys = sorted(set(med["dptrain"]) | set(med["peer"]),
                  key=lambda k: -max(med["dptrain"].get(k, (0, 0))[1], med["peer"].get(k, (0, 0))[1]))
    for k in keys[:top]:
        (dc, dm), (pc, pm) = med["dptrain"].get(k, (0, 0)), med["peer"].get(k, (0, 0))
        out.append(f"| `{k}` | {dc:g} | {dm:.2f} | {pc:g} | {pm:.2f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18_cifar")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--model-args", type=json.loads, default={}, help="model.args as JSON, for an import-path --model")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--layout", choices=("nhwc", "nchw"), default="nhwc")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                    help="dptrain's storage dtype; the peer runs autocast in it (fp32: neither)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: every core)")
    ap.add_argument("--top", type=int, default=25, help="operators listed")
    ap.add_argument("--set", action="append", default=[], help="a dptrain config override (repeatable)")
    args = ap.parse_args(argv)
    if min(args.rounds, args.steps) < 1 or args.warmup < 0:
        print("op_profile.py: error: --rounds and --steps must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as run_dir:
        ours, close = dptrain_step(args, run_dir)
        rounds = []
        try:
            sides = {"dptrain": ours, "peer": peer_step(args)}
            for i in range(args.rounds):
                order = ["dptrain", "peer"] if i % 2 == 0 else ["peer", "dptrain"]
                rounds.append({side: op_times(sides[side], args.steps, args.warmup) for side in order})
        finally:
            close()
    print(f"## One-process step, per operator: {args.model} width {args.width}, batch {args.batch_size}, "
          f"{args.precision} {args.layout.upper()}, {torch.get_num_threads()} threads, {args.rounds} alternated "
          f"rounds of {args.steps} profiled steps\n")
    print(report(rounds, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
