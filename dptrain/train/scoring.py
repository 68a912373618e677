"""The test phase: top-1/top-5 over the whole test set, every sample counted once across ranks.

Each rank scores its slice (``dptrain.data.sampling.eval_range``) and the counts are summed
over the ranks at the end. Every rank runs the same number of rounds, the most any rank's
slice needs, so the per-batch collectives pair up when the slices differ by a batch: a rank
whose slice is done posts its control vector with nothing scored. Each round sums a stop
flag over the ranks (one small async collective) and hands it to the run's
:class:`~dptrain.train.stops.StopProtocol`, so a stop request abandons the test at the same
batch on every rank.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from dptrain.data.base import DROPPED_LABEL
from dptrain.data.sampling import eval_range
from dptrain.distributed.comm import Communicator
from dptrain.distributed.control import ControlChannel
from dptrain.train.stops import StopProtocol

CORRECT1, CORRECT5, SCORED, BAD = range(4)


def score_rounds(num_test: int, world_size: int, batch_size: int, test_iter: int) -> int:
    """Batches every rank runs: the most any rank's slice needs, at most ``test_iter`` (0: no limit)."""
    rounds = max(-(-len(eval_range(num_test, r, world_size)) // batch_size) for r in range(world_size))
    return min(rounds, test_iter) if test_iter else rounds


@torch.no_grad()
def score(forward: Callable[[torch.Tensor], torch.Tensor], batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
          rounds: int, *, num_classes: int, comm: Communicator, device: torch.device,
          stops: StopProtocol) -> torch.Tensor:
    """This rank's counts ([4] float64: top-1 hits, top-5 hits, samples scored, and 0 for the
    bad records, which the caller fills from the feeder) over ``rounds`` batches of ``batches``.
    Raises :class:`~dptrain.train.stops.StopAgreed` at the batch where every rank stops."""
    counts = torch.zeros(4, dtype=torch.float64, device=device)
    control = ControlChannel(comm, device)
    k = min(5, num_classes)
    for i in range(rounds):
        batch = next(batches, None)
        if batch is not None:
            x, y = batch
            top = forward(x).float().topk(k, dim=1).indices
            kept = y != DROPPED_LABEL  # a bad record skipped under data.max_bad_records scores nothing
            hit = (top == y[:, None]) & kept[:, None]
            counts[CORRECT1] += hit[:, 0].sum()
            counts[CORRECT5] += hit.any(dim=1).sum()
            counts[SCORED] += kept.sum()
        control.vector(stops.flag.requested)
        control.submit(i, reduce=True)
        stops.read(control, i)
    stops.settle(control)  # the last rounds' flags: every rank reads the same
    return counts


def score_record(counts: list[float]) -> dict[str, float]:
    """The metrics record of the summed counts."""
    total = max(counts[SCORED], 1)
    res = {"test_top1": counts[CORRECT1] / total, "test_top5": counts[CORRECT5] / total,
           "test_samples": int(counts[SCORED])}
    return {**res, "test_bad_records": int(counts[BAD])} if counts[BAD] else res
