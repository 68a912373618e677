"""Communicator: the process group from the torchrun environment, and its collectives.

The only module that calls torch.distributed collectives. Backend: NCCL on CUDA, gloo on
CPU. With WORLD_SIZE unset or 1 there is no process group and every collective is the
identity, so ``dptrain train`` runs the same code path in one process.

Failure semantics: the process group is created with ``timeout = train.process_group_timeout_s``
(the blocking collectives of startup, displays, tests and snapshots), and the reducer's async
collectives are waited for at most ``reducer.timeout_s``.
On gloo a collective that does not complete within it raises, and a peer that dies
closes its sockets so the others raise within seconds. On NCCL the process group's
watchdog aborts a collective that exceeds the timeout and tears the process down
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default), so no rank hangs forever.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from dptrain.distributed.flight import FlightRecorder, progress_store
from dptrain.distributed.rendezvous import port_in_use, port_in_use_error
from dptrain.errors import ConfigError, PeerStartupError, RankFailure, SetupError, StartupStopped, first_line
from dptrain.inductor import point_caches
from dptrain.observe.trace import now_us
from dptrain.topology import Topology

log = logging.getLogger(__name__)

BROADCAST_CHUNK_BYTES = 64 * 1024 * 1024
"""broadcast_module coalesces tensors into messages of at most this size: few collectives
at startup without doubling the memory of a large model."""

WATCH_POLL_S = 0.0002
"""How often the completion watcher polls device events while a trace callback waits
(200 us: finer than a typical bucket's allreduce, coarse enough to cost no measurable CPU)."""
WATCH_IDLE_POLL_S = 0.02
"""Poll interval when only timeouts are watched (cupy-nccl)."""


class Work(Protocol):
    """Handle of an async collective."""

    def wait(self) -> None:
        """Make the caller's stream (CUDA) or thread (CPU) wait for the result."""

    def on_complete(self, fn: Callable[[float], None]) -> None:
        """Call ``fn(end_us)`` once the collective has completed, from any thread."""


class AsyncAllreduce(Protocol):
    """What the Reducer needs from a communicator: a rank and an in-place async SUM."""

    rank: int
    world_size: int

    def allreduce_async(self, tensor: torch.Tensor, tag: int = -1) -> Work: ...


class _DoneWork:
    """A completed collective (single-process runs)."""

    def wait(self) -> None:
        return None

    def on_complete(self, fn: Callable[[float], None]) -> None:
        fn(now_us())


def bind_thread_to_device(device: torch.device | None) -> None:
    """Make the calling thread's CUDA calls go to ``device``.

    A new thread's current device is GPU 0; its first CUDA call (an event query, a
    synchronize) would create a context there, about 0.5 GiB per process, so with 8 solvers
    GPU 0 would carry 8 contexts and run out of memory. Every dptrain thread that touches
    CUDA calls this first. No-op for the CPU and None.
    """
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


class CompletionWatcher:
    """A daemon thread that polls ``is_done`` predicates (CUDA events), calls a callback when
    one turns true, and ``on_timeout`` when a deadline passes first.

    Used where completion is only observable by polling: NCCL collectives (for trace end
    times; NCCL futures complete at enqueue, not on the device) and cupy-nccl (timeouts).
    Polling never blocks the device or the training thread.
    """

    def __init__(self, name: str, device: torch.device | None = None) -> None:
        self._device = device
        self._items: list[tuple[Callable[[], bool], Callable[[float], None], float, Callable[[], None] | None]] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, is_done: Callable[[], bool], fn: Callable[[float], None], *,
              deadline_s: float = float("inf"), on_timeout: Callable[[], None] | None = None) -> None:
        """Watch one item; ``deadline_s`` is a ``time.monotonic()`` value."""
        with self._cv:
            self._items.append((is_done, fn, deadline_s, on_timeout))
            self._cv.notify()

    def _run(self) -> None:
        bind_thread_to_device(self._device)  # it queries CUDA events: on its solver's GPU, not on GPU 0
        while True:
            with self._cv:
                while not self._items and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                items = list(self._items)
            fast = any(on_timeout is None for *_, on_timeout in items)
            finished = set()
            for item in items:
                is_done, fn, deadline, on_timeout = item
                try:
                    if is_done():
                        fn(now_us())
                        finished.add(id(item))
                    elif on_timeout is not None and time.monotonic() > deadline:
                        finished.add(id(item))
                        on_timeout()
                except Exception:  # a failing callback must not stop the watching of the others
                    log.exception("completion watcher callback failed")
                    finished.add(id(item))
            with self._cv:
                self._items = [i for i in self._items if id(i) not in finished]
            time.sleep(WATCH_POLL_S if fast else WATCH_IDLE_POLL_S)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=1.0)


