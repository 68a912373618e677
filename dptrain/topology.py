"""Where this process sits: rank, local rank, world size and the cores it may use.

Read once from the launcher's environment (torchrun sets ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``; a plain ``dptrain train`` has none of them and
is rank 0 of 1) into one :class:`Topology` that the rest of dptrain is handed. No other
module reads these variables.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from dptrain.errors import SetupError

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity mask (a SLURM or taskset limit), else all."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Topology:
    """This process's place among the solvers."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    """Solver processes on this node (they share its cores)."""
    under_launcher: bool = False
    """Started by torchrun (``TORCHELASTIC_RUN_ID`` is set)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Topology:
        """The topology torchrun describes, or a single process when it describes none."""
        env = os.environ if environ is None else environ
        values = {}
        for var in LAUNCHER_VARS:
            raw = env.get(var)
            try:
                values[var] = None if raw is None else int(raw)
            except ValueError as e:
                raise SetupError(f"environment variable {var}={raw!r} is not an integer; start the solvers "
                                 f"with torchrun, which sets it") from e
        world = values["WORLD_SIZE"] or 1
        rank = values["RANK"] or 0
        local_rank = values["LOCAL_RANK"] if values["LOCAL_RANK"] is not None else 0
        local_world = values["LOCAL_WORLD_SIZE"] or 1
        if world > 1 and values["RANK"] is None:
            raise SetupError(f"WORLD_SIZE={world} but RANK is not set; start the solvers with torchrun")
        if not 0 <= rank < world:
            raise SetupError(f"RANK={rank} does not fit WORLD_SIZE={world}; start the solvers with torchrun")
        return cls(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
                   under_launcher="TORCHELASTIC_RUN_ID" in env)

    @property
    def cores_per_process(self) -> int:
        """This process's share of the node's usable cores (at least 1): the default torch
        thread count on CPU and the input pipeline's thread budget."""
        return max(1, usable_cores() // self.local_world_size)
