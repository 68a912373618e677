"""Typed configuration: one TOML file -> frozen dataclasses, one per table.

Precedence: ``--set section.key=value`` > TOML file > dataclass defaults. Every
error is a :class:`ConfigError` whose message names the dotted key and the valid
choices, so the CLI can print one line and exit 2.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

from dptrain.errors import ConfigError


def _positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key} must be {bound}, got {value!r}")


CompileSetting = bool | Literal["auto", "reduce-overhead"]
"""``model.compile``'s values (``dptrain.train.compiled``)."""
CompileGraphs = Literal["auto", "whole", "segments"]
"""``model.compile_graphs``' values: how the compiled model is cut."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = "lenet"
    """A zoo entry (``dptrain.models.MODELS``: lenet, resnet18/34/50/101, resnet18_cifar, alexnet,
    googlenet), or your own model as ``"package.module:callable"``: any importable callable that
    returns an ``nn.Module`` (a class or a factory; ``"torchvision.models:vit_b_16"``; ``"timm:NAME"``
    goes through ``timm.create_model``). Modules are imported from ``PYTHONPATH`` and the working
    directory."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the callable of an import-path ``model.name`` (a TOML table,
    ``[model.args]``; on the command line ``--set model.args.depth=12``). ``num_classes`` is passed
    from ``model.num_classes`` when the callable takes it."""
    num_classes: int = 10
    """Width of the classifier. Labels must lie in [0, num_classes)."""
    width: int = 64
    """Base channel count for the zoo's ``*_cifar`` nets (ResNet-18 uses 64). Smaller is faster."""
    freeze: list[str] = field(default_factory=list)
    """Globs over parameter names (``"backbone.*"``) whose parameters are frozen: not reduced, not
    updated, kept exactly (also every parameter the model itself builds with requires_grad=False).
    A glob that matches no parameter is an error."""
    unused_parameters: Literal["auto", "error"] = "auto"
    """Parameters that get no gradient in an iteration (a branch not taken, a head left out of the
    loss). "auto": reduced as zeros on every rank (every rank launches the same buckets), named in
    one warning, and left as torch's optimizers leave a parameter without a gradient when no rank
    gave it one (no decay, no momentum step). "error": the first one ends the run with one line."""
    aux_loss_weight: float = 0.3
    """Weight of each auxiliary classifier's cross-entropy, added to the main loss when the model
    returns more logits than one (a tuple, list or dict, as torchvision's GoogLeNet and Inception do
    in training; ``dptrain.train.outputs``). 0.3 is the GoogLeNet paper's."""
    channels_last: bool | Literal["auto"] = "auto"
    """Store activations NHWC. "auto": wherever it was measured faster (``dptrain.memory_format``: CUDA
    with fp16/bf16 storage; CPU with bf16 where the CPU runs it natively); true/false force it."""
    attention: Literal["auto", "torch", "math", "flash", "efficient", "cudnn"] = "auto"
    """The kernel of the model's ``F.scaled_dot_product_attention`` calls (``dptrain.train.attention``).
    "auto": for a model given by import path, running eagerly on the CPU, the fastest of torch's kernels
    for the calls' shapes, measured at start-up on rank 0 and kept by a resume; torch's own dispatch
    elsewhere. "torch": torch's dispatch (its fixed priority: flash, efficient, math). A kernel's name
    forces it (torch errors where it cannot take the inputs)."""
    compile: CompileSetting = "auto"
    """Compile the model's forward and backward with torch.compile, in segments that keep the
    allreduce overlapped with backward (``dptrain.train.compiled``). Fuses the memory-bound
    batch-norm, add and ReLU passes; costs a compile at start-up (a minute or more the first time,
    seconds from the cache). "auto": on CUDA with fp16/bf16 storage, off on the CPU (a step runs
    faster there, but each start pays the compile: docs/measurements.md#compile-on-the-cpu); a
    failed compile falls back to eager with one warning. "reduce-overhead": compiled as true, and
    on CUDA forward and backward replay as CUDA graphs (torch.compile's mode of that name), one
    solver only: the allreduce cannot join the graphs."""
    compile_graphs: CompileGraphs = "auto"
    """How ``model.compile`` cuts the model. "segments": one graph per bucket-sized block, so each
    bucket's allreduce starts while the earlier layers' backward runs; "whole": one graph, every
    gradient handed over at the end of backward (the most fusion, no overlap). "auto": segments
    with several CUDA solvers, whole with one solver or on the CPU (there, a segment's compiled
    batch-norm backward ran several times slower than the same operations in one graph, and the
    segments' overlap gained nothing on 2 cores: docs/measurements.md#segments-or-one-graph)."""

    def __post_init__(self) -> None:
        from dptrain.models import MODELS, is_import_path

        if is_import_path(self.name):
            module, _, attr = self.name.partition(":")
            if not all(p.isidentifier() for p in [*module.split("."), *attr.split(".")]):
                raise ConfigError(f"model.name {self.name!r} is not \"package.module:callable\" (dotted Python names "
                                  f"on both sides of the colon); or use a zoo entry {sorted(MODELS)}")
        elif self.name not in MODELS:
            raise ConfigError(f"model.name must be one of {sorted(MODELS)}, got {self.name!r}; or give your own model "
                              f"as \"package.module:callable\"")
        elif self.args:
            raise ConfigError(f"model.args applies to a model given by import path (\"package.module:callable\"); the "
                              f"zoo's {self.name!r} takes model.num_classes and model.width: remove [model.args]")
        _positive("model.num_classes", self.num_classes)
        _positive("model.width", self.width)
        _positive("model.aux_loss_weight", self.aux_loss_weight, allow_zero=True)