class _TorchWork:
    """A torch.distributed async work.

    gloo: ``wait()`` blocks this thread until the result is in the tensor (at most
    ``timeout_s``); completion time comes from the work's future callback.
    NCCL: ``wait()`` makes the *current CUDA stream* wait for NCCL's stream (no host
    block); completion time comes from polling ``is_completed()`` (the NCCL end event).
    """

    def __init__(self, work: Any, timeout_s: float, watcher: Callable[[], CompletionWatcher] | None,
                 flight: FlightRecorder, seq: int) -> None:
        self._work, self._timeout_s, self._watcher = work, timeout_s, watcher
        self._flight, self._seq = flight, seq
        self._at_wait: list[Callable[[float], None]] = []

    def wait(self) -> None:
        if self._watcher is None:
            self._work.wait(timeout=datetime.timedelta(seconds=self._timeout_s))
        else:
            # A timeout argument would make NCCL's wait block the host; the process group's
            # watchdog enforces the timeout instead.
            self._work.wait()
        self._flight.finish(self._seq)  # gloo: done; NCCL: the stream waits for it (host-side mark)
        for fn in self._at_wait:
            fn(now_us())
        self._at_wait = []

    def on_complete(self, fn: Callable[[float], None]) -> None:
        if self._watcher is not None:
            self._watcher().watch(self._work.is_completed, fn)
            return
        try:
            future = self._work.get_future()
        except RuntimeError:  # gloo's reduce-scatter and all-gather have none: complete when wait() returns
            self._at_wait.append(fn)
            return
        future.add_done_callback(lambda _fut: fn(now_us()))


def import_dynamo_first() -> None:
    """Import ``torch._dynamo`` before the process group exists (~1 s, once).

    Importing it while a group exists leaves references to that group behind (torch 2.13: ten
    more on ``dist.group.WORLD``), and dptrain imports it mid-build on the CPU (the meta-device
    model probe of :func:`dptrain.assemble.nhwc_hazards`; the compiled update). Then
    ``destroy_process_group`` cannot free the group, its gloo worker threads outlive :meth:`close`,
    and a worker releasing its last collective's tensors while Python finalises tries to take the
    GIL, is exited by the interpreter inside a C++ destructor, and aborts the process
    ("terminate called without an active exception", SIGABRT after a finished run; a core dump
    showed ``pthread_exit`` in ``take_gil`` under ``~AsyncAllreduceWork``), in an occasional
    two-solver ``bench`` run (docs/measurements.md#process-teardown). Imported first, it holds no
    group, and close() joins the threads (tests/distributed/test_teardown.py checks that none is
    left). Costs ~1 s at startup where nothing else would import it (CUDA runs).
    Inductor's caches are pointed at dptrain's cache folder first (``dptrain.inductor``): the
    import would otherwise fix torch's default folder in /tmp for the process.
    """
    point_caches()
    import torch._dynamo  # noqa: F401


_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
"""torch 2.13's names for the tensor collectives (its older ``*_tensor`` names warn there); the GPU
image's torch 2.11 has only the older ones."""

STARTUP_POLL_S = 0.1
"""How often a rank waiting for the others at start-up looks at the store and at its stop flag."""


def _check_rendezvous_env(topology: Topology) -> None:
    """Several solvers need torch's env:// rendezvous variables, which torchrun sets."""
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise SetupError(f"WORLD_SIZE={topology.world_size} but {missing} are not set; start the solvers "
                         f"with torchrun")


