"""``model.compile``: the model's forward and backward compiled by torch.compile, in segments that keep the overlap.

**Why segments.** A compiled module's backward is one autograd node, which hands all of its
gradients back at its end. Compiled whole, the model would hand every gradient over at the
end of backward, and every bucket's allreduce would start after it: no overlap. (torch's
DDPOptimizer splits a compiled graph at DDP's bucket boundaries for this reason, but only for
a module wrapped in DDP.) dptrain compiles the model's blocks one by one, each block's
``forward`` wrapped in torch.compile (names, parameters and hooks unchanged). A segment is the
largest module whose parameters fit in one bucket (``reducer.bucket_mb``, :data:`AUTO_BUCKET_MB`
for "auto") and in a :data:`MIN_SEGMENTS`-th of the model (:func:`segment_cap`); a block past
that cap stays one segment unless it is a container (:func:`segments`: a block is never cut
into its layers). Each segment's gradients reach the flat buffers when its backward ends,
through the same post-accumulate hooks as in eager mode, so a bucket launches at most one
segment's backward later than it would eagerly, while the earlier layers' backward still runs.
The fusions that matter stay inside a segment (a ResNet block's batch norms, residual add and
ReLUs); the glue between segments (pooling, flatten) runs eagerly.

**One graph where segments do not pay** (``model.compile_graphs = "auto"``; "whole" and
"segments" force either cut). One solver, with nothing to overlap, compiles the whole model as
one graph, and so does the CPU. There, segments once ran far slower than one graph, and slower
than eager: a segment that ends at a ReLU had its boolean mask saved for backward, and
inductor's C++ kernels read and write booleans at a crawl. dptrain's CPU compile now saves no
such mask (``dptrain.inductor.cpu_compile_options``, docs/measurements.md#boolean-masks), and with
2 solvers the segments' overlap then showed no gain over one graph against the same compiled DDP
peer (docs/measurements.md#segments-or-one-graph).

**When.** The compile runs at start-up, on a batch of zeros of the training shape (the
data's batch size, sample shape, dtype and layout): forward and backward of every segment,
with the RNG forked and the batch-norm statistics and flat gradients put back afterwards, and
with the reducer not armed, so no collective runs and the run is unchanged. The log says when
it starts and how long it took. The ranks then agree (one small collective): if it failed on
any rank, every rank trains eagerly, with one warning naming the rank and the error.

**Eager where compile does not pay.** The test phase and the non-finite-layer diagnosis run
eagerly (``torch.compiler.set_stance("force_eager")``): both are rare, and a compiled
evaluation graph would cost a second compile.

**CUDA graphs, one solver** (``model.compile = "reduce-overhead"``): the compiled forward and
backward are recorded once and replayed as CUDA graphs (torch.compile's mode of that name,
cudagraph trees), which removes their kernel launches from the host's work; each micro-batch marks a
new step first (``torch.compiler.cudagraph_mark_step_begin``), since the graphs' outputs are
overwritten by the next replay. The gradients leave the graph through the same hand-over as
eagerly: each is copied into its flat buffer before the next replay. The update (one fused kernel
per group) and the loss stay outside. With several solvers the allreduces stand in the way: they
are launched from autograd hooks, by Python that counts each bucket's gradients; to join a graph
they must be issued in a fixed order on a stream the capture follows, through NCCL's graph support
(2.9 and later), with the communicator used by nothing outside the graph, and gloo cannot be
captured at all; so "reduce-overhead" with several solvers is refused at start-up. Not yet run on
a GPU.

**Caches.** ``dptrain.inductor``: a second start of the same recipe loads the compiled
code from ``<cache>/inductor`` instead of compiling it again. The CPU partition's graph pass is
part of the cache key, so artifacts compiled without it are not loaded.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.config import CompileGraphs, CompileSetting
from dptrain.distributed.comm import Communicator
from dptrain.errors import ConfigError
from dptrain.flat import FlatParams
from dptrain.inductor import cpu_compile_options, point_caches
from dptrain.inductor import prepare as prepare_inductor
from dptrain.train.outputs import split_output

log = logging.getLogger(__name__)

AUTO_BUCKET_MB = 25.0
"""The segment cap when ``reducer.bucket_mb = "auto"`` (its plan is chosen after the compile): the
default fixed cap."""
MIN_SEGMENTS = 4
"""With several solvers, a model is compiled in at least about this many segments (:func:`segment_cap`)."""
CUDA_GRAPH_WARMUPS = 3
"""Start-up passes with CUDA graphs: cudagraph trees run a compiled graph once plainly, record it on
the next call and replay it after, so a failure to record or replay falls back at start-up."""
RECOMPILE_LIMIT = 64
"""Compiled variants dynamo keeps per code object (its default, 8, is what a ResNet-50's blocks need)."""
CPU_COMPILE_AUTO = False
"""Whether ``model.compile = "auto"`` compiles on the CPU: off. A step compiled as one graph is faster
than eager, but every start then pays a compile that costs more than the short CPU runs (tests,
``make demo``, the digits recipes) save (docs/measurements.md#compile-on-the-cpu);
``model.compile = true`` turns it on."""


def resolve_compile(setting: CompileSetting, storage: str, device: torch.device) -> bool:
    """``model.compile`` as a bool: the setting, or for "auto" CUDA with fp16/bf16 storage (where
    the memory-bound batch-norm, add and ReLU traffic it fuses is a large share of the step) and
    the CPU as :data:`CPU_COMPILE_AUTO` says."""
    if setting == "reduce-overhead":
        return True
    if setting != "auto":
        return bool(setting)
    if device.type == "cuda":
        return storage in ("fp16", "bf16")
    return CPU_COMPILE_AUTO


def param_bytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
"""Modules whose forward only chains their children: splitting one costs no fusion."""


def repeats_blocks(m: nn.Module) -> bool:
    """Whether ``m`` holds a stack of blocks: a container child (:data:`CONTAINERS`) with two or more
    children of one block class, a module with its own forward and layers of its own (a ResNet
    stage's blocks, a transformer's encoder layers; not an MLP's Linear layers, nor a branch of
    Sequentials)."""
    for child in m.children():
        if isinstance(child, CONTAINERS):
            kinds = Counter(type(c) for c in child.children()
                            if not isinstance(c, CONTAINERS) and any(True for _ in c.children()))
            if any(n >= 2 for n in kinds.values()):
                return True
    return False


def segments(model: nn.Module, cap_bytes: float) -> list[tuple[str, nn.Module]]:
    """The modules compiled one by one (module docstring): the largest whose parameters fit in
    ``cap_bytes``. One that does not is split into its children if it is the root, a container
    (:data:`CONTAINERS`), or a module that holds a stack of blocks (:func:`repeats_blocks`: a
    transformer's encoder, whose own forward is only glue around its layers). A block with its own
    forward and no stack inside (a ResNet block's residual add and ReLUs, a transformer block's
    attention and MLP) stays one segment even past the cap: split into its layers, it would lose
    the fusions compile is for and run its glue eagerly. Modules without parameters between segments
    stay eager. In forward order of registration; the root's name is ""."""
    out: list[tuple[str, nn.Module]] = []

    def visit(name: str, m: nn.Module) -> None:
        size = param_bytes(m)
        children = list(m.named_children())
        if size == 0:
            return
        splittable = not name or isinstance(m, CONTAINERS) or repeats_blocks(m)
        if size <= cap_bytes or not children or not splittable:
            out.append((name, m))
            return
        for child, c in children:
            visit(f"{name}.{child}" if name else child, c)

    visit("", model)
    return out


def segment_cap(model: nn.Module, bucket_mb: float | str, world_size: int, graphs: CompileGraphs = "auto",
                device_type: str = "cuda") -> float:
    """Bytes of parameters per segment: no limit (the whole model is one graph, with the most
    fusion) for "whole", and for "auto" with one solver (no allreduce to overlap) or on the CPU
    (module docstring); else the bucket size, and at most a :data:`MIN_SEGMENTS`-th of the model, so
    that a model smaller than one bucket still hands its last layers' gradients (the first bucket)
    over before its backward ends."""
    if graphs == "whole" or (graphs == "auto" and (world_size == 1 or device_type == "cpu")):
        return math.inf
    total = param_bytes(model)
    bucket = (AUTO_BUCKET_MB if bucket_mb == "auto" else float(bucket_mb)) * 2**20
    return min(bucket, total / MIN_SEGMENTS)


def compile_for_training(model: nn.Module, setting: CompileSetting, *, graphs: CompileGraphs = "auto", storage: str,
                         bucket_mb: float | str, forward: Callable[[torch.Tensor], Any],
                         batch_shape: tuple[int, int, int, int],
                         dtype: torch.dtype, channels_last: bool, flat: FlatParams,
                         comm: Communicator) -> CompiledModel | None:
    """The model compiled and warmed up where ``model.compile`` resolves to true and the compile
    works on every rank; None where it runs eagerly. ``batch_shape``: a training batch's [B, C, H, W]."""
    if not resolve_compile(setting, storage, comm.device):
        return None
    cuda_graphs = setting == "reduce-overhead"
    if cuda_graphs and comm.world_size > 1:
        raise ConfigError(f"model.compile = \"reduce-overhead\" replays forward and backward as CUDA graphs with one "
                          f"solver only ({comm.world_size} here: the allreduce cannot join the graphs); set "
                          f"model.compile = true")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    zeros = torch.empty(batch_shape, dtype=dtype, device=comm.device, memory_format=fmt).zero_()  # as DeviceFeeder's
    cap = segment_cap(model, bucket_mb, comm.world_size, graphs, comm.device.type)
    compiled = CompiledModel(model, cap, cuda_graphs=cuda_graphs)
    return compiled if compiled.warm_up(forward, zeros, flat, comm) else None


def eager() -> contextlib.AbstractContextManager[None]:
    """Run compiled modules eagerly inside the block (the test phase, diagnoses)."""
    return torch.compiler.set_stance("force_eager")


class CompiledModel:
    """Compiles a model's segments and checks them at start-up (module docstring)."""

    def __init__(self, model: nn.Module, cap_bytes: float, cuda_graphs: bool = False) -> None:
        self.model = model
        self.parts = segments(model, cap_bytes)
        self.cuda_graphs = cuda_graphs
        """torch.compile's "reduce-overhead" mode: CUDA graphs on CUDA (module docstring)."""
        self.compile_s: float | None = None
        """Seconds the start-up compile took (None: not compiled)."""
        self._skips_before = 0
        """:func:`cudagraph_skips` when this model's compile began (:attr:`cuda_graph_skips`)."""
        self._own_forward: dict[int, Callable[..., torch.Tensor] | None] = {}

    def step_begins(self) -> None:
        """Before each micro-batch's forward: with CUDA graphs, the previous replay's outputs are
        done with (cudagraph trees would otherwise refuse to overwrite them)."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    @property
    def cuda_graph_skips(self) -> int:
        """Graphs that cudagraph trees have run without recording since this model's compile began,
        at start-up or in a step (a CPU tensor, an input mutation, an op it cannot capture, a
        re-recording past its limit): they run compiled, but not as CUDA graphs."""
        return cudagraph_skips() - self._skips_before

    @property
    def names(self) -> list[str]:
        return [n or "<model>" for n, _ in self.parts]

    def compile(self, device_type: str) -> None:
        """Wrap each segment's forward in torch.compile. (``nn.Module.compile`` would compile the
        call of a torch module such as a Sequential stem as a frame dynamo skips: its layers would
        run eagerly.) The recompile limit is raised: the segments of one class share a code
        object, and a ResNet's blocks come in up to 8 shapes. On the CPU each compile (and
        recompile) has the partition pass of ``dptrain.inductor.cpu_compile_options``."""
        prepare_inductor()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        how = {"mode": "reduce-overhead"} if self.cuda_graphs else {"options": cpu_compile_options(device_type) or None}
        for _, m in self.parts:
            self._own_forward[id(m)] = m.__dict__.get("forward")  # a forward set on the instance, kept
            m.forward = torch.compile(m.forward, dynamic=False, **how)

    def uncompile(self) -> None:
        for _, m in self.parts:
            own = self._own_forward.get(id(m))
            if own is None:
                m.__dict__.pop("forward", None)  # the class's own forward again
            else:
                m.forward = own

    def warm_up(self, forward: Callable[[torch.Tensor], Any], batch: torch.Tensor, flat: FlatParams,
                comm: Communicator) -> bool:
        """Compile, run ``forward`` and a backward once on ``batch`` (zeros of the training batch's
        shape, dtype and layout) and put everything back; agree with the other ranks. Whether the
        model runs compiled from here on. A :class:`ConfigError` (a sample shape the model cannot
        take, found by ``forward``) is raised as it is, on every rank alike."""
        t0 = time.perf_counter()
        if comm.rank == 0:
            log.info("model.compile: compiling %s's forward and backward in %d segment(s), %s%s (a minute or more "
                     "on a first start, seconds from the cache in %s)", type(self.model).__name__, len(self.parts),
                     ", ".join(self.names), ", as CUDA graphs" if self.cuda_graphs and comm.device.type == "cuda"
                     else "", point_caches())
        error = ""
        self._skips_before = cudagraph_skips()
        try:
            self.compile(comm.device.type)
            with _unchanged(self.model, flat):
                labels = torch.zeros(len(batch), dtype=torch.long, device=batch.device)
                for _ in range(CUDA_GRAPH_WARMUPS if self.cuda_graphs else 1):  # record and replay, failures here
                    self.step_begins()
                    F.cross_entropy(split_output(forward(batch))[0].float(), labels).backward()
                    flat.zero_grads()
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - any compiler failure falls back to eager, on every rank
            error = _cause(e)
        failed = comm.allgather_object(error)
        bad = [(r, e) for r, e in enumerate(failed) if e]
        if bad:
            self.uncompile()
            if comm.rank == 0:
                r, e = bad[0]
                log.warning("model.compile failed on rank %d (%s)%s; training eagerly on every rank (set "
                            "model.compile = false to skip the attempt)", r, e,
                            f", and on {len(bad) - 1} more rank(s)" if len(bad) > 1 else "")
            return False
        self.compile_s = time.perf_counter() - t0
        if comm.rank == 0:
            log.info("model.compile: compiled in %.1f s", self.compile_s)
        if self.cuda_graphs:
            # cudagraph trees skip a graph they cannot record with no error, only a counter and a
            # log line that is off by default; on the CPU every graph is skipped (there are none)
            if self.cuda_graph_skips and comm.device.type == "cuda":
                log.warning("model.compile = \"reduce-overhead\": %d compiled graph(s) run without CUDA graphs "
                            "(TORCH_LOGS=cudagraphs says why)", self.cuda_graph_skips)
        return True


def cudagraph_skips() -> int:
    """Graphs inductor's cudagraph trees have declined to record in this process so far (none
    before dynamo is imported: this does not import it)."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0
    return int(sys.modules["torch._dynamo.utils"].counters["inductor"]["cudagraph_skips"])


def _cause(e: BaseException) -> str:
    """The innermost cause of a compile failure, in one line (dynamo wraps the compiler's error)."""
    seen = {id(e)}
    while (inner := getattr(e, "inner_exception", None) or e.__cause__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        e = inner
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


@contextlib.contextmanager
def _unchanged(model: nn.Module, flat: FlatParams) -> Iterator[None]:
    """Run a throw-away forward and backward: RNG, buffers (batch-norm statistics) and the flat
    gradients are as before afterwards."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
        flat.zero_grads()
