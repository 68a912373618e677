"""Model weights in and out: ``train --weights``, ``test --weights`` and ``export``.

* **Reading** (:func:`read_weights`): a dptrain snapshot, of which only the model is taken
  (fp32 masters and buffers; its iteration, optimizer state and RNG are not), or a plain
  ``state_dict`` saved with ``torch.save(model.state_dict(), PATH)``. Both are read with
  ``weights_only=True``: a weights file never runs code.
* **Names** (:data:`TORCHVISION_NAMED`): dptrain's ImageNet ResNets call their stem's 7x7
  conv and its BatchNorm ``stem.0`` and ``stem.1``; torchvision calls them ``conv1`` and
  ``bn1``. Every other name (``layer1.0.conv1.weight``, ``layer2.0.downsample.1.running_var``,
  ``fc.bias``...) and every shape is the same, so the two prefixes are the whole mapping,
  used both ways: :func:`from_torchvision` on reading, :func:`to_torchvision` on export.
  Other models keep dptrain's names.
* **Fitting** (:func:`fit_weights`): every tensor of the model must come from the file
  with its shape, and the file may hold nothing else, except names matched by a
  ``--weights-skip`` glob, which keep the model's initial values (a new classifier head).
  All mismatches are reported in one error.
"""
from __future__ import annotations

import fnmatch
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptrain.errors import ConfigError, SnapshotError, first_line
from dptrain.flat import FlatParams
from dptrain.models import is_import_path
from dptrain.snapshots import (
    check_snapshot,
    folder_given,
    free_space,
    is_snapshot_file,
    load_snapshot,
    load_tensors,
    save_atomically,
)

log = logging.getLogger(__name__)

TORCHVISION_NAMED = frozenset({"resnet18", "resnet34", "resnet50", "resnet101"})
"""Zoo entries whose architecture is torchvision's namesake (ResNet v1.5, as torchvision's)."""
_STEM_NAMES = (("stem.0.", "conv1."), ("stem.1.", "bn1."))
"""(dptrain prefix, torchvision prefix) of the ImageNet ResNets' stem conv and BatchNorm."""
_LISTED = 5
"""Names listed per kind of mismatch in an error line; the rest are counted."""


