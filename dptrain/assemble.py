"""What a solver is built from, before its Trainer: the device, the derived run plan, and the
model with its flat buffers, initialised identically on every rank."""
from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dptrain.config import TrainConfig
from dptrain.distributed.comm import Communicator
from dptrain.errors import ConfigError, SetupError
from dptrain.flat import FlatParams
from dptrain.memory_format import cpu_nhwc_hazards, resolve_channels_last
from dptrain.models import build_model, check_input
from dptrain.optimizer import rule_for
from dptrain.precision import DTYPES, apply_precision

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSetup:
    """Values derived once from the config and the topology; logged at startup."""

    rank: int
    world_size: int
    device: str
    batch_size: int
    iter_size: int
    global_batch: int
    """Samples per iteration over all solvers: batch_size x world_size x iter_size."""
    micro_steps_per_epoch: int
    storage: str
    loss_scale: str
    channels_last: bool = False
    """``model.channels_last`` resolved (``dptrain.memory_format``)."""
    precision_mode: str = "storage"
    """``precision.mode``: 16-bit storage (O2) or autocast over fp32 weights (O1)."""
    reduce_dtype: str = "fp32"
    """The gradients' dtype on the wire (``reducer.dtype`` resolved)."""

    def _precision(self) -> str:
        if self.precision_mode == "autocast":
            return f"fp32 weights under autocast {self.storage} (precision.mode = autocast)"
        return f"storage {self.storage}"

    def describe(self) -> str:
        return (
            f"global batch {self.global_batch} = batch_size {self.batch_size} x world_size "
            f"{self.world_size} x iter_size {self.iter_size}; {self.micro_steps_per_epoch // self.iter_size} "
            f"iterations per epoch; {self._precision()}, reduce in {self.reduce_dtype}, loss scale "
            f"{self.loss_scale}, device {self.device}, "
            f"memory format {'NHWC' if self.channels_last else 'NCHW'}"
        )


def pick_device(requested: str, local_rank: int) -> torch.device:
    """CUDA device ``local_rank`` when asked for or available ("auto"), else the CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SetupError("train.device = \"cuda\" but no CUDA device is visible; use \"auto\" or \"cpu\"")
    if local_rank >= torch.cuda.device_count():
        raise SetupError(f"LOCAL_RANK {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                         "start at most one process per GPU")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _freeze(model: nn.Module, patterns: list[str]) -> None:
    """``model.freeze``: no gradient for the parameters whose names match a glob (each glob must match)."""
    names = [n for n, _ in model.named_parameters()]
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ConfigError(f"model.freeze glob {pattern!r} matches no parameter (names look like {names[:4]}); "
                              f"fix the glob or remove it")
        for n in hits:
            model.get_parameter(n).requires_grad_(False)


def _check_parameter_dtypes(model: nn.Module, weights: str) -> None:
    """Refuse complex parameters (their cast to real would silently drop the imaginary part); say once
    which floating parameters were created in a dtype other than fp32, since dptrain trains them as
    fp32 masters with ``weights``-dtype copies."""
    other: dict[torch.dtype, list[str]] = {}
    for n, p in model.named_parameters():
        if p.is_complex():
            raise ConfigError(f"model parameter {n!r} is {str(p.dtype).removeprefix('torch.')}; dptrain trains real "
                              f"floating-point parameters (a cast would drop the imaginary part): hold the real and "
                              f"imaginary parts as two real parameters, or keep the tensor as a buffer")
        if p.is_floating_point() and p.dtype != torch.float32:
            other.setdefault(p.dtype, []).append(n)
    for dtype, names in other.items():
        level = logging.INFO if dtype == DTYPES[weights] else logging.WARNING
        log.log(level, "model parameters created in %s (%s%s) are trained as fp32 masters and held in %s "
                "(precision.storage, precision.mode); a forward that relies on their own dtype will fail: cast "
                "inputs to the parameter's dtype inside forward", str(dtype).removeprefix("torch."),
                ", ".join(names[:3]), ", ..." if len(names) > 3 else "", weights)


def build_model_and_params(cfg: TrainConfig, comm: Communicator, device: torch.device,
                           in_channels: int = 3) -> tuple[nn.Module, FlatParams, bool]:
    """The model in its storage dtype with flat buffers, initialised identically on every rank, and
    its resolved ``model.channels_last``.

    The model is built in fp32 on the CPU from the seed; ``model.channels_last = "auto"`` is
    resolved on it (the CPU NHWC hazards are read off its convolutions); then rank 0's fp32 weights
    and buffers are broadcast *before* the cast, so the fp32 masters start from the exact initial
    weights rather than from their fp16 rounding. Frozen parameters keep their fp32 values beside
    the flat buffers (``FlatParams.frozen``), so snapshots, ``export`` and ``--weights`` carry them
    exactly.
    """
    torch.manual_seed(cfg.train.seed)
    m = cfg.model
    model = build_model(m.name, num_classes=m.num_classes, width=m.width, in_channels=in_channels, args=m.args)
    _check_parameter_dtypes(model, cfg.precision.weights)
    hazards = cpu_nhwc_hazards(model) if device.type == "cpu" else None
    channels_last = resolve_channels_last(m.channels_last, cfg.precision.storage, device, hazards)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = model.to(device)
    _freeze(model, m.freeze)
    comm.broadcast_module(model)
    fp32_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_precision(model, cfg.precision)
    flat = FlatParams(model, state_names=rule_for(cfg.solver).state_names,
                      state_dtype=DTYPES[cfg.precision.momentum_dtype])
    flat.load_master_state(fp32_weights)
    return model, flat, channels_last


NORM_STATISTICS = ("running_mean", "running_var")
"""Buffer names of a normalisation's running statistics (BatchNorm's, and any custom norm that keeps
torch's names): averaged over the ranks every iteration. Every other buffer comes from rank 0 at
the start and then stays each rank's own."""


def running_stats(model: nn.Module) -> Callable[[], list[torch.Tensor]]:
    """The model's floating normalisation running statistics, read afresh at each call: a model that
    reassigns a buffer (``self.running_mean = ...``) instead of updating it in place is averaged
    in its new tensor."""
    names = [n for n, b in model.named_buffers()
             if n.rsplit(".", 1)[-1] in NORM_STATISTICS and b.is_floating_point()]

    def current() -> list[torch.Tensor]:
        return [model.get_buffer(n) for n in names]

    return current


def input_error(cfg: TrainConfig, sample_shape: tuple[int, int, int], error: Exception) -> ConfigError | None:
    """The ConfigError for a first forward that failed because the model cannot take the data's
    samples (a forward on the meta device finds out, ~2 s of imports on first use); None when the
    failure is something else (or the model cannot be built on the meta device to tell)."""
    m = cfg.model
    why = check_input(m.name, num_classes=m.num_classes, width=m.width, sample_shape=sample_shape, args=m.args)
    if why is None:
        return None
    h, w, c = sample_shape
    return ConfigError(f"model.name {m.name!r} cannot take the data's {h}x{w} samples with {c} channel(s) ({why}); "
                       f"set data.crop_size / data.resize (or data.image_size) to a size it takes")
