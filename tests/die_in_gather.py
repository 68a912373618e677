"""A solver entry for the gather-death test: ``python -m die_in_gather train ...`` runs ``dptrain``, but the
rank named by ``DIE_RANK`` exits at once when iteration ``DIE_ITERATION``'s weights are to be gathered."""
from __future__ import annotations

import os

from dptrain.cli import run
from dptrain.distributed.shards import Shards

_real = Shards.gather_weights


def _gather_or_die(self: Shards) -> None:
    if self.rank == int(os.environ["DIE_RANK"]) and self.comm.flight.iteration == int(os.environ["DIE_ITERATION"]):
        os._exit(9)  # as a SIGKILL would: no line, no cleanup
    _real(self)


Shards.gather_weights = _gather_or_die

if __name__ == "__main__":
    run()
