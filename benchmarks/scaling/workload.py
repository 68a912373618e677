"""The workload: a model's per-machine figures (one-GPU rate, batch, gradient bytes, jitter, input path)
from its data file, and the reference profile derived from them and the model's layer list (ResNet-50
or ViT-L/16; not measured)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from benchmarks.scaling.machine import GB, INPUTS, MACHINES, PROFILES, InputPath, input_rates
from benchmarks.scaling.profile import BatchCost, BucketTiming, Profile
from benchmarks.scaling.simulation import Terms


@dataclass(frozen=True)
class Workload:
    """A workload profile (benchmarks/scaling/profiles/workloads/*.toml): the model and, per machine, its
    one-GPU rate, batch, gradient bytes and input path (a name in inputs.toml), with the per-step terms."""

    model: str
    update_bytes_per_param: int
    """Bytes the update moves per parameter; the update is memory-bound, so it takes this x parameters / HBM bandwidth."""
    stats_bytes: int
    jitter_cv: float
    host_ms_per_step: float
    machines: dict[str, dict[str, Any]]

    def batch_cost(self, key: str) -> BatchCost | None:
        """step(b) on machine ``key``'s GPU: its ``step_fixed_ms`` (fitted by scaling_validate.py on
        published strong-scaling rows) + b x per_image, through the one-GPU rate at its batch; None
        when the file states no fixed cost (compute linear in the batch)."""
        w = self.machines.get(key, {})
        if "step_fixed_ms" not in w:
            return None
        fixed, batch = float(w["step_fixed_ms"]), int(w["batch_size"])
        step = batch / float(w["images_per_s"]) * 1e3
        return BatchCost(fixed, (step - fixed) / batch, source=str(w.get("step_fixed_source", "workload file")))

    def input_path(self, key: str) -> InputPath | None:
        """The machine's input path (its ``input`` name in inputs.toml), None when it names none."""
        name = self.machines.get(key, {}).get("input")
        if name is not None and name not in INPUTS:
            raise ValueError(f"workload machine {key}: input = {name!r} is not in {PROFILES / 'inputs.toml'} "
                             f"({sorted(INPUTS)})")
        return INPUTS.get(name) if name else None

    def terms(self, key: str, nodes: int, stats_exposed: bool = False, synthetic: bool = False,
              path: InputPath | None = None) -> Terms:
        """The per-step terms on ``nodes`` nodes of machine ``key``; the input ceilings from ``path``
        (default: the machine's input path), none when ``synthetic``."""
        m = MACHINES[key]
        node, process = (0.0, 0.0) if synthetic else input_rates(path or self.input_path(key), m.cpu_cores)
        return Terms(contention=m.contention, jitter_cv=self.jitter_cv, stats_bytes=self.stats_bytes,
                     stats_exposed=stats_exposed, host_ms_per_step=self.host_ms_per_step,
                     input_images_per_s_per_node=node, input_images_per_s_per_process=process,
                     world_size=nodes * m.gpus_per_node, gpus_per_node=m.gpus_per_node)


def load_workload(path: Path = PROFILES / "workloads" / "resnet50.toml") -> Workload:
    """A workload profile; every machine's ``input`` names a path in inputs.toml (checked here)."""
    d = tomllib.loads(Path(path).read_text())
    try:
        wl = Workload(str(d["model"]), int(d["update_bytes_per_param"]), int(d["stats_bytes"]),
                      float(d["jitter_cv"]), float(d["host_ms_per_step"]), dict(d["machines"]))
    except KeyError as e:
        raise ValueError(f"{path}: workload profile lacks {e}; start from workloads/resnet50.toml") from e
    for key, w in wl.machines.items():
        if "input_images_per_s_per_node" in w:
            raise ValueError(f"{path}: [machines.{key}] input_images_per_s_per_node is no longer read (an input "
                             f"ceiling is never a number fitted per machine): name an input path instead, "
                             f"input = \"<a [paths.NAME] of {PROFILES / 'inputs.toml'}>\"")
        wl.input_path(key)  # raises on a name inputs.toml lacks
    return wl


def resnet50_params() -> list[tuple[str, int, int]]:
    """(name, numel, forward MACs of its layer or 0) of torchvision ResNet-50 v1.5 at 224x224, registration order."""
    out: list[tuple[str, int, int]] = []

    def conv(name: str, cin: int, cout: int, k: int, side: int) -> None:
        out.append((f"{name}.weight", cin * cout * k * k, cin * cout * k * k * side * side))

    def bn(name: str, c: int) -> None:
        out.extend([(f"{name}.weight", c, 0), (f"{name}.bias", c, 0)])

    conv("conv1", 3, 64, 7, 112)
    bn("bn1", 64)
    cin = 64
    for li, (width, blocks, side) in enumerate([(64, 3, 56), (128, 4, 28), (256, 6, 14), (512, 3, 7)], 1):
        for bi in range(blocks):
            name, side_in = f"layer{li}.{bi}", side * 2 if (bi == 0 and li > 1) else side
            conv(f"{name}.conv1", cin, width, 1, side_in)  # v1.5: the stride sits on conv2
            bn(f"{name}.bn1", width)
            conv(f"{name}.conv2", width, width, 3, side)
            bn(f"{name}.bn2", width)
            conv(f"{name}.conv3", width, 4 * width, 1, side)
            bn(f"{name}.bn3", 4 * width)
            if bi == 0:
                conv(f"{name}.downsample.0", cin, 4 * width, 1, side)
                bn(f"{name}.downsample.1", 4 * width)
            cin = 4 * width
    out.extend([("fc.weight", 2048 * 1000, 2048 * 1000), ("fc.bias", 1000, 0)])
    return out


def vit_l16_params(image: int = 224, patch: int = 16, dim: int = 1024, depth: int = 24, mlp: int = 4096,
                   classes: int = 1000) -> list[tuple[str, int, int]]:
    """(name, numel, forward MACs of its layer or 0) of timm's ViT-L/16 (vit_large_patch16_224) at
    ``image`` px, registration order: 304,326,632 parameters, 61.6 GMACs (timm's model card counts).

    The attention's two matrix products (QK^T and AV, 2 tokens^2 dim MACs, no parameters) are counted
    with the qkv projection, whose gradient backward reaches after them; LayerNorms, biases and the
    embeddings are counted as free, so they are ready with the next layer backward reaches."""
    tokens = (image // patch) ** 2 + 1  # the patches and the class token
    out = [("cls_token", dim, 0), ("pos_embed", tokens * dim, 0),
           ("patch_embed.proj.weight", 3 * patch * patch * dim, 3 * patch * patch * dim * (tokens - 1)),
           ("patch_embed.proj.bias", dim, 0)]
    for i in range(depth):
        b = f"blocks.{i}"
        out += [(f"{b}.norm1.weight", dim, 0), (f"{b}.norm1.bias", dim, 0),
                (f"{b}.attn.qkv.weight", 3 * dim * dim, 3 * dim * dim * tokens + 2 * tokens * tokens * dim),
                (f"{b}.attn.qkv.bias", 3 * dim, 0),
                (f"{b}.attn.proj.weight", dim * dim, dim * dim * tokens), (f"{b}.attn.proj.bias", dim, 0),
                (f"{b}.norm2.weight", dim, 0), (f"{b}.norm2.bias", dim, 0),
                (f"{b}.mlp.fc1.weight", dim * mlp, dim * mlp * tokens), (f"{b}.mlp.fc1.bias", mlp, 0),
                (f"{b}.mlp.fc2.weight", mlp * dim, mlp * dim * tokens), (f"{b}.mlp.fc2.bias", dim, 0)]
    out += [("norm.weight", dim, 0), ("norm.bias", dim, 0), ("head.weight", dim * classes, dim * classes),
            ("head.bias", classes, 0)]
    return out


MODELS: dict[str, tuple[str, Callable[[], list[tuple[str, int, int]]]]] = {
    "resnet50": ("ResNet-50 v1.5", resnet50_params),
    "vit_l16": ("ViT-L/16", vit_l16_params),
}
"""A workload file's ``model`` -> (its name in reports, its layer list for :func:`reference_profile`)."""


def reference_profile(machine: str, batch_size: int | None = None, *, images_per_s: float | None = None,
                      grad_bytes: int | None = None, workload: Workload | None = None) -> Profile:
    """A per-parameter profile of the workload's model for ``machine`` from the workload file, derived,
    not measured (default: the ResNet-50 workload).

    The one-GPU rate, batch and gradient bytes come from the workload's entry for the machine
    unless given (the validation passes a published row's).

    Step time = batch / images_per_s; update = params x the workload's update bytes per parameter /
    HBM bandwidth; the rest splits forward:backward = 1:2 (backward computes data and weight
    gradients). Backward visits layers in reverse; a parameter is ready when its layer's backward is
    done, time proportional to cumulative MACs (BatchNorm and LayerNorm counted as free, so their
    parameters are ready with the next layer backward reaches).
    """
    wl = workload or load_workload()
    if wl.model not in MODELS:
        raise ValueError(f"workload model {wl.model!r} has no layer list; choose from {sorted(MODELS)} or pass "
                         "a measured profile (--profile)")
    if machine not in wl.machines and images_per_s is None:
        raise ValueError(f"workload {wl.model!r} has no [machines.{machine}] entry (it has {sorted(wl.machines)}): "
                         "add the machine's one-GPU rate, batch and gradient bytes to its file")
    w = wl.machines.get(machine, {})
    rate = images_per_s or float(w["images_per_s"])
    batch_size = batch_size or int(w["batch_size"])
    grad_bytes = grad_bytes or int(w["grad_bytes_per_param"])
    why = w.get("rate_source", f"{rate:g} img/s on one GPU") if images_per_s is None else f"{rate:g} img/s on one GPU"
    name, layers = MODELS[wl.model]
    params = layers()
    n_params = sum(n for _, n, _ in params)
    update_ms = n_params * wl.update_bytes_per_param / (MACHINES[machine].hbm_gbs * GB) * 1e3
    fwd_ms = (batch_size / rate * 1e3 - update_ms) / 3
    total_macs, cum, buckets = sum(m for _, _, m in params), 0, []
    for _, numel, macs in reversed(params):
        cum += macs
        buckets.append(BucketTiming(numel * grad_bytes, 2 * fwd_ms * cum / total_macs))
    return Profile(forward_ms=fwd_ms, backward_ms=2 * fwd_ms, update_ms=update_ms, buckets=tuple(buckets),
                   batch_size=batch_size, granularity="parameter",
                   source=f"reference {name}, {grad_bytes} B gradients, {n_params:,} parameters, batch "
                          f"{batch_size}: {why}; update at {MACHINES[machine].hbm_gbs:g} GB/s HBM")
