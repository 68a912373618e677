"""Parameters without a gradient: agreed over the ranks, reduced as zeros, and left alone by the update.

A parameter gets no gradient in an iteration when it takes no part in the loss: a branch not
taken (on some ranks, or in some iterations), an auxiliary head left out of the loss, a layer
the model skips. Every rank still launches every bucket, in the same order, with zeros in the
place of the missing gradient (the flat gradient buffer is zero there), so no collective is
ever missing and no rank hangs. What remains is the update: torch's optimizers skip a parameter
whose ``.grad`` is None (no weight decay, no momentum step), and dptrain does the same for a
parameter that got no gradient on *any* rank, while one that got a gradient on some rank is
updated with their average, as DDP would.

Which parameters, on which ranks (:class:`UnusedParams`):

* **The first iteration** agrees on the local sets with one blocking gather (at start-up,
  once). Every parameter that was unused on some rank becomes a *candidate*; the warning
  names them once, and ``model.unused_parameters = "error"`` ends the run there, on every rank.
* **Every later iteration** with candidates sums a flag per candidate (1 where this rank gave
  it a gradient) in one small collective, launched after the last bucket and waited for with
  them; :meth:`UnusedParams.hold` hands the update the device mask of the candidates no rank
  used. Device ops only: no host sync. A model with no candidate pays nothing.
* **A parameter first left without a gradient later** (not a candidate) sets the control
  vector's ``unused`` flag (``dptrain.distributed.control``) in the next iteration. Every
  rank reads that sum at the same step and gathers again ``lag`` iterations later (the
  control channel's read-back delay, 0 on the CPU): the new parameters become candidates from
  then on. Until then such a parameter is updated with a zero gradient (decay and momentum
  apply), for 1 + lag iterations at most, and the warning says so.

The candidates are part of the snapshot, so a resumed run treats them as the interrupted one did.
"""
from __future__ import annotations

import logging

import torch

from dptrain.distributed.comm import AsyncAllreduce, Communicator, Work
from dptrain.distributed.control import UNUSED
from dptrain.errors import ConfigError
from dptrain.flat import FlatParams

log = logging.getLogger(__name__)

NAMED = 5
"""Parameters named in the warning or error line; the rest are counted."""


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - NAMED} more" if len(names) > NAMED else ""
    return ", ".join(names[:NAMED]) + more