RECORD_SOURCES = ("lmdb", "folder", "list")
"""``data.source`` values read by the threaded record pipeline (``dptrain.data.sources.records``)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: Literal["digits", "synthetic", "lmdb", "folder", "list"] = "digits"
    """Where samples come from: the built-in digits, a fixed synthetic set, a Caffe LMDB, an image
    folder (torchvision's ImageFolder layout: one subfolder per class, labels by sorted folder name)
    or a list file of ``path label`` lines (Caffe's ImageData, DALI's file_list)."""
    batch_size: int = 64
    """Samples per solver per micro-batch. The global batch is batch_size x world_size x iter_size."""
    test_batch_size: int = 100
    """Samples per solver per test batch."""
    path: str = ""
    """Training data: the LMDB directory (source = "lmdb"), the image folder ("folder") or the list
    file ("list")."""
    test_path: str = ""
    """Test data, as ``path``; empty means no test phase."""
    root: str = ""
    """source = "list": the folder the lists' relative paths are taken from (both lists); empty: each
    list file's own folder."""
    shuffle: Literal["epoch", "none"] = "epoch"
    """"epoch": a new seeded permutation each epoch; "none": record order."""
    image_size: int = 224
    """Side of the synthetic images, and of the network input when no crop is set."""
    synthetic_samples: int = 1_281_167
    """Size of one synthetic epoch (ImageNet-1k train by default)."""
    parser_threads: int = 0
    """LMDB reader threads per solver; 0 picks a value from the core count."""
    transformer_threads: int = 0
    """Decode/augment threads per solver; 0 picks a value from the core count."""
    prefetch: int = 3
    """Batches prepared ahead of the solver. More hides jitter; costs pinned memory."""
    crop_size: int = 0
    """Caffe crop: random in training, centre in test. 0 = no crop."""
    resize: list[int] = field(default_factory=list)
    """[H, W] resize before cropping; empty = keep the stored size."""
    random_resized_crop: bool = False
    """ImageNet-style random-resized-crop to crop_size in training (resize + centre crop in test)."""
    rrc_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    """Area fraction range for random_resized_crop."""
    rrc_ratio: list[float] = field(default_factory=lambda: [3 / 4, 4 / 3])
    """Aspect ratio range for random_resized_crop."""
    mirror: bool = False
    """Random horizontal flip in training."""
    mean_value: list[float] = field(default_factory=list)
    """Per-channel mean in pixel units (0..255), in RGB order (samples are RGB; a Caffe BGR
    mean_file is converted), subtracted on the device. One value applies to every channel."""
    mean_file: str = ""
    """Caffe binaryproto (BGR) or .npy (RGB) mean, [C] or [C, H, W]; overrides mean_value. A mean
    image is subtracted pixel by pixel at each sample's crop, as Caffe does (the stored images
    must have its size); with resize or random_resized_crop its per-channel average is used."""
    scale: float = 1.0
    """Multiplier applied after mean subtraction (Caffe ``scale``), e.g. 1/255 or 0.017."""
    max_bad_records: int = 0
    """Bad records skipped (with a warning and a count) before the run fails. 0 = fail on the first."""

    def __post_init__(self) -> None:
        _positive("data.batch_size", self.batch_size)
        _positive("data.test_batch_size", self.test_batch_size)
        _positive("data.image_size", self.image_size)
        _positive("data.synthetic_samples", self.synthetic_samples)
        _positive("data.parser_threads", self.parser_threads, allow_zero=True)
        _positive("data.transformer_threads", self.transformer_threads, allow_zero=True)
        _positive("data.prefetch", self.prefetch)
        _positive("data.crop_size", self.crop_size, allow_zero=True)
        _positive("data.max_bad_records", self.max_bad_records, allow_zero=True)
        _positive("data.scale", self.scale)
        if self.source in RECORD_SOURCES and not self.path:
            what = {"lmdb": "a training LMDB", "folder": "a training image folder", "list": "a training list file"}
            raise ConfigError(f"data.path must name {what[self.source]} when data.source = \"{self.source}\"")
        if self.root and self.source != "list":
            raise ConfigError(f"data.root applies to data.source = \"list\" (got \"{self.source}\"); remove it")
        if self.resize and (len(self.resize) != 2 or min(self.resize) <= 0):
            raise ConfigError(f"data.resize must be [H, W] with positive sides, got {self.resize}")
        if self.random_resized_crop and self.crop_size <= 0:
            raise ConfigError("data.random_resized_crop needs data.crop_size > 0")
        if len(self.rrc_scale) != 2 or not 0 < self.rrc_scale[0] <= self.rrc_scale[1] <= 1:
            raise ConfigError(f"data.rrc_scale must be [lo, hi] with 0 < lo <= hi <= 1, got {self.rrc_scale}")
        if len(self.rrc_ratio) != 2 or not 0 < self.rrc_ratio[0] <= self.rrc_ratio[1]:
            raise ConfigError(f"data.rrc_ratio must be [lo, hi] with 0 < lo <= hi, got {self.rrc_ratio}")
        if self.mean_value and len(self.mean_value) not in (1, 3):
            raise ConfigError(f"data.mean_value needs 1 or 3 values, got {len(self.mean_value)}")


LR_POLICIES = ("fixed", "step", "multistep", "poly", "exp", "inv", "sigmoid", "cosine")


@dataclass(frozen=True, kw_only=True)
class ParamGroup:
    """One ``[[solver.param_groups]]`` entry: Caffe's per-layer multipliers for the parameters it matches."""

    match: str
    """Glob over dotted parameter names ("fc8.*", "*.bias"), or over the type name of the module that
    owns the parameter, base classes included ("BatchNorm2d", "*Norm*"). The first group that
    matches a parameter wins; a group that matches no parameter is an error."""
    lr_mult: float = 1.0
    """The parameter's learning rate is solver's lr x lr_mult (Caffe lr_mult). 0 freezes it."""
    decay_mult: float = 1.0
    """The parameter's weight decay is weight_decay x decay_mult (Caffe decay_mult). 0: no decay."""


@dataclass(frozen=True, kw_only=True)
class SolverConfig:
    type: Literal["sgd", "nesterov", "adam", "adamw", "rmsprop", "lamb"] = "sgd"
    """Update rule, fused with FP32 masters: "sgd" (momentum, Caffe form), "nesterov" (Caffe's
    NesterovSolver), "adam" (L2 decay in the gradient), "adamw" (decoupled decay), "rmsprop"
    (torch's RMSprop, Caffe's with momentum 0), "lamb" (Adam direction with a per-parameter
    trust ratio |w|/|u|, for large batches). State per parameter: 4 bytes (sgd, nesterov) or 8."""
    base_lr: float = 0.01
    """Learning rate before the policy and warmup are applied."""
    momentum: float = 0.9
    """sgd/nesterov: momentum (Caffe form: h = m*h + lr*g; w -= h). rmsprop: momentum of the scaled
    step (torch's; Caffe's RMSProp has none: set 0). Unused by adam/adamw/lamb (see beta1)."""
    beta1: float = 0.9
    """adam/adamw/lamb: decay of the first moment."""
    beta2: float = 0.999
    """adam/adamw/lamb: decay of the second moment. Lower (0.98) reacts faster to gradient scale changes."""
    eps: float = 1e-8
    """adam/adamw/lamb/rmsprop: added to the root of the second moment (Caffe's delta). LAMB recipes use 1e-6."""
    rms_decay: float = 0.99
    """rmsprop: decay of the mean square (Caffe rms_decay, torch alpha)."""
    weight_decay: float = 0.0005
    """Decay coefficient. See decay_mode for where it enters, decay_mult and no_decay for which parameters."""
    decay_mode: Literal["auto", "l2", "decoupled"] = "auto"
    """"l2": Caffe, decay*w added to the gradient; "decoupled": w -= lr*decay*w beside the step (lamb:
    decay*w added to the update direction, inside the trust ratio). "auto": decoupled for adamw and
    lamb, l2 for the others."""
    param_groups: list[ParamGroup] = field(default_factory=list)
    """[[solver.param_groups]] tables of match / lr_mult / decay_mult (see ParamGroup); parameters no
    group matches keep lr_mult = decay_mult = 1."""
    no_decay: list[Literal["bias", "norm"]] = field(default_factory=list)
    """Shortcut: decay_mult 0 for "bias" (parameters named bias) and "norm" (the parameters of
    normalisation layers: BatchNorm, GroupNorm, LayerNorm, InstanceNorm), whatever group they are in."""
    lr_policy: Literal["fixed", "step", "multistep", "poly", "exp", "inv", "sigmoid", "cosine"] = "fixed"
    """Caffe learning-rate policy, or "cosine": base_lr annealed to min_lr over max_iter (half a cosine)."""
    gamma: float = 0.1
    """step/multistep/exp/inv: decay factor. sigmoid: slope per iteration, lr = base_lr/(1 + exp(-gamma*(it -
    stepsize))); negative to decay (Caffe recipes use e.g. -0.001), the only policy that takes gamma <= 0."""
    power: float = 1.0
    """poly/inv: exponent."""
    stepsize: int = 100_000
    """step: iterations between decays. sigmoid: the iteration where lr is base_lr/2."""
    stepvalue: list[int] = field(default_factory=list)
    """multistep: iterations at which lr is multiplied by gamma."""
    min_lr: float = 0.0
    """Floor of the policy's lr, in [0, base_lr]: "cosine" ends exactly there; the other policies never go
    below it (0 = Caffe's policies unchanged). The warmup multiplies the floored lr."""
    warmup_iter: int = 0
    """Linear warmup from warmup_start * lr to lr over this many iterations (Goyal et al.)."""
    warmup_start: float = 0.0
    """Fraction of the policy lr at iteration 0 of the warmup."""
    max_iter: int = 1000
    """Training iterations (each is iter_size micro-batches)."""
    iter_size: int = 1
    """Micro-batches accumulated per iteration (Caffe iter_size); the allreduce runs on the last."""
    display: int = 20
    """Log and append to metrics.jsonl every this many iterations. 0 = never."""
    test_interval: int = 0
    """Run the test phase every this many iterations, and at the end. 0 = only at the end."""
    test_iter: int = 0
    """Test batches per test phase and solver. 0 = the whole test set."""
    snapshot: int = 0
    """Write a snapshot every this many iterations, and at the end. 0 = only at the end."""
    snapshot_keep: int = 0
    """Snapshots kept in train.run_dir: each time a new one is durable (fsynced and renamed into place),
    older ones beyond the newest snapshot_keep are deleted, except the newest one before it not marked
    diverging, the last good snapshot should the losses just after the new one start a divergence (so
    1 keeps two files). Snapshots past the current iteration, left by a run resumed from an earlier
    one, are not touched. Fewer: less disk (each holds the model and its solver state); more: more
    points to go back to. 0 = keep all."""
    clip_gradients: float = 0.0
    """Clip the global L2 norm of the unscaled gradient to this value. 0 = off."""
    label_smoothing: float = 0.0
    """Training loss target: 1 - label_smoothing on the label, plus label_smoothing spread uniformly over all
    num_classes (Szegedy et al. 2016; ResNet-50 recipes use 0.1). In [0, 1); 0 = plain cross-entropy."""
    max_nonfinite: int = 3
    """Without loss scaling (fp32, bf16, or mode "none"), stop with an error after this many
    consecutive iterations whose loss is not finite; the last good snapshot is kept. (With
    loss scaling such a step is skipped and the scale lowered instead.)"""
    larc: bool = False
    """Layer-wise adaptive rate control (NVCaffe larc); sgd and nesterov only."""
    larc_policy: Literal["scale", "clip"] = "clip"
    """LARC: "scale" uses lr*rate, "clip" uses min(lr, rate)."""
    larc_eta: float = 0.001
    """LARC trust coefficient."""
    cpu_fused_update: bool = False
    """CPU solvers only: run the update as one pass compiled by torch.compile (inductor; needs a
    C++ compiler) instead of the default, update.cu's rules built for the host
    (``dptrain.kernels.native``, ~3 s to build once per machine, cached). Slower than that
    default, though faster than the in-place passes the default falls back to without a C++
    compiler (measurements: docs/measurements.md#compiled-update).
    The first step pays a compile of about ten seconds (a few seconds from inductor's on-disk
    cache in later runs). No effect on CUDA (the CuPy kernel is fused)."""

    def __post_init__(self) -> None:
        _positive("solver.base_lr", self.base_lr)
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"solver.momentum must be in [0, 1), got {self.momentum}")
        _positive("solver.weight_decay", self.weight_decay, allow_zero=True)
        if self.lr_policy != "sigmoid":
            _positive("solver.gamma", self.gamma)
        elif self.gamma == 0:
            raise ConfigError("solver.gamma must be non-zero with solver.lr_policy = \"sigmoid\" (negative: lr falls "
                              "from base_lr to 0 around solver.stepsize; positive: it rises), got 0")
        _positive("solver.power", self.power)
        _positive("solver.stepsize", self.stepsize)
        _positive("solver.max_iter", self.max_iter)
        _positive("solver.iter_size", self.iter_size)
        for key in ("warmup_iter", "display", "test_interval", "test_iter", "snapshot", "snapshot_keep"):
            _positive(f"solver.{key}", getattr(self, key), allow_zero=True)
        _positive("solver.clip_gradients", self.clip_gradients, allow_zero=True)
        _positive("solver.max_nonfinite", self.max_nonfinite)
        _positive("solver.larc_eta", self.larc_eta)
        if not 0 <= self.min_lr <= self.base_lr:
            raise ConfigError(f"solver.min_lr must be in [0, solver.base_lr = {self.base_lr}], got {self.min_lr}")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"solver.label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not 0 <= self.warmup_start <= 1:
            raise ConfigError(f"solver.warmup_start must be in [0, 1], got {self.warmup_start}")
        if self.stepvalue != sorted(self.stepvalue) or any(v <= 0 for v in self.stepvalue):
            raise ConfigError(f"solver.stepvalue must be increasing positive iterations, got {self.stepvalue}")
        if self.lr_policy == "multistep" and not self.stepvalue:
            raise ConfigError("solver.stepvalue must list iterations when solver.lr_policy = \"multistep\"")
        self._check_rule_settings()

    def _check_rule_settings(self) -> None:
        for key in ("beta1", "beta2", "rms_decay"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"solver.{key} must be in [0, 1), got {getattr(self, key)}")
        _positive("solver.eps", self.eps)
        if self.type == "adamw" and self.decay_mode == "l2":
            raise ConfigError("solver.type = \"adamw\" is Adam with decoupled decay, but solver.decay_mode = \"l2\"; "
                              "use solver.type = \"adam\" for L2 decay, or drop decay_mode")
        if self.larc and self.type not in ("sgd", "nesterov"):
            raise ConfigError(f"solver.larc applies to solver.type \"sgd\" or \"nesterov\", got {self.type!r} "
                              f"(lamb has its own trust ratio)")
        for i, g in enumerate(self.param_groups):
            if not g.match:
                raise ConfigError(f"solver.param_groups[{i}].match must not be empty")
            _positive(f"solver.param_groups[{i}].lr_mult", g.lr_mult, allow_zero=True)
            _positive(f"solver.param_groups[{i}].decay_mult", g.decay_mult, allow_zero=True)

    def resolved_decay_mode(self) -> Literal["l2", "decoupled"]:
        """decay_mode after "auto" is resolved against the solver type."""
        if self.decay_mode != "auto":
            return self.decay_mode
        return "decoupled" if self.type in ("adamw", "lamb") else "l2"


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    mode: Literal["auto", "dynamic", "static", "none"] = "auto"
    """"auto": dynamic for fp16 storage, none for bf16/fp32. "static" uses init_scale throughout."""
    init_scale: float = 65536.0
    """Starting scale (2^16 for dynamic); the fixed scale for static (NVCaffe recipes use 256-1000)."""
    growth_interval: int = 2000
    """Clean steps before the dynamic scale is multiplied by growth_factor."""
    growth_factor: float = 2.0
    """Dynamic scale multiplier after growth_interval clean steps."""
    backoff_factor: float = 0.5
    """Dynamic scale multiplier on overflow."""
    hysteresis: int = 1
    """Consecutive overflows before a backoff (DeepSpeed uses 2). Every overflowing step is skipped."""
    min_scale: float = 1.0
    """Training stops with an error when the dynamic scale would fall below this."""
    max_scale: float = 2.0**24
    """The dynamic scale never grows beyond this."""

    def __post_init__(self) -> None:
        for key in ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            _positive(f"precision.loss_scale.{key}", getattr(self, key))
        _positive("precision.loss_scale.growth_interval", self.growth_interval)
        _positive("precision.loss_scale.hysteresis", self.hysteresis)
        if self.growth_factor <= 1:
            raise ConfigError(f"precision.loss_scale.growth_factor must be > 1, got {self.growth_factor}")
        if self.backoff_factor >= 1:
            raise ConfigError(f"precision.loss_scale.backoff_factor must be < 1, got {self.backoff_factor}")
        if self.min_scale > self.max_scale:
            raise ConfigError(
                f"precision.loss_scale.min_scale ({self.min_scale}) exceeds max_scale ({self.max_scale})"
            )


