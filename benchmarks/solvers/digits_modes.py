"""Digits top-1 with 2 gloo solvers for each precision mode and for sharded masters, against the
recipe each is a variant of, and for a user's model in each storage dtype.

Three groups of runs of one recipe that differ in one setting:

- **O1 beside O2** (``precision.mode``): LeNet with ``launch/configs/digits.toml`` (SGD) in fp16 and
  bf16, storage mode (16-bit weights, fp32 masters) against autocast mode (fp32 weights under
  ``torch.autocast``). The bar: autocast within 1 point of storage in each dtype.
- **Sharded masters** (``reducer.shard``): LeNet with ``launch/configs/digits_adamw.toml`` (AdamW),
  unsharded against ``reducer.shard = "optimizer"``, in fp32 and in bf16. The bars: final top-1 within
  0.5 point; the weights after 50 iterations within 1e-5 relative of unsharded (a reduce-scatter may
  sum in another order than the allreduce), and identical on both ranks.
- **A user's model** (``precision.storage``): the example vision transformer by import path with
  ``examples/vit_digits.toml`` (AdamW, cosine) in fp32, bf16 and fp16. The bar: 95 % top-1 in each.

Every run trains 400 iterations of 32 images per solver (global batch 64) with the recipe's schedule,
in two processes of one thread each that share the 2 cores, and tests on the whole test set once at
the end. The relative difference is the fp32 masters'; "identical on both ranks" compares the masters and
the model's weights and buffers bit for bit, after the gathers.

    python -m benchmarks.solvers.digits_modes            # about 14 minutes on 2 cores
    python -m benchmarks.solvers.digits_modes --only vit

Writes ``benchmarks/results/modes_digits_cpu2_<yyyymmdd>.md`` (``modes_digits_<groups>_cpu2_...`` for
some of the groups) with one JSON line per run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dptrain.config import load_config
from dptrain.distributed.comm import Communicator, import_dynamo_first
from dptrain.tools.bench import device_name, git_commit, versions
from dptrain.train import Trainer

REPO = Path(__file__).resolve().parents[2]
CHECK_ITER = 50
"""The iteration whose weights the shard comparison checks."""

MODES = {f"{dtype} {mode}": ("launch/configs/digits.toml", [f"precision.storage={dtype}", f"precision.mode={mode}"])
         for dtype in ("fp16", "bf16") for mode in ("storage", "autocast")}
SHARDS = {f"{dtype} shard={shard}": ("launch/configs/digits_adamw.toml", [f"precision.storage={dtype}", f"reducer.shard={shard}"])
          for dtype in ("fp32", "bf16") for shard in ("none", "optimizer")}
VIT = {f"vit {dtype}": ("examples/vit_digits.toml", [f"precision.storage={dtype}"]) for dtype in ("fp32", "bf16", "fp16")}
GROUPS = {"modes": MODES, "shard": SHARDS, "vit": VIT}


def _weights(t: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """The fp32 masters by parameter name (collective when sharded), and the model's own weights and
    buffers (in their storage dtype) as this rank holds them."""
    t.weights_whole()
    return {"masters": t.flat.master_state(),
            "model": {k: v.detach().clone() for k, v in t.model.state_dict().items()}}


def _worker(rank: int, world: int, init: str, out: str, runs: dict[str, tuple[str, list[str]]]) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    import_dynamo_first()
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        for n, (name, (recipe, sets)) in enumerate(runs.items()):
            cfg = load_config(REPO / recipe,
                              [*sets, "train.device=cpu", "solver.display=0", "solver.test_interval=0",
                               f"train.run_dir={json.dumps(f'{out}/run{n}')}"])
            t = Trainer(cfg, Communicator.from_initialized(torch.device("cpu")))
            t0 = time.perf_counter()
            for i in range(cfg.solver.max_iter):
                t.train_step()
                if i + 1 == CHECK_ITER:
                    torch.save(_weights(t), Path(out) / f"{name}.rank{rank}.pt")
            top1 = t.test()["test_top1"]
            t.close()
            if rank == 0:
                rec = {"run": name, "recipe": recipe, "sets": sets, "test_top1": top1,
                       "max_iter": cfg.solver.max_iter, "seconds": round(time.perf_counter() - t0, 1),
                       "attention": t.attention}
                with open(Path(out) / "runs.jsonl", "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(json.dumps(rec), flush=True)
    finally:
        dist.destroy_process_group()


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(||a - b|| / ||b|| over all tensors, the largest per-tensor max|a - b| / max|b|)."""
    num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in b) ** 0.5
    den = sum(float(b[k].double().pow(2).sum()) for k in b) ** 0.5
    worst = max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in b)
    return num / den, worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", choices=sorted(GROUPS), default=sorted(GROUPS))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--max-iter", type=int, default=0, help="override the recipes' 400 (a smoke run)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    runs = {k: (recipe, [*sets, *([f"solver.max_iter={args.max_iter}"] if args.max_iter else [])])
            for g in args.only for k, (recipe, sets) in GROUPS[g].items()}
    with tempfile.TemporaryDirectory(prefix="digits-modes-") as tmp:
        mp.spawn(_worker, args=(2, f"{tmp}/rdzv", tmp, runs), nprocs=2)
        recs = {r["run"]: r for r in map(json.loads, Path(f"{tmp}/runs.jsonl").read_text().splitlines())}
        w = {(n, r): torch.load(Path(tmp) / f"{n}.rank{r}.pt") for n in runs for r in (0, 1)}
    rows, ok = [], True
    if "modes" in args.only:
        rows += ["## O1 beside O2: `launch/configs/digits.toml` (SGD)", "",
                 "| dtype | storage top-1 | autocast top-1 | difference (pp) |", "|---|---|---|---|"]
        for dtype in ("fp16", "bf16"):
            a, b = recs[f"{dtype} storage"]["test_top1"], recs[f"{dtype} autocast"]["test_top1"]
            ok &= abs(100 * (b - a)) <= 1.0
            rows.append(f"| {dtype} | {a:.4f} | {b:.4f} | {100 * (b - a):+.2f} |")
        rows.append("")
    if "shard" in args.only:
        rows += ["## Sharded masters: `launch/configs/digits_adamw.toml` (AdamW)", "",
                 f"| dtype | unsharded top-1 | sharded top-1 | difference (pp) | weights at iteration {CHECK_ITER}: "
                 "relative difference (norm; worst tensor) | ranks identical |", "|---|---|---|---|---|---|"]
        for dtype in ("fp32", "bf16"):
            none, opt = f"{dtype} shard=none", f"{dtype} shard=optimizer"
            a, b = recs[none]["test_top1"], recs[opt]["test_top1"]
            rel, worst = _rel(w[opt, 0]["masters"], w[none, 0]["masters"])
            same = all(torch.equal(w[opt, 0][part][k], w[opt, 1][part][k]) for part in ("masters", "model")
                       for k in w[opt, 0][part])
            ok &= abs(100 * (b - a)) <= 0.5 and rel <= 1e-5 and same
            rows.append(f"| {dtype} | {a:.4f} | {b:.4f} | {100 * (b - a):+.2f} | {rel:.2e}; {worst:.2e} | {same} |")
        rows.append("")
    if "vit" in args.only:
        rows += ["## A user's model: `examples/vit_digits.toml` (`examples.vit:VisionTransformer`, AdamW)", "",
                 "| storage | top-1 | model.attention chosen |", "|---|---|---|"]
        for dtype in ("fp32", "bf16", "fp16"):
            r = recs[f"vit {dtype}"]
            ok &= r["test_top1"] >= 0.95
            rows.append(f"| {dtype} | {r['test_top1']:.4f} | {r['attention']} |")
        rows.append("")
    today = datetime.date.today().strftime("%Y%m%d")
    groups = "" if set(args.only) == set(GROUPS) else "_".join(sorted(args.only)) + "_"
    out = Path(args.out) / f"modes_digits_{groups}cpu2_{today}.md"
    text = [f"# Digits top-1, 2 gloo solvers: precision modes, sharded masters and a user's model ({today})", "",
            f"`python -m benchmarks.solvers.digits_modes --only {' '.join(args.only)}`: 400 iterations of "
            "32 images per solver, the recipe's schedule, one test over the whole test set at the end.", "",
            f"Device: {device_name(torch.device('cpu'))}; git {git_commit()}; versions {json.dumps(versions())}", "",
            *rows, "Raw records:", "", "```", *(json.dumps(r) for r in recs.values()), "```", ""]
    out.write_text("\n".join(text))
    print("\n".join(rows))
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