def join_store(topology: Topology, timeout_s: float) -> dist.Store | None:
    """The rendezvous store torchrun describes (MASTER_ADDR/PORT; under torchrun the agent's own),
    the one ``init_process_group`` would open; None for one solver.

    Opened before the process group so that the ranks can agree to start (:func:`agree_to_start`)
    without any of them blocking inside the group's rendezvous, where no signal is served. Without a
    launcher's agent store, rank 0 creates it on MASTER_PORT: a port another program holds is a
    :class:`SetupError`.
    """
    if topology.world_size <= 1:
        return None
    _check_rendezvous_env(topology)
    import_dynamo_first()
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store, _, _ = next(dist.rendezvous("env://", topology.rank, topology.world_size, timeout=timeout))
    except dist.DistNetworkError as e:  # rank 0 creates the store where no launcher's agent holds one
        if not port_in_use(e):
            raise
        raise port_in_use_error(int(os.environ["MASTER_PORT"])) from e
    store.set_timeout(timeout)
    return store


def agree_to_start(store: dist.Store | None, topology: Topology, refusal: str | None, *,
                   stopped: Callable[[], bool], timeout_s: float) -> None:
    """Tell every rank whether this one can start (``refusal``: its one-line error, or None) and
    wait until all can, before any rank joins the process group.

    Rank 0 decides what only it checks (the run directory's lock) and the verdict travels
    through the store, so ranks on other nodes need no shared filesystem to learn it. A rank
    that refuses raises its own error after publishing it; the others raise
    :class:`PeerStartupError` with its line, so a refused run exits 2 on every rank at once. The
    wait polls every :data:`STARTUP_POLL_S`, so a SIGTERM ends it (:class:`StartupStopped`),
    and it gives up after ``timeout_s``.
    """
    if store is None:
        return
    prefix = f"dptrain/start/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(f"{prefix}{topology.rank}", refusal or "")
    if refusal is not None:
        return
    pending = [r for r in range(topology.world_size) if r != topology.rank]
    deadline = time.monotonic() + timeout_s
    while pending:
        if stopped():
            raise StartupStopped(f"rank {topology.rank}: stopped by a signal while waiting for ranks {pending} "
                                 f"to start; nothing to snapshot yet")
        for r in [r for r in pending if store.check([f"{prefix}{r}"])]:
            line = store.get(f"{prefix}{r}").decode("utf-8", "replace")
            if line:
                raise PeerStartupError(f"rank {topology.rank}: rank {r} cannot start ({line})")
            pending.remove(r)
        if pending and time.monotonic() > deadline:
            raise RankFailure(f"rank {topology.rank}: ranks {pending} did not start within "
                              f"train.process_group_timeout_s = {timeout_s:g} s; see their logs")
        if pending:
            time.sleep(STARTUP_POLL_S)