FP32_NORMS = ("BatchNorm*", "SyncBatchNorm", "LayerNorm*", "GroupNorm", "InstanceNorm*", "RMSNorm")
"""``precision.fp32_modules``' default: the normalisation layers of torch (and, by their base
classes, of torchvision and timm)."""


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    mode: Literal["storage", "autocast"] = "storage"
    """How the 16-bit dtype ``storage`` is used. "storage" (Apex O2, NVCaffe's way): the model's weights,
    activations and gradients are held in it, with fp32 masters beside them and the normalisations in
    fp32. "autocast" (Apex O1, torch AMP's numerics): the weights stay fp32 and are the masters (no
    second copy), forward and loss run under ``torch.autocast`` in ``storage``'s dtype (matmuls and
    convolutions in 16 bits; softmax, norms, losses and reductions in fp32), and the gradients are fp32;
    the safer recipe for a model dptrain did not design (see the README's "O1 or O2")."""
    storage: Literal["fp32", "fp16", "bf16"] = "fp32"
    """dtype of model weights, activations and gradients (mode "storage"), or the dtype autocast computes
    in (mode "autocast": fp16 or bf16). The update always runs in fp32."""
    master: Literal["fp32"] = "fp32"
    """dtype of the master weights that take the update."""
    momentum_dtype: Literal["fp32", "fp16"] = "fp32"
    """Momentum history dtype (NVCaffe solver_data_type). fp16 uses the lr-factored form G = m*G + g; w -= lr*G."""
    fp32_modules: list[str] = field(default_factory=lambda: list(FP32_NORMS))
    """Module type names (a base class's name matches too: torchvision's and timm's LayerNorm2d are
    LayerNorms) or qualified-name globs kept in fp32, parameters and statistics (inputs cast in,
    outputs cast back; BatchNorm takes 16-bit inputs natively). By default every normalisation, as
    Apex's O2 kept only BatchNorm and lost LayerNorm and GroupNorm models to fp16."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """[precision.loss_scale] table."""

    def __post_init__(self) -> None:
        if self.autocast and self.storage == "fp32":
            raise ConfigError("precision.mode = \"autocast\" computes in precision.storage's 16-bit dtype: set "
                              "precision.storage = \"bf16\" or \"fp16\" (or precision.mode = \"storage\" for fp32)")
        ls = self.loss_scale
        if self.resolved_loss_scale_mode() == "dynamic" and not ls.min_scale <= ls.init_scale <= ls.max_scale:
            raise ConfigError(  # the first growth would lower it to max_scale, the first backoff raise it to min_scale
                f"precision.loss_scale.init_scale ({ls.init_scale:g}) is outside [min_scale, max_scale] = "
                f"[{ls.min_scale:g}, {ls.max_scale:g}]; set it inside, or widen the range"
            )

    @property
    def autocast(self) -> bool:
        """Whether forward and loss run under torch.autocast (mode "autocast"), the weights in fp32."""
        return self.mode == "autocast"

    @property
    def weights(self) -> str:
        """The dtype the model's weights and gradients are held in: ``storage``, or fp32 under autocast."""
        return "fp32" if self.autocast else self.storage

    def resolved_loss_scale_mode(self) -> str:
        """The loss-scale mode after "auto" is resolved against the storage dtype."""
        if self.loss_scale.mode != "auto":
            return self.loss_scale.mode
        return "dynamic" if self.storage == "fp16" else "none"


