"""The rendezvous endpoint looked at before anyone waits on it: a taken store port and a listener that
never answers are one-line errors; a real store and a free port pass."""
from __future__ import annotations

import datetime
import socket
import time

import pytest
import torch.distributed as dist

from dptrain.distributed.comm import join_store
from dptrain.distributed.rendezvous import check_store_answers
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_listener_that_never_answers_is_refused_within_the_bound(silent_listener):
    start = time.monotonic()
    with pytest.raises(SetupError, match=rf"rendezvous endpoint 127\.0\.0\.1:{silent_listener} accepts connections but "
                                         rf"does not answer as a rendezvous store within 0\.5 s: another program holds "
                                         rf"that port; stop it, or choose another port"):
        check_store_answers("127.0.0.1", silent_listener, 0.5)
    assert time.monotonic() - start < 3


def test_a_real_store_and_a_free_port_pass():
    port = _free_port()
    check_store_answers("127.0.0.1", port, 0.5)  # nothing listens: torchrun will host the store there
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=5),
                          wait_for_workers=False)
    check_store_answers("127.0.0.1", port, 5)
    del store


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
    (["--rdzv-backend=c10d", "--rdzv-endpoint=node0", "--rdzv-conf=read_timeout=9"], ("node0", 29400, False)),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0"], None),
    (["--rdzv-backend=etcd", "--rdzv-endpoint=node0:2379"], None),
])
def test_the_launcher_finds_the_store_torchrun_will_use(argv, want):
    from torch.distributed.run import parse_args

    from dptrain.distributed.rendezvous import RDZV_ANSWER_S
    from dptrain.launcher import _rendezvous_store

    store = _rendezvous_store(parse_args([*argv, "-m", "dptrain"]))
    assert (store and (store.host, store.port, store.hosted_here)) == want
    if store is not None:
        assert store.answer_s == (9 if "--rdzv-conf=read_timeout=9" in argv else RDZV_ANSWER_S)
