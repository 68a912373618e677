"""Topology: the launcher's environment read once, with one-line errors for a broken one."""
from __future__ import annotations

import pytest

from dptrain.errors import SetupError
from dptrain.topology import Topology


def test_no_launcher_is_rank_0_of_1():
    t = Topology.from_env({})
    assert (t.rank, t.local_rank, t.world_size, t.local_world_size, t.under_launcher) == (0, 0, 1, 1, False)


def test_torchrun_environment():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}
    t = Topology.from_env(env)
    assert (t.rank, t.local_rank, t.world_size, t.local_world_size, t.under_launcher) == (5, 1, 8, 4, True)


def test_cores_are_shared_by_the_node_s_solvers(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert Topology(local_world_size=4).cores_per_process == 4
    assert Topology(local_world_size=32).cores_per_process == 1  # never 0


@pytest.mark.parametrize("env, fragment", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK is not set"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 does not fit WORLD_SIZE=2"),
])
def test_broken_environment_is_a_setup_error(env, fragment):
    with pytest.raises(SetupError, match=fragment):
        Topology.from_env(env)