def _renamed(state: dict[str, torch.Tensor], pairs: tuple[tuple[str, str], ...]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        for old, new in pairs:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = t
    return out


def to_torchvision(model_name: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (dptrain names) in torchvision's names when ``model_name`` is torchvision's architecture."""
    return _renamed(state, _STEM_NAMES) if model_name in TORCHVISION_NAMED else dict(state)


def from_torchvision(model_name: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` in dptrain's names: torchvision's stem names renamed for its architectures. dptrain's
    own names pass unchanged (no dptrain name of these models starts with ``conv1.`` or ``bn1.``)."""
    if model_name not in TORCHVISION_NAMED:
        return dict(state)
    return _renamed(state, tuple((tv, ours) for ours, tv in _STEM_NAMES))


def check_weights_path(path: str) -> Path:
    """``--weights PATH`` must be a file; checked before anything slow is built. A folder is refused
    naming its newest snapshot: a state_dict could be any file there, so none is taken for the user."""
    p = Path(path)
    if p.is_dir():
        raise folder_given(p, "--weights")
    if not p.is_file():
        raise SnapshotError(f"--weights {path!r}: no such file; pass a dptrain snapshot_iter_<N>.pt or a file saved "
                            f"with torch.save(model.state_dict(), PATH)")
    return p


def read_weights(p: Path) -> tuple[dict[str, torch.Tensor], str, list[str] | None]:
    """The tensors in weights file ``p`` by name, what the file is (for the log), and the image-folder
    classes a dptrain snapshot was trained on (None: not a snapshot, or not trained on a folder)."""
    obj = load_tensors(p, "weights file", foreign="save the weights with torch.save(model.state_dict(), PATH)",
                       torn="it is torn or not a torch.save file")
    if isinstance(obj, dict) and "iteration" in obj and "model" in obj:
        state = check_snapshot(obj, p)
        return (state["model"], f"the model of dptrain snapshot iteration {state['iteration']}",
                state.get("data", {}).get("classes"))
    if _is_state_dict(obj):
        return _unprefixed(dict(obj)), "a state_dict", None
    for entry in WRAPPED_STATE_DICTS:  # torchvision's reference scripts: {"model": sd, "optimizer": ...}
        if isinstance(obj, dict) and _is_state_dict(obj.get(entry)):
            return _unprefixed(dict(obj[entry])), f"the state_dict under {entry!r}", None
    held = f"a dict with keys {list(obj)[:_LISTED]}" if isinstance(obj, dict) else f"a {type(obj).__name__}"
    raise SnapshotError(f"weights file {str(p)!r} holds {held}, neither a dptrain snapshot nor a state_dict (names to "
                        f"tensors), nor a checkpoint holding one under {' / '.join(WRAPPED_STATE_DICTS)}; save one "
                        f"with torch.save(model.state_dict(), PATH)")


WRAPPED_STATE_DICTS = ("model", "state_dict", "model_state_dict", "model_state")
"""Entries a training script's checkpoint keeps its model's state_dict under (torchvision's references:
"model"; Lightning and others: "state_dict"; the PyTorch tutorials: "model_state_dict")."""

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
"""Name prefixes that wrappers add to every name of a state_dict: DDP / DataParallel's ``module``, a
torch.compile'd module's ``_orig_mod``."""


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                      for k, v in obj.items())


def _unprefixed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` without a wrapper's prefix that every name carries (``module.``, ``_orig_mod.``; nested too)."""
    while True:
        prefix = next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in weights)), None)
        if prefix is None:
            return weights
        log.info("weights: the prefix %r every name carries (a wrapper's: DDP, torch.compile) is dropped", prefix)
        weights = {k.removeprefix(prefix): v for k, v in weights.items()}


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


def fit_weights(model: nn.Module, weights: dict[str, torch.Tensor], skip: tuple[str, ...],
                what: str) -> dict[str, torch.Tensor]:
    """The tensors of ``weights`` (dptrain names) to load into ``model``, by name.

    Names matching a ``skip`` glob are neither loaded nor required. A missing
    ``num_batches_tracked`` is no mismatch (torch's own loading accepts that too; it
    does not enter the BatchNorm output with a set momentum). Raises one
    :class:`SnapshotError` listing the missing, unexpected and shape-mismatched names.
    """
    own = model.state_dict()
    for pattern in skip:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in [*own, *weights]):
            raise ConfigError(f"--weights-skip {pattern!r} matches no name of the model or of {what}; the model's "
                              f"names look like {_listed(list(own))}")

    def skipped(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in skip)

    missing = [n for n in own if n not in weights and not skipped(n) and not n.endswith(".num_batches_tracked")]
    unexpected = [n for n in weights if n not in own and not skipped(n)]
    shapes = [f"{n} {list(weights[n].shape)} vs {list(own[n].shape)}" for n in own
              if n in weights and not skipped(n) and weights[n].shape != own[n].shape]
    if missing or unexpected or shapes:
        found = [f"{len(missing)} missing ({_listed(missing)})" if missing else "",
                 f"{len(unexpected)} unexpected ({_listed(unexpected)})" if unexpected else "",
                 f"{len(shapes)} of another shape (file vs model: {_listed(shapes)})" if shapes else ""]
        raise SnapshotError(f"{what} does not fit this model: {'; '.join(f for f in found if f)}; check model.name / "
                            f"model.num_classes, or pass --weights-skip GLOB (repeatable, e.g. 'fc.*') for the names "
                            f"that should keep this model's initial values")
    return {n: weights[n] for n in own if n in weights and not skipped(n)}


def load_weights(model: nn.Module, flat: FlatParams, p: Path, *, model_name: str,
                 skip: tuple[str, ...] = ()) -> list[str] | None:
    """Set ``model``'s weights from file ``p``: parameters into the fp32 masters (the storage
    copies are derived from them), buffers into the model. Nothing else changes: the
    iteration, the optimizer state and the RNG stay as they are (fresh, for a new run).
    Returns the image-folder classes a dptrain snapshot was trained on (see :func:`read_weights`)."""
    weights, kind, classes = read_weights(p)
    what = f"--weights {str(p)!r} ({kind})"
    chosen = fit_weights(model, from_torchvision(model_name, weights), skip, what)
    params = {n for n, _ in model.named_parameters()}
    masters = flat.master_state()
    masters.update({n: t.float() for n, t in chosen.items() if n in params})
    flat.load_master_state(masters)
    model.load_state_dict({n: t for n, t in chosen.items() if n not in params}, strict=False)
    kept = [n for n in model.state_dict() if n not in chosen and not n.endswith(".num_batches_tracked")]
    log.info("weights from %s: %d tensor(s) loaded%s", what, len(chosen),
             f"; initial values kept for {_listed(kept)}" if kept else "")
    return classes


def export_snapshot(snapshot: str, out: str) -> dict[str, Any]:
    """``dptrain export``: write a snapshot's model as an fp32 state_dict, in torchvision's names
    where the architecture is torchvision's; return the JSON record the CLI prints."""
    src, dst = Path(snapshot), Path(out)
    state = load_snapshot(src)
    if dst.exists() and dst.resolve() == src.resolve():
        raise ConfigError(f"export {snapshot!r} {out!r} would overwrite the snapshot itself; choose another OUT path")
    if dst.is_file() and is_snapshot_file(dst):
        raise ConfigError(f"export OUT {out!r} is a dptrain snapshot; exporting over it would lose it (and "
                          f"--resume auto would fall back past it): choose another OUT path")
    name = state["config"]["model"]["name"]
    # contiguous copies: a sharded run's snapshot holds views of one gathered buffer per group (NHWC
    # weights strided), which the file would carry with its padding, each loaded tensor keeping it alive
    tensors = {k: v.to(torch.float32 if v.is_floating_point() else v.dtype).clone(memory_format=torch.contiguous_format)
               for k, v in state["model"].items()}
    try:
        save_atomically(to_torchvision(name, tensors), dst)
    except (OSError, RuntimeError) as e:  # RuntimeError: torch's zip writer on a full disk
        raise SnapshotError(f"cannot write {out!r} ({type(e).__name__}: {first_line(e)}; "
                            f"{free_space(dst.parent)}); choose another OUT path") from e
    names = "torchvision" if name in TORCHVISION_NAMED else "the model's own" if is_import_path(name) else "dptrain"
    log.info("exported the model of %s (%s, iteration %d) to %s in %s names", src, name, state["iteration"], dst, names)
    return {"out": str(dst), "snapshot": str(src), "iteration": int(state["iteration"]), "model": name,
            "names": names, "tensors": len(tensors)}
