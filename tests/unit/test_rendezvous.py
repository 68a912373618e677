"""The rendezvous endpoint looked at before anyone waits on it: a taken store port is a one-line error."""
from __future__ import annotations

import socket

import pytest

from dptrain.distributed.comm import join_store
from dptrain.errors import SetupError
from dptrain.topology import Topology


@pytest.fixture()
def silent_listener():
    """A listener on a free loopback port that completes connections (the kernel's backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s.getsockname()[1]
    s.close()


def test_a_taken_port_where_rank_0_creates_the_store_is_one_line(silent_listener, monkeypatch):
    """Solvers started without a launcher's agent store: rank 0 creates it on MASTER_PORT."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(silent_listener), "RANK": "0", "WORLD_SIZE": "2",
                 "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SetupError, match=rf"^rendezvous port {silent_listener} is in use on this host \(another program "
                                         rf"listens on it\); choose another port with --master-port or MASTER_PORT$"):
        join_store(Topology.from_env(), 5)


@pytest.mark.parametrize("argv, want", [
    (["--standalone", "--nproc-per-node=2"], None),
    (["--nproc-per-node=2"], None),  # one node without a port: torchrun takes a free one
    (["--master-port=29555"], ("127.0.0.1", 29555, True)),
    (["--nnodes=2", "--node-rank=1", "--master-addr=node0"], ("node0", 29500, False)),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=node0"], ("node0", 29400, False)),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0"], None),
    (["--rdzv-backend=etcd", "--rdzv-endpoint=node0:2379"], None),
])
def test_the_launcher_finds_the_store_torchrun_will_use(argv, want):
    from torch.distributed.run import parse_args

    from dptrain.launcher import _rendezvous_store

    store = _rendezvous_store(parse_args([*argv, "-m", "dptrain"]))
    assert (store and (store.host, store.port, store.hosted_here)) == want