class UnusedParams:
    """Which parameters got no gradient on any rank (module docstring). One per solver."""

    def __init__(self, flat: FlatParams, comm: Communicator, *, mode: str, lag: int) -> None:
        self.flat, self.comm, self.mode, self.lag = flat, comm, mode, lag
        self.candidates: list[str] = []
        """Parameters some rank left without a gradient, agreed by every rank, in layout order."""
        self._local: set[str] = set()
        """This rank's parameters without a gradient in the current iteration."""
        self._seen_local: set[str] = set()
        """Every parameter this rank left without a gradient that is not a candidate yet."""
        self._agreed_once = False
        self._agree_at: int | None = None
        self._new_flag = False
        self._work: Work | None = None
        self._flags: torch.Tensor | None = None  # [candidates] fp32: ranks that gave each a gradient
        self._first_unused_on_all: list[str] = []
        self.iteration = 0
        """The iteration being trained (set by the trainer), for the lines this writes."""

    # ------------------------------------------------------------------ the trainer's side

    def note(self, unused: list[str]) -> None:
        """This rank's parameters that got no gradient in this iteration's backward (all micro-batches)."""
        self._local = set(unused)
        new = self._local - set(self.candidates)
        if new and self._agreed_once:
            self._new_flag = True  # rides on the next iteration's control vector
            self._seen_local |= new

    def control_flag(self) -> float:
        """The control vector's ``unused`` entry for this iteration: 1 if this rank met a parameter
        without a gradient that is not a candidate yet (then cleared)."""
        flag, self._new_flag = self._new_flag, False
        return 1.0 if flag else 0.0

    def observe(self, step: int, sums: torch.Tensor) -> None:
        """The control sums of ``step``: a new unused parameter on some rank schedules a gather
        ``lag`` iterations later, the same iteration on every rank."""
        if sums[UNUSED] > 0 and self._agree_at is None:
            self._agree_at = step + self.lag

    def maybe_agree(self, iteration: int) -> None:
        """Between iterations: the gather scheduled by :meth:`observe`, when it is due (collective)."""
        if self._agree_at is not None and iteration >= self._agree_at:
            self._agree_at = None
            self._agree(self._seen_local, first=False)
            self._seen_local = set()

    # ------------------------------------------------------------------ the reducer's side

    def launch(self, collective: AsyncAllreduce) -> None:
        """After the last bucket's launch: sum the candidates' flags over the ranks (async)."""
        if not self._agreed_once or not self.candidates:
            return
        used = [0.0 if n in self._local else 1.0 for n in self.candidates]
        self._flags = torch.tensor(used, dtype=torch.float32, device=self.flat.groups[0].grads.device)
        if self.comm.world_size > 1:
            self._work = collective.allreduce_async(self._flags)

    def finish(self) -> None:
        """After the buckets: the candidates' sums are in (or, in the first iteration, the gather)."""
        if not self._agreed_once:
            self._agree(self._local, first=True)
            return
        if self._work is not None:
            self._work.wait()
            self._work = None

    # ------------------------------------------------------------------ the update's side

    def hold(self) -> tuple[list[str], torch.Tensor] | None:
        """(candidates, [candidates] bool device mask: True where no rank gave a gradient), or None
        when every parameter is used; the update keeps those parameters and their state as they were."""
        if self._first_unused_on_all:  # the first iteration: known on the host from the gather
            names, self._first_unused_on_all = self._first_unused_on_all, []
            return names, torch.ones(len(names), dtype=torch.bool, device=self.flat.groups[0].grads.device)
        if not self.candidates or self._flags is None:
            return None
        flags, self._flags = self._flags, None
        return self.candidates, flags == 0

    # ------------------------------------------------------------------ agreement

    def _agree(self, mine: set[str], *, first: bool) -> None:
        """Gather every rank's parameters without a gradient (blocking; every rank at the same point)."""
        per_rank = self.comm.allgather_object(sorted(mine)) if self.comm.world_size > 1 else [sorted(mine)]
        self._agreed_once = True
        union = set().union(*map(set, per_rank))
        order = self.flat.layout_order
        new = [n for n in order if n in union and n not in self.candidates]
        if first:
            on_all = set.intersection(*map(set, per_rank))
            self._first_unused_on_all = [n for n in order if n in on_all]
        if not new:
            return
        where = "; ".join(f"rank {r}: {len(u)}" for r, u in enumerate(per_rank) if u)
        if self.mode == "error":
            raise ConfigError(f"model.unused_parameters = \"error\": {len(new)} parameter(s) got no gradient in "
                              f"iteration {self.iteration + 1} ({where}): {_listed(new)}; make them take part in the "
                              f"loss, freeze them (model.freeze), or set model.unused_parameters = \"auto\"")
        self.candidates = [n for n in order if n in union or n in self.candidates]
        if self.comm.rank == 0:
            later = "" if first else (f"; until now (up to {1 + self.lag} iteration(s)) they were updated with a zero "
                                      f"gradient")
            log.warning("%d parameter(s) got no gradient in iteration %d (%s): %s. They are reduced as zeros on every "
                        "rank, and a parameter no rank gave a gradient keeps its value and optimizer state, as with "
                        "torch's optimizers%s", len(new), self.iteration + 1, where, _listed(new), later)

    def state_dict(self) -> dict[str, list[str] | bool]:
        return {"candidates": list(self.candidates), "agreed": self._agreed_once}

    def load_state_dict(self, state: dict[str, list[str] | bool]) -> None:
        """A resumed run goes on from the interrupted one's candidates (those this model has) and,
        past its first iteration, without a first gather, as the interrupted run would have."""
        saved = set(state.get("candidates", []))  # type: ignore[arg-type]
        self.candidates = [n for n in self.flat.layout_order if n in saved]
        self._agreed_once = bool(state.get("agreed", False))