@dataclass(frozen=True, kw_only=True)
class ReducerConfig:
    backend: Literal["torch", "cupy-nccl"] = "torch"
    """"torch": torch.distributed (NCCL on CUDA, gloo on CPU). "cupy-nccl": cupy.cuda.nccl on a high-priority stream."""
    bucket_mb: float | Literal["auto"] = 25.0
    """Bucket capacity in MiB. Bigger: fewer launches; smaller: the first allreduce starts earlier.
    "auto": probe a few iterations with a bucket per parameter, fit the allreduce's cost, its overlap
    rate and its contention with backward, and choose the bucket boundaries that minimise what the
    communication adds to the step, exposed + contention (``dptrain.distributed.buckets``: ``probe``
    measures, ``planner`` plans, ``auto`` drives them; rank 0 decides, every rank switches at the
    same iteration; implies ``replan``)."""
    first_bucket_mb: float = 1.0
    """Capacity of the first bucket (the last layers), so communication starts early in backward."""
    dtype: Literal["auto", "fp16", "bf16", "fp32"] = "auto"
    """dtype of the gradients on the wire. The loss scale is always applied before the reduce. "auto":
    the 16-bit dtype of ``precision.storage`` in both precision modes (under autocast each bucket of
    fp32 gradients is cast to it for the allreduce and back: half the bytes of fp32, see the README's
    "O1 or O2"); fp32 with fp32 storage. "fp32": fp32 on the wire (with 16-bit storage each bucket is
    upcast, twice the bytes, and no fp16 sum can overflow at large world sizes). With 16-bit storage
    the wire holds the storage dtype or fp32; fp16 on the wire needs loss scaling."""
    shard: Literal["none", "optimizer"] = "none"
    """"optimizer" (ZeRO-1): each solver keeps the fp32 masters and the optimizer state of its own slice
    of every bucket only (1/world_size of them), buckets are reduce-scattered during backward and the
    updated weights all-gathered after the update: the same bytes on the wire as the allreduce, and
    the update's memory traffic divided by world_size (``dptrain.distributed.shards``). Snapshots
    stay whole: any world size, sharded or not, resumes them."""
    gather_wait: Literal["step", "forward"] = "forward"
    """With ``shard = "optimizer"``: when the updated weights' all-gathers are waited for. "forward":
    each bucket's just before the first module using its parameters runs, so the first layers
    compute while the later layers' weights arrive (a compiled model waits at the step's start
    instead: a hook inside its graphs would break them); "step": all of them before the next
    step's forward. See the README's sharding section for the measured difference."""
    replan: bool = False
    """After iteration 1, re-plan buckets from the observed gradient-ready order (rank 0 decides)."""
    timeout_s: float = 300.0
    """A per-iteration collective (gradient buckets, BatchNorm statistics) that does not finish
    within this many seconds fails the run on every rank, naming the rank that never arrived.
    gloo and cupy-nccl enforce it per collective; with NCCL through torch the process group's
    watchdog enforces train.process_group_timeout_s on every collective instead."""

    def __post_init__(self) -> None:
        if self.shard == "optimizer" and self.backend == "cupy-nccl":
            raise ConfigError("reducer.shard = \"optimizer\" reduce-scatters and all-gathers through torch.distributed: "
                              "set reducer.backend = \"torch\"")
        if self.bucket_mb != "auto":
            _positive("reducer.bucket_mb", self.bucket_mb)
        _positive("reducer.first_bucket_mb", self.first_bucket_mb)
        _positive("reducer.timeout_s", self.timeout_s)