class Communicator:
    """Rank, world size and the collectives dptrain needs, over one process group."""

    def __init__(self, topology: Topology, *, device: torch.device, backend: str | None,
                 timeout_s: float = 300.0, pg_timeout_s: float = 600.0, owns_group: bool = False) -> None:
        self.topology = topology
        self.rank, self.world_size, self.local_rank = topology.rank, topology.world_size, topology.local_rank
        self.device, self.backend, self.timeout_s, self.pg_timeout_s = device, backend, timeout_s, pg_timeout_s
        self._owns_group = owns_group
        self._watcher: CompletionWatcher | None = None
        self.flight = FlightRecorder(self.rank, self.world_size)
        """The last collectives this rank entered, for the line a hang or a dead peer ends with."""

    def attach_progress_store(self) -> None:
        """Publish this rank's collective progress to a store every rank can read (collective
        at startup when rank 0 must serve the store), so a hang names the rank behind."""
        if self.distributed:
            store, prefix = progress_store(self.rank, self.broadcast_object)
            self.flight.attach_store(store, prefix)

    @classmethod
    def from_env(cls, topology: Topology, timeout_s: float, device: torch.device,
                 pg_timeout_s: float = 600.0, store: dist.Store | None = None) -> Communicator:
        """Join the process group torchrun describes (``topology``, MASTER_ADDR/PORT), through
        ``store`` when the caller opened it already (:func:`join_store`).

        A bucket's collective that does not complete within ``timeout_s`` (any other within
        ``pg_timeout_s``) fails on every rank that waits for it, so a dead or stuck rank never
        hangs the others forever.
        """
        if topology.world_size <= 1:
            return cls(topology, device=device, backend=None, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
        _check_rendezvous_env(topology)
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=pg_timeout_s)}
        if store is not None:
            kwargs.update(store=store, rank=topology.rank, world_size=topology.world_size)
        if backend == "nccl":
            kwargs["device_id"] = device
        import_dynamo_first()
        dist.init_process_group(**kwargs)
        if (dist.get_rank(), dist.get_world_size()) != (topology.rank, topology.world_size):
            raise RuntimeError(f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, the "
                               f"environment said {topology.rank} of {topology.world_size}")
        comm = cls(topology, device=device, backend=backend, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s,
                   owns_group=True)
        if comm.rank == 0:
            log.info("process group: backend %s, world size %d, timeouts %g s (buckets) / %g s (other collectives)",
                     backend, comm.world_size, timeout_s, pg_timeout_s)
        return comm

    @classmethod
    def from_initialized(cls, device: torch.device, timeout_s: float = 300.0) -> Communicator:
        """Wrap a process group that is already initialised on one node (tests, embedding
        applications): local rank = rank. ``timeout_s`` bounds gloo waits; the group's own
        timeout was fixed at its creation. Whoever created the group should have called
        :func:`import_dynamo_first` before, or the group outlives its destruction.
        """
        world = dist.get_world_size()
        topology = Topology(rank=dist.get_rank(), local_rank=dist.get_rank(), world_size=world,
                            local_world_size=world)
        return cls(topology, device=device, backend=dist.get_backend(), timeout_s=timeout_s)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @contextmanager
    def _blocking(self, what: str, op: str, nbytes: int = 0) -> Iterator[None]:
        """Record the collective in the flight ring, and turn its backend error (gloo:
        "Connection closed by peer", a timeout) into :class:`RankFailure` naming this rank."""
        seq = self.flight.enter(op, nbytes=nbytes)
        try:
            yield
        except RankFailure:
            raise
        except RuntimeError as e:  # DistError is one too
            raise RankFailure(f"rank {self.rank}: {what} failed or timed out (train.process_group_timeout_s = "
                              f"{self.pg_timeout_s:g} s): {first_line(e)}; a peer rank probably died or hung, "
                              f"see its log") from e
        self.flight.finish(seq)

    def broadcast_module(self, module: nn.Module) -> None:
        """Copy rank 0's parameters and buffers into every rank's module, in place.

        In-place copies keep parameter identity and any flat-buffer views; tensors are
        coalesced per dtype into messages of at most ``BROADCAST_CHUNK_BYTES``.
        """
        if not self.distributed:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in [*module.parameters(), *module.buffers()]:
            by_dtype.setdefault(t.dtype, []).append(t)
        mine = {str(dt): [t.numel() for t in ts] for dt, ts in by_dtype.items()}
        for r, theirs in enumerate(self.allgather_object(mine)):
            if theirs != mine:  # unequal messages would fail or hang inside the broadcast
                raise ConfigError(
                    f"rank {self.rank}: model tensors differ from rank {r}'s "
                    f"({_count(mine)} here, {_count(theirs)} there); check that every rank builds the same model "
                    f"(model.name and model.args; a model whose shapes depend on the rank or on its environment "
                    f"cannot be trained data-parallel)"
                )
        with torch.no_grad():
            for tensors in by_dtype.values():
                chunk: list[torch.Tensor] = []
                chunk_bytes = 0
                for t in tensors:
                    nbytes = t.numel() * t.element_size()
                    if chunk and chunk_bytes + nbytes > BROADCAST_CHUNK_BYTES:
                        self._broadcast_coalesced(chunk)
                        chunk, chunk_bytes = [], 0
                    chunk.append(t)
                    chunk_bytes += nbytes
                if chunk:
                    self._broadcast_coalesced(chunk)

    def _broadcast_coalesced(self, tensors: list[torch.Tensor]) -> None:
        wire = torch.cat([t.detach().reshape(-1) for t in tensors])  # [sum numel], one dtype
        if wire.dtype == torch.bool:  # not every backend reduces/broadcasts bool; bytes do
            wire = wire.to(torch.uint8)
        with self._blocking("broadcast of the initial weights", "broadcast_module", wire.numel() * wire.element_size()):
            dist.broadcast(wire, src=0)
        offset = 0
        for t in tensors:
            t.copy_(wire[offset : offset + t.numel()].view(t.shape))  # copy_ honours t's strides
            offset += t.numel()

    def allreduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks in place and wait for it (test scores, stop flags)."""
        if self.distributed:
            with self._blocking("allreduce", "allreduce", tensor.numel() * tensor.element_size()):
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def allreduce_async(self, tensor: torch.Tensor, tag: int = -1) -> Work:
        """Start an in-place SUM allreduce and return its handle.

        Stream semantics (CUDA, NCCL): the collective runs on NCCL's internal stream, which
        first waits for the caller's current stream, so everything enqueued before this call
        (the copy of the bucket's last gradient into it) is visible to it. ``wait()`` makes the
        current stream wait for NCCL's stream; it does not block the host. NCCL keeps the
        input alive until the work completes, so a temporary (an fp32 upcast) is safe.
        """
        if not self.distributed:
            return _DoneWork()
        seq = self.flight.enter("allreduce_async", tag=tag, nbytes=tensor.numel() * tensor.element_size())
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
        return _TorchWork(work, self.timeout_s, self.watcher if tensor.is_cuda else None, self.flight, seq)

    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor, tag: int = -1) -> Work:
        """Start a SUM reduce-scatter of ``input`` into ``output`` (this rank's 1/world_size of it; may be
        the matching slice of ``input`` itself: in place) and return its handle. Streams as
        :meth:`allreduce_async`."""
        return self._tensor_collective("reduce_scatter_async", tag, input.numel() * input.element_size(),
                                       _REDUCE_SCATTER, output, input, op=dist.ReduceOp.SUM)

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor, tag: int = -1) -> Work:
        """Start an all-gather of every rank's ``input`` into ``output`` (rank r's at r/world_size of it;
        ``input`` may be that slice of ``output`` itself: in place) and return its handle."""
        return self._tensor_collective("all_gather_async", tag, output.numel() * output.element_size(),
                                       _ALL_GATHER, output, input)

    def _tensor_collective(self, name: str, tag: int, nbytes: int, collective: Callable[..., Any],
                           output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Work:
        """Start ``collective(output, input)`` async, recorded in the flight record as ``name``; one solver: the
        input copied to the output (nothing to do in place)."""
        if not self.distributed:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _DoneWork()
        seq = self.flight.enter(name, tag=tag, nbytes=nbytes)
        work = collective(output, input, async_op=True, **kwargs)
        return _TorchWork(work, self.timeout_s, self.watcher if input.is_cuda else None, self.flight, seq)

    def watcher(self) -> CompletionWatcher:
        """The completion watcher thread, started on first use."""
        if self._watcher is None:
            self._watcher = CompletionWatcher(f"dptrain-comm-watch-{self.rank}", self.device)
        return self._watcher

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._blocking("allgather", "allgather"):
            dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        with self._blocking("broadcast", "broadcast"):
            dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            with self._blocking("barrier", "barrier"):
                dist.barrier()

    def close(self, *, peer_failed: bool = False) -> None:
        """Stop the watcher and the progress publisher, and leave the process group (only if this
        communicator created it). After a peer failed, the group is left to the process's exit:
        tearing it down waits for the missing peer, up to the process-group timeout."""
        self.flight.close()
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        if self._owns_group and dist.is_initialized() and not peer_failed:
            dist.destroy_process_group()
        self._owns_group = False


def _count(sig: dict[str, list[int]]) -> str:
    return ", ".join(f"{len(v)} {k} tensors / {sum(v)} elements" for k, v in sig.items())
