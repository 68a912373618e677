"""The one stop protocol (dptrain.train.stops) on hand-made control sums: no process group, no model."""
from __future__ import annotations

import pytest
import torch

from dptrain.distributed.control import FIELDS, LOSS, NONFINITE, STOP, StopFlag
from dptrain.errors import DivergenceError
from dptrain.train.health import HealthWatch
from dptrain.train.stops import StopAgreed, StopProtocol


def sums(stop: float = 0.0, nonfinite: float = 0.0, loss: float = 1.0) -> torch.Tensor:
    v = torch.zeros(len(FIELDS))
    v[STOP], v[NONFINITE], v[LOSS] = stop, nonfinite, loss
    return v


class Channel:
    """ControlChannel's reading side: the sums of each step, handed back ``lag`` steps later."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.pending: list[tuple[int, torch.Tensor]] = []

    def post(self, step: int, v: torch.Tensor) -> None:
        self.pending.append((step, v))

    def ready(self, step: int):
        while self.pending and self.pending[0][0] <= step - self.lag:
            yield self.pending.pop(0)

    def drain(self):
        return self.ready(2**62)


@pytest.mark.parametrize("lag", [0, 2])
def test_a_stop_takes_effect_lag_steps_after_the_step_that_carried_it(lag):
    stops, channel = StopProtocol(StopFlag()), Channel(lag)
    stopped_at = None
    for step in range(1, 20):
        channel.post(step, sums(stop=1.0 if step == 5 else 0.0))
        try:
            stops.read(channel, step)
        except StopAgreed:
            stopped_at = step
            break
    assert stopped_at == 5 + lag


def test_the_end_of_a_phase_stops_on_any_pending_request_and_passes_every_sum_on():
    stops, channel = StopProtocol(StopFlag()), Channel(lag=2)
    seen = []
    for step in range(1, 4):
        channel.post(step, sums(stop=1.0 if step == 3 else 0.0))
        stops.read(channel, step, lambda k, s: seen.append(k))
    assert seen == [1]
    with pytest.raises(StopAgreed):
        stops.settle(channel, lambda k, s: seen.append(k))
    assert seen == [1, 2, 3]


def test_a_phase_with_no_request_settles_quietly():
    stops, channel = StopProtocol(StopFlag()), Channel(lag=0)
    for step in range(3):
        channel.post(step, sums())
        stops.read(channel, step)
    stops.settle(channel)


class OneRank:
    world_size = 1

    def allreduce_sum_(self, t: torch.Tensor) -> None:
        pass


def test_the_vote_before_a_phase_stops_on_a_local_request():
    flag = StopFlag()
    stops = StopProtocol(flag)
    stops.vote(OneRank(), torch.device("cpu"))
    flag.requested = True
    with pytest.raises(StopAgreed):
        stops.vote(OneRank(), torch.device("cpu"))


def test_a_non_finite_streak_without_loss_scaling_ends_the_run_naming_the_layer(tmp_path):
    watch = HealthWatch(tmp_path, rank=0, world_size=2, max_nonfinite=3, scaled=False,
                        first_bad_layer=lambda: "conv1")
    for step in range(1, 11):
        watch.observe(step, sums(loss=2.0))
    watch.observe(11, sums(nonfinite=1.0, loss=float("nan")))
    watch.observe(12, sums(nonfinite=2.0, loss=float("nan")))
    with pytest.raises(DivergenceError, match=r"3 iteration\(s\) in a row since 11.*first non-finite layer: conv1"):
        watch.observe(13, sums(nonfinite=2.0, loss=float("nan")))


def test_with_loss_scaling_a_non_finite_loss_is_an_overflow_not_a_stop(tmp_path):
    watch = HealthWatch(tmp_path, rank=0, world_size=1, max_nonfinite=1, scaled=True, first_bad_layer=lambda: "?")
    for step in range(1, 5):
        watch.observe(step, sums(nonfinite=1.0, loss=float("inf")))
    assert watch.suspect(4) is not None  # but the divergence watch follows it


def test_a_loss_far_above_its_range_marks_snapshots_from_the_weights_before_it(tmp_path):
    (tmp_path / "snapshot_iter_4.pt").write_bytes(b"x")
    (tmp_path / "snapshot_iter_8.pt").write_bytes(b"x")
    watch = HealthWatch(tmp_path, rank=0, world_size=1, max_nonfinite=5, scaled=False, first_bad_layer=lambda: "?")
    for step in range(1, 9):
        watch.observe(step, sums(loss=1.0))
    watch.observe(9, sums(loss=1e6))  # computed with the weights of iteration 8
    assert (tmp_path / "snapshot_iter_8.pt.diverging").exists()
    assert not (tmp_path / "snapshot_iter_4.pt.diverging").exists()
    assert watch.suspect(7) is None and "iteration 8" in watch.suspect(9)
    assert "snapshot_iter_4.pt" in str(watch.error("stopped"))
