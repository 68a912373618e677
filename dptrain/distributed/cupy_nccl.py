"""cupy-nccl communicator (``reducer.backend = "cupy-nccl"``): NCCL through CuPy, on a
dedicated high-priority stream, ordered against torch's streams with CUDA events.

GPU-only and deliberately thin: it provides the one collective the Reducer launches
(in-place SUM allreduce of a bucket); everything else (object gathers, test scores,
the unique-id exchange) goes through the torch process group in ``comm.py``.

Stream protocol, per bucket:
  1. record event ``ready`` on the caller's current stream (where backward wrote the
     bucket's gradients) and make the comm stream wait on it;
     race prevented: NCCL reading a bucket before its last gradient was written;
  2. ncclAllReduce on the comm stream, then record event ``done`` there;
  3. ``wait()`` makes the caller's current stream wait on ``done``;
     race prevented: the solver reading the bucket before the sum has landed.
Nothing blocks the host. A temporary input (fp32 upcast) gets ``record_stream`` so the
caching allocator cannot hand its memory to another tensor while NCCL still reads it.

Failure: NCCL via CuPy has no watchdog, so this module keeps one: a collective that has
not completed ``timeout_s`` after launch aborts the NCCL communicator (which unblocks the
device) and the next ``wait()`` or launch raises ``RankFailure`` naming the rank.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from types import ModuleType

import torch

from dptrain.distributed.comm import Communicator, CompletionWatcher
from dptrain.errors import RankFailure, SetupError, first_line

log = logging.getLogger(__name__)

HIGH_PRIORITY = -1
"""torch.cuda.Stream priority for the comm stream: lower is higher; -1 is valid on every
torch 2.x (values beyond the device's range are clamped), as NVCaffe's highest-priority stream."""


INSTALL_HINT = ("pip install 'dptrain[cuda13]' with a CUDA 13 torch (cupy-cuda13x, nvidia-nccl-cu13) or "
                "'dptrain[cuda12]' with a CUDA 12 one; mixing them lets the other NCCL replace the one torch loads")
SELF_CHECK_TIMEOUT_S = 60.0
"""The first collective also sets NCCL's connections up: it may take seconds, whatever
reducer.timeout_s a test sets for the buckets."""
SELF_CHECK_ELEMS = 1031
"""Elements of the known-value allreduce at communicator creation (odd: no size a kernel special-cases)."""

NCCL_BF16_VERSION = 21000
"""ncclGetVersion() code of NCCL 2.10.0, the first release with ncclBfloat16."""


@functools.cache
def _nccl() -> ModuleType:
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise SetupError(f"reducer.backend = \"cupy-nccl\" needs CuPy with NCCL ({e}); {INSTALL_HINT}, or use "
                         "reducer.backend = \"torch\"") from e
    # cupy.cuda.nccl imports even when CuPy cannot load libnccl: it then only sets available = False
    # and has no NcclCommunicator, so check here rather than fail later with an AttributeError.
    if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
        raise SetupError("reducer.backend = \"cupy-nccl\": CuPy is installed but cannot load the NCCL library "
                         f"(cupy.cuda.nccl.available is False); {INSTALL_HINT}, or use reducer.backend = \"torch\"")
    return nccl


@functools.cache
def _dtype_table() -> dict[torch.dtype, int]:
    nccl = _nccl()
    table = {torch.float16: nccl.NCCL_FLOAT16, torch.float32: nccl.NCCL_FLOAT32}
    # bf16 needs both a CuPy that defines the constant and a runtime NCCL >= 2.10 to accept it
    if hasattr(nccl, "NCCL_BFLOAT16") and nccl.get_version() >= NCCL_BF16_VERSION:
        table[torch.bfloat16] = nccl.NCCL_BFLOAT16
    return table


def _nccl_dtype(dtype: torch.dtype) -> int:
    table = _dtype_table()
    if dtype not in table:
        raise SetupError(f"cupy-nccl cannot reduce {dtype} (this CuPy supports {sorted(map(str, table))}); "
                         "use reducer.backend = \"torch\" or reducer.dtype = \"fp32\"")
    return table[dtype]


def check_reducible(dtypes: set[torch.dtype]) -> None:
    """Raise now, at startup on every rank alike, if cupy-nccl cannot reduce one of ``dtypes``
    (rather than at the first bucket, inside backward, where it would look like a dead peer)."""
    for dtype in dtypes:
        _nccl_dtype(dtype)


def known_sum_mismatch(result: torch.Tensor, world_size: int) -> str | None:
    """Why ``result`` is not the sum of rank r contributing r + 1 everywhere, or None if it is."""
    want = world_size * (world_size + 1) / 2
    wrong = (result != want).nonzero().flatten()
    if wrong.numel() == 0:
        return None
    i = int(wrong[0])
    return f"{wrong.numel()} of {result.numel()} elements differ from {want:g}, e.g. element {i} = {float(result[i])}"


class CupyWork:
    """One allreduce in flight on the comm stream."""

    def __init__(self, owner: CupyNcclCommunicator, done: torch.cuda.Event, seq: int) -> None:
        self._owner, self.done, self._seq = owner, done, seq

    def wait(self) -> None:
        """Make the current stream wait for the allreduce; raises if the communicator failed."""
        self._owner.raise_if_failed()
        torch.cuda.current_stream(self._owner.device).wait_event(self.done)
        self._owner.flight.finish(self._seq)  # host-side mark: the stream now waits for it

    def on_complete(self, fn: Callable[[float], None]) -> None:
        self._owner.watcher.watch(self.done.query, fn)


class CupyNcclCommunicator:
    """An NCCL communicator over the ranks of ``comm``, created through CuPy."""

    def __init__(self, comm: Communicator, timeout_s: float) -> None:
        if comm.device.type != "cuda":
            raise RuntimeError(f"rank {comm.rank}: cupy-nccl needs a CUDA device, got {comm.device}")
        nccl = _nccl()
        self.rank, self.world_size, self.device, self.timeout_s = comm.rank, comm.world_size, comm.device, timeout_s
        self.flight = comm.flight
        # The id goes to NcclCommunicator as get_unique_id() made it: a tuple of ints in CuPy 13,
        # bytes in CuPy 14 (which rejects a tuple). Every rank runs the same CuPy, so rank 0's type fits.
        uid = comm.broadcast_object(nccl.get_unique_id() if comm.rank == 0 else None, src=0)
        with torch.cuda.device(self.device):  # NCCL binds the communicator to the current device
            self._nccl = nccl.NcclCommunicator(self.world_size, uid, self.rank)
        self.stream = torch.cuda.Stream(self.device, priority=HIGH_PRIORITY)
        self.watcher = CompletionWatcher(f"dptrain-cupy-nccl-{self.rank}", self.device)
        self._error: str | None = None
        self._self_check()
        log.info("rank %d: cupy-nccl communicator (NCCL %s) on stream priority %d", self.rank,
                 nccl.get_version(), self.stream.priority)

    def _self_check(self) -> None:
        """One allreduce of known values before the first bucket: rank r contributes r + 1, so
        every element must be W(W+1)/2. A wrong sum or a failure stops the run here, at
        startup, instead of training on garbage gradients. A host sync, once."""
        values = torch.full((SELF_CHECK_ELEMS,), float(self.rank + 1), device=self.device)  # [n] fp32
        try:
            self.allreduce_async(values, timeout_s=max(self.timeout_s, SELF_CHECK_TIMEOUT_S)).wait()
            torch.cuda.current_stream(self.device).synchronize()
        except Exception as e:  # noqa: BLE001 - any failure of the first collective means the backend is unusable
            raise SetupError(f"rank {self.rank}: the cupy-nccl self-check allreduce failed ({type(e).__name__}: "
                             f"{first_line(e)}); use reducer.backend = \"torch\"") from e
        why = known_sum_mismatch(values.cpu(), self.world_size)
        if why is not None:
            raise SetupError(f"rank {self.rank}: the cupy-nccl self-check allreduce is wrong ({why}); use "
                             f"reducer.backend = \"torch\"")

    def allreduce_async(self, tensor: torch.Tensor, tag: int = -1, timeout_s: float | None = None) -> CupyWork:
        """In-place SUM of ``tensor`` (contiguous, on this device) over all ranks (``tag``: the
        bucket, for the flight record); the watchdog aborts it after ``timeout_s`` (default:
        the communicator's)."""
        self.raise_if_failed()
        assert tensor.is_contiguous() and tensor.device == self.device, "cupy-nccl needs a contiguous device tensor"
        seq = self.flight.enter("allreduce_async", tag=tag, nbytes=tensor.numel() * tensor.element_size())
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ready)
        ptr = tensor.data_ptr()
        self._nccl.allReduce(ptr, ptr, tensor.numel(), _nccl_dtype(tensor.dtype), _nccl().NCCL_SUM,
                             self.stream.cuda_stream)
        tensor.record_stream(self.stream)  # a no-op in effect for the long-lived flat buffers
        done = torch.cuda.Event()
        done.record(self.stream)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        self.watcher.watch(done.query, lambda _t: None, deadline_s=deadline,
                           on_timeout=self._abort)
        return CupyWork(self, done, seq)

    def _abort(self) -> None:
        """Watchdog: a collective exceeded the timeout (a peer died or hung)."""
        self._error = (f"rank {self.rank}: cupy-nccl allreduce did not complete within reducer.timeout_s = "
                       f"{self.timeout_s} s; a peer rank probably died or hung, see its log")
        log.error("%s; aborting the NCCL communicator", self._error)
        self._nccl.abort()  # CuPy makes a second abort (another bucket timing out) a no-op

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise RankFailure(self._error)

    def close(self) -> None:
        self.watcher.close()
        if self._error is None:
            self._nccl.destroy()
