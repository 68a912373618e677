"""``dptrain plot RUN_DIR``: one PNG with the curves a user checks first, from metrics.jsonl.

Panels: training loss; test top-1 (and top-5); images/s; loss scale with the skipped steps;
compute time per rank per step (a straggler stands out as the top line). A panel whose
figures the run did not record says so instead of drawing an empty frame.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError, InputError
from dptrain.observe.metrics import read_metrics


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    got = [(r["iter"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [i for i, _ in got], [float(v) for _, v in got]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``out`` (default ``RUN_DIR/metrics.png``) from ``RUN_DIR/metrics.jsonl``; return its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # a file, never a window: works on a headless node
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError(f"dptrain plot needs matplotlib ({e}); pip install 'dptrain[plot]'") from e
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise InputError(f"{str(path)!r} does not exist; give the train.run_dir of a run (it holds metrics.jsonl)")
    records = read_metrics(path)
    if not any("iter" in r for r in records):
        raise InputError(f"{str(path)!r} holds no records yet; plot a run after its first display")
    out = Path(out) if out is not None else run_dir / "metrics.png"

    fig, axes = plt.subplots(5, 1, figsize=(8, 13), sharex=True)
    fig.suptitle(f"dptrain run {run_dir.resolve().name}")

    def panel(ax: Any, keys: list[tuple[str, str]], ylabel: str, log_y: bool = False) -> None:
        drawn = False
        for key, label in keys:
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=label)
                drawn = True
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, f"no {ylabel} recorded", ha="center", va="center", transform=ax.transAxes)
        elif len(keys) > 1:
            ax.legend(loc="best", fontsize="small")
        if log_y and drawn:
            ax.set_yscale("log")

    panel(axes[0], [("loss", "train loss")], "loss")
    panel(axes[1], [("test_top1", "top-1"), ("test_top5", "top-5")], "test accuracy")
    panel(axes[2], [("images_per_s", "global")], "images/s")
    panel(axes[3], [("loss_scale", "loss scale")], "loss scale", log_y=True)
    xs, skipped = _series(records, "skipped_steps")
    if xs and any(skipped):
        twin = axes[3].twinx()
        twin.step(xs, skipped, where="post", color="tab:red", label="skipped steps")
        twin.set_ylabel("skipped steps", color="tab:red")
    per_rank = [(r["iter"], r["compute_ms_per_rank"]) for r in records if r.get("compute_ms_per_rank")]
    ax = axes[4]
    if per_rank:
        for rank in range(len(per_rank[0][1])):
            pts = [(i, ms[rank]) for i, ms in per_rank if rank < len(ms)]
            ax.plot([i for i, _ in pts], [m for _, m in pts], label=f"rank {rank}")
        ax.legend(loc="best", fontsize="small", ncol=4)
    else:
        ax.text(0.5, 0.5, "no per-rank compute times recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("compute ms / step")
    ax.grid(alpha=0.3)
    ax.set_xlabel("iteration")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def add_arguments(p: Any) -> None:
    """``dptrain plot``'s arguments."""
    p.description = ("Loss, test accuracy, images/s, loss scale and skipped steps, and compute time per rank, from "
                     "RUN_DIR/metrics.jsonl, into one PNG (needs matplotlib).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a train.run_dir")
    p.add_argument("--out", metavar="PNG", help="output file (default: RUN_DIR/metrics.png)")


def main(args: Any) -> dict[str, str]:
    """``dptrain plot``: the PNG written."""
    return {"plot": str(plot_run(args.run_dir, args.out))}