@dataclass(frozen=True, kw_only=True)
class TrainSection:
    seed: int = 1
    """Seeds weights, sample order and augmentation."""
    run_dir: str = "runs/default"
    """Where config.toml, metrics.jsonl, snapshots and traces go."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """"auto": CUDA device LOCAL_RANK when available, else CPU."""
    threads: int = 0
    """torch intra-op threads per solver on CPU; 0 = cores / local world size."""
    host_malloc: Literal["auto", "keep", "system"] = "auto"
    """"keep": freed host memory stays in the process for the next step (glibc's mmap and trim
    thresholds raised, dptrain/hostmem.py): a CPU step no longer faults its activations' pages in
    again every iteration, at the price of a resident size that stays at the run's peak.
    "system": glibc's defaults. "auto": keep on the CPU device, system on CUDA."""
    cudnn_benchmark: bool = True
    """CUDA: let cuDNN time its convolution algorithms on the first step of each input shape and
    keep the fastest (NVCaffe autotunes likewise). Set false for run-to-run identical algorithms."""
    process_group_timeout_s: float = 600.0
    """Seconds a blocking collective (startup, displays, tests, snapshots) may take before every
    waiting rank fails; the reducer's per-iteration collectives use reducer.timeout_s."""
    straggler_warn: float = 0.10
    """Warn when one rank's compute per step exceeds the median rank's by more than this
    fraction for several displays in a row (0 = never)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to <run_dir>/tensorboard (needs the tensorboard package:
    pip install 'dptrain[tensorboard]'); metrics.jsonl stays the record."""

    def __post_init__(self) -> None:
        _positive("train.seed", self.seed, allow_zero=True)
        _positive("train.threads", self.threads, allow_zero=True)
        _positive("train.process_group_timeout_s", self.process_group_timeout_s)
        _positive("train.straggler_warn", self.straggler_warn, allow_zero=True)
        if not self.run_dir:
            raise ConfigError("train.run_dir must not be empty")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    solver: SolverConfig = field(default_factory=SolverConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    reducer: ReducerConfig = field(default_factory=ReducerConfig)
    train: TrainSection = field(default_factory=TrainSection)

    def __post_init__(self) -> None:
        self.wire_dtype()  # raises on a reducer.dtype this precision cannot reduce in
        if self.precision.momentum_dtype == "fp16" and self.solver.type not in ("sgd", "nesterov"):
            raise ConfigError(f"precision.momentum_dtype = \"fp16\" applies to solver.type \"sgd\" or \"nesterov\"; "
                              f"{self.solver.type}'s moments are fp32: set precision.momentum_dtype = \"fp32\"")


    def wire_dtype(self) -> str:
        """``reducer.dtype`` resolved against the precision: the gradients' dtype on the wire."""
        p, want = self.precision, self.reducer.dtype
        if want == "auto":
            return p.storage
        if not p.autocast and want not in (p.storage, "fp32"):
            raise ConfigError(f"reducer.dtype = \"{want}\" with precision.storage = \"{p.storage}\": the gradients "
                              f"are {p.storage}, reduced as they are or upcast to fp32; set reducer.dtype = \"auto\" "
                              f"or \"fp32\"")
        if want == "fp16" and p.resolved_loss_scale_mode() == "none":
            raise ConfigError("reducer.dtype = \"fp16\" without loss scaling would put unscaled gradients on the wire, "
                              "where fp16 flushes the small ones to zero: set precision.loss_scale.mode = \"dynamic\", "
                              "or reducer.dtype = \"bf16\" or \"fp32\"")
        return want


# --------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _check_value(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` exactly; return it (ints widened to float)."""
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices or isinstance(value, bool):
            raise ConfigError(f"{key} must be one of {choices}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):  # e.g. float | Literal["auto"]: the first member that takes it
        for member in get_args(tp):
            try:
                return _check_value(key, member, value)
            except ConfigError:
                pass
        kinds = " or ".join(f"one of {get_args(m)}" if get_origin(m) is Literal else _type_name(m) for m in get_args(tp))
        raise ConfigError(f"{key} must be {kinds}, got {value!r}")
    if origin is list:
        (item_tp,) = get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list of {_type_name(item_tp)}, got {value!r}")
        return [_check_value(f"{key}[{i}]", item_tp, v) for i, v in enumerate(value)]
    if origin is dict:  # a free-form table (model.args): any TOML values under string keys
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table, got {value!r}")
        return from_dict(tp, value, f"{key}.")
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):  # TOML has nan and inf; no setting means either
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        if not -(2**63) <= value < 2**63:
            raise ConfigError(f"{key} must fit in a signed 64-bit integer, got {value}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise AssertionError(f"unsupported config type {tp!r} for {key}")


def from_dict(cls: type, table: dict[str, Any], prefix: str) -> Any:
    """Build dataclass ``cls`` from a TOML table, rejecting unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {[f'{prefix}{k}' for k in unknown]}; valid: {names}"
        )
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [f"{prefix}{k}" for k in required if k not in table]
    if missing:
        raise ConfigError(f"missing required key(s) {missing}; valid: {names}")
    kwargs = {name: _check_value(f"{prefix}{name}", hints[name], value) for name, value in table.items()}
    return cls(**kwargs)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set expects section.key=value, got {item!r}")
    dotted, raw = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"--set expects section.key=value, got {item!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError as e:
        if raw.strip()[:1] in ("[", "{", '"', "'"):  # meant as an array, table or quoted string: not a bare word
            raise ConfigError(f"--set {item!r}: the value is not valid TOML ({str(e).splitlines()[0]}); close the "
                              f"brackets or quotes, e.g. {dotted.strip()}=[8, 16]") from e
        value = raw  # a bare word is a string
    return parts, value


def apply_overrides(table: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a deep copy of ``table`` with each ``section.key=value`` applied."""
    import copy

    out = copy.deepcopy(table)
    for item in overrides:
        parts, value = _parse_override(item)
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part} is not a table")
            node = child
        node[parts[-1]] = value
    return out


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a TOML file (or defaults when ``path`` is None), apply overrides, validate."""
    table: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            what = "is a folder, not a TOML file" if p.is_dir() else "not found"
            raise ConfigError(f"config file {str(p)!r} {what}; pass an existing TOML file to --config")
        try:
            table = tomllib.loads(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
                              f"pass a TOML file to --config") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e
    table = apply_overrides(table, overrides or [])
    return from_dict(TrainConfig, table, "")


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # a table inside a list (solver.param_groups) or a value: an inline table
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")


def _toml_key(k: str) -> str:
    """A key as TOML writes it: bare when it can be (the config's own keys), quoted otherwise (model.args)."""
    return k if k and all(c.isascii() and (c.isalnum() or c in "_-") for c in k) else _toml_value(k)


def dump_toml(cfg: TrainConfig) -> str:
    """Write the resolved config as TOML that :func:`load_config` reads back identically."""
    lines: list[str] = []

    def emit(table: dict[str, Any], name: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        lines.append(f"[{name}]")
        lines.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars.items())
        lines.append("")
        for k, v in table.items():
            if isinstance(v, dict):
                emit(v, f"{name}.{_toml_key(k)}")

    for section, table in config_to_dict(cfg).items():
        emit(table, section)
    return "\n".join(lines)


def config_hash(cfg: TrainConfig) -> str:
    """Short stable hash of the resolved config, for benchmark records."""
    import hashlib

    return hashlib.sha256(dump_toml(cfg).encode()).hexdigest()[:12]


def add_config_arguments(p: Any) -> None:
    """``--config`` and ``--set`` on an ``argparse`` parser: the commands that read a recipe."""
    p.add_argument("--config", required=True, help="TOML recipe, e.g. launch/configs/digits.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (TOML literal; bare words are strings); repeatable")
