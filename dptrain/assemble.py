"""What a solver is built from, before its Trainer: the device, the derived run plan, and the
model with its flat buffers, initialised identically on every rank."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dptrain.config import TrainConfig
from dptrain.distributed.comm import Communicator
from dptrain.errors import ConfigError, SetupError
from dptrain.flat import FlatParams
from dptrain.memory_format import cpu_nhwc_hazards
from dptrain.models import build_model, check_input
from dptrain.optimizer import rule_for
from dptrain.precision import DTYPES, apply_precision


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

    def describe(self) -> str:
        return (
            f"global batch {self.global_batch} = batch_size {self.batch_size} x world_size "
            f"{self.world_size} x iter_size {self.iter_size}; {self.micro_steps_per_epoch // self.iter_size} "
            f"iterations per epoch; storage {self.storage}, loss scale {self.loss_scale}, device {self.device}, "
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


def nhwc_hazards(cfg: TrainConfig, in_channels: int) -> list[str]:
    """The model's convolutions torch's CPU NHWC backward breaks on (``memory_format.cpu_nhwc_hazards``),
    from a copy built on the meta device (shapes only)."""
    with torch.device("meta"):
        probe = build_model(cfg.model.name, num_classes=cfg.model.num_classes, width=cfg.model.width,
                            in_channels=in_channels)
    return cpu_nhwc_hazards(probe)


def build_model_and_params(cfg: TrainConfig, comm: Communicator, device: torch.device,
                           in_channels: int = 3, channels_last: bool = False) -> tuple[nn.Module, FlatParams]:
    """The model in its storage dtype with flat buffers, initialised identically on every rank.

    Rank 0's fp32 weights are broadcast *before* the cast, so the fp32 masters start from
    the exact initial weights rather than from their fp16 rounding.
    """
    torch.manual_seed(cfg.train.seed)
    m = cfg.model
    model = build_model(m.name, num_classes=m.num_classes, width=m.width, in_channels=in_channels,
                        channels_last=channels_last).to(device)
    comm.broadcast_module(model)
    fp32_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_precision(model, cfg.precision)
    flat = FlatParams(model, state_names=rule_for(cfg.solver).state_names,
                      state_dtype=DTYPES[cfg.precision.momentum_dtype])
    flat.load_master_state(fp32_weights)
    return model, flat


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    """The model's normalisation running statistics (``running_mean`` / ``running_var`` buffers)."""
    return [b for name, b in model.named_buffers()
            if name.rsplit(".", 1)[-1] in ("running_mean", "running_var") and b.is_floating_point()]


def input_error(cfg: TrainConfig, sample_shape: tuple[int, int, int], error: RuntimeError) -> ConfigError | None:
    """The ConfigError for a first forward that failed because the model cannot take the data's
    samples (a forward on the meta device finds out, ~2 s of imports on first use); None when the
    failure is something else."""
    m = cfg.model
    why = check_input(m.name, num_classes=m.num_classes, width=m.width, sample_shape=sample_shape)
    if why is None:
        return None
    h, w, c = sample_shape
    return ConfigError(f"model.name {m.name!r} cannot take the data's {h}x{w} samples with {c} channel(s) ({why}); "
                       f"set data.crop_size / data.resize (or data.image_size) to a size it takes")
