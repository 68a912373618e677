"""What the model returns, and the training loss made of it.

A model may return:

* a tensor: the logits, [B, num_classes];
* a tuple or list (a namedtuple too, as torchvision's GoogLeNet and Inception return in training):
  the first element is the logits;
* a dict: the logits are at ``"logits"`` (else ``"out"``, torchvision's name for a model's main output).

Any other element of the tuple, list or dict that is a tensor of the logits' shape is an auxiliary
classifier's logits: its cross-entropy, times ``model.aux_loss_weight``, is added to the loss (the
GoogLeNet and Inception recipes weight their aux heads so). Elements of any other shape (features, a
mask) take no part. The test phase scores the logits only; in eval mode such models return the
logits alone anyway.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dptrain.errors import ConfigError

LOGIT_KEYS = ("logits", "out")
"""Keys of a dict output that hold the logits, in the order they are looked for."""


def split_output(out: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits, auxiliary logits) of a model's output (module docstring)."""
    if torch.is_tensor(out):
        return out, []
    if isinstance(out, dict):
        key = next((k for k in LOGIT_KEYS if k in out and torch.is_tensor(out[k])), None)
        if key is None:
            raise ConfigError(f"the model returned a dict with keys {sorted(map(str, out))}; dptrain takes the logits "
                              f"from {' or '.join(repr(k) for k in LOGIT_KEYS)}: return a tensor or one of those keys")
        logits, rest = out[key], [v for k, v in out.items() if k != key]
    elif isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        logits, rest = out[0], list(out[1:])
    else:
        raise ConfigError(f"the model returned a {type(out).__name__}; dptrain needs the logits: a tensor, a "
                          f"tuple/list whose first element is the logits, or a dict with 'logits'")
    return logits, [t for t in rest if torch.is_tensor(t) and t.shape == logits.shape]


def check_logits(logits: torch.Tensor, batch: int, num_classes: int, name: str, training: bool = True) -> None:
    """The first batch's logits must be [batch, num_classes], in training and in evaluation mode: a model
    built for another class count, or one returning features, is named in one line instead of failing
    inside the loss or being scored on the wrong output."""
    if logits.dim() != 2 or logits.shape[0] != batch or logits.shape[1] != num_classes:
        mode = "" if training else " in evaluation mode (model.eval(), the test phase)"
        raise ConfigError(f"model.name {name!r} returned logits of shape {list(logits.shape)} for a batch of {batch}"
                          f"{mode}; "
                          f"dptrain needs [{batch}, {num_classes}] (model.num_classes = {num_classes}): set "
                          f"model.num_classes, or pass the class count in model.args")


def training_loss(out: Any, labels: torch.Tensor, *, label_smoothing: float, aux_weight: float) -> torch.Tensor:
    """The fp32 cross-entropy of the logits, plus ``aux_weight`` times each auxiliary classifier's."""
    logits, aux = split_output(out)
    loss = F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing)
    for a in aux:
        loss = loss + aux_weight * F.cross_entropy(a.float(), labels, label_smoothing=label_smoothing)
    return loss
