"""Models: the zoo and the user's own, built by one function, :func:`build_model`.

``model.name`` is either a zoo entry of :data:`MODELS` (plain ``nn.Module``s with no distributed,
precision or config imports, built as ``builder(num_classes=..., width=..., in_channels=...)``;
``width`` matters only for the ``*_cifar`` nets, ``in_channels`` is the samples') or an import
path ``"package.module:callable"`` (:func:`resolve`): any importable callable that returns an
``nn.Module``, called with ``model.args`` as keyword arguments and ``num_classes`` when it takes
one. ``"timm:NAME"`` goes through ``timm.create_model(NAME, ...)``. A callable handed to
``dptrain.fit(model=...)`` is registered under its import path (:func:`register`), so the run
records a name that ``--resume``, ``dptrain test`` and ``export`` can read back.

Every failure a user can cause (a module that does not import, a name it lacks, arguments the
callable refuses, a result that is no ``nn.Module``) is one :class:`ConfigError` naming
``model.name`` or ``model.args``. :func:`check_input` tries a sample shape on the meta device.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from dptrain.errors import ConfigError
from dptrain.models.alexnet import alexnet
from dptrain.models.googlenet import googlenet
from dptrain.models.lenet import lenet
from dptrain.models.resnet import resnet18, resnet18_cifar, resnet34, resnet50, resnet101


class ModelBuilder(Protocol):
    """Signature shared by every zoo entry."""

    def __call__(self, *, num_classes: int, width: int = 64, in_channels: int = 3) -> nn.Module: ...


MODELS: dict[str, ModelBuilder] = {
    "lenet": lenet,
    "resnet18_cifar": resnet18_cifar,
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet50": resnet50,
    "resnet101": resnet101,
    "alexnet": alexnet,
    "googlenet": googlenet,
}

_REGISTERED: dict[str, Callable[..., nn.Module]] = {}
"""Callables handed to ``dptrain.fit(model=...)``, by the import path the run records."""


def is_import_path(name: str) -> bool:
    """Whether ``model.name`` names the user's callable (``"package.module:callable"``), not a zoo entry."""
    return ":" in name


def import_path_of(fn: Callable[..., Any]) -> str:
    """``"module:qualname"`` of a callable (a function or a class)."""
    return f"{fn.__module__}:{fn.__qualname__}"


def register(fn: Callable[..., nn.Module]) -> str:
    """Make ``fn`` buildable by its import path in this process (``dptrain.fit(model=fn)``); the path."""
    if isinstance(fn, nn.Module):
        raise ConfigError(f"model= got a built {type(fn).__name__} instance; pass the class or a factory "
                          f"(model={type(fn).__name__}) and its arguments as model.args: dptrain builds the model "
                          f"in every solver and records its import path for --resume, test and export")
    if not callable(fn):
        raise ConfigError(f"model= must be a callable that returns an nn.Module (a class or a factory), got "
                          f"{type(fn).__name__}")
    if isinstance(fn, functools.partial):
        raise ConfigError(f"model= got a functools.partial of {getattr(fn.func, '__qualname__', fn.func)!r}; pass "
                          f"the callable itself and its arguments as model.args (overrides=[\"model.args.KEY=VALUE\"])")
    qualname = getattr(fn, "__qualname__", None)
    if qualname is None or "<lambda>" in qualname or "<locals>" in qualname:
        raise ConfigError(f"model= got {qualname or type(fn).__name__!r}, which has no import path; define the class "
                          f"or factory at module level: the run records its import path for --resume, test and "
                          f"export")
    name = import_path_of(fn)
    _REGISTERED[name] = fn
    return name


def resolve(name: str) -> Callable[..., nn.Module]:
    """The callable ``"package.module:callable"`` names (``"timm:NAME"``: ``timm.create_model`` bound to
    NAME). The working directory is searched too, as ``python -m`` does."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    module_name, _, attr = name.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)  # after PYTHONPATH and the installed packages
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure while importing the user's module is theirs to fix
        raise ConfigError(f"model.name {name!r}: cannot import module {module_name!r} ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); put it on PYTHONPATH or in "
                          f"the working directory, or install it (torchvision, timm: pip install "
                          f"'dptrain[models]')") from e
    if module_name == "timm":
        return functools.partial(module.create_model, attr)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"model.name {name!r}: module {module_name!r} has no {attr!r}; check the name after "
                              f"the colon")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"model.name {name!r} is a {type(obj).__name__}, not a callable that returns an nn.Module")
    return obj


def _call_kwargs(fn: Callable[..., nn.Module], name: str, args: dict[str, Any], num_classes: int) -> dict[str, Any]:
    """``model.args`` plus ``num_classes`` where ``fn`` takes it, checked against ``fn``'s signature."""
    kwargs = dict(args)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: call it and see
        sig = None
    takes = sig is not None and ("num_classes" in sig.parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()))
    if "num_classes" in kwargs and kwargs["num_classes"] != num_classes:
        raise ConfigError(f"model.args.num_classes = {kwargs['num_classes']} contradicts model.num_classes = "
                          f"{num_classes}; set model.num_classes only")
    if takes:
        kwargs["num_classes"] = num_classes
    if sig is not None:
        try:
            sig.bind(**kwargs)
        except TypeError as e:
            raise ConfigError(f"model.args {args} do not fit {name} ({e}); see its signature {sig}") from e
    return kwargs


_REFUSED_ARGS = ("unexpected keyword argument", "got multiple values for", "missing 1 required",
                 "required keyword-only", "required positional")
"""TypeError texts of a call whose keywords do not fit (a keyword the callable passes on and its
callee refuses: timm's ``create_model``), as against a TypeError raised by a bug inside it."""


def _build_error(name: str, args: dict[str, Any], e: Exception) -> str:
    """One line for an exception the user's callable raised while building the model: what, and where."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, TypeError) and any(t in text for t in _REFUSED_ARGS):
        return f"model.args {args} were refused by {name}: {text}; check model.args against its signature"
    frames = traceback.extract_tb(e.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if len(frames) > 1 else ""
    return (f"model.name {name!r} raised {type(e).__name__} while building the model{where}: {text}; "
            f"check model.name and model.args {args}")


def build_model(name: str, *, num_classes: int, width: int = 64, in_channels: int = 3,
                args: dict[str, Any] | None = None, channels_last: bool = False) -> nn.Module:
    """Instantiate ``model.name``: a zoo entry, or the user's callable with ``args`` (module docstring)."""
    if is_import_path(name):
        fn = resolve(name)
        kwargs = _call_kwargs(fn, name, args or {}, num_classes)
        try:
            model = fn(**kwargs)
        except Exception as e:  # noqa: BLE001 - whatever the user's callable raises is theirs to fix
            raise ConfigError(_build_error(name, args or {}, e)) from e
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.name {name!r} returned a {type(model).__name__}, not an nn.Module; point it at "
                              f"a class or a function that builds the model")
    elif name in MODELS:
        model = MODELS[name](num_classes=num_classes, width=width, in_channels=in_channels)
    else:
        raise ConfigError(f"model.name must be one of {sorted(MODELS)}, got {name!r}; or give your own model as "
                          f"\"package.module:callable\"")
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def check_input(name: str, *, num_classes: int, width: int, sample_shape: tuple[int, int, int],
                args: dict[str, Any] | None = None) -> str | None:
    """Why ``model.name`` cannot take [H, W, C] samples (torch's first error line), or None (it can,
    or the model cannot be built to find out).

    The model is built and run on the meta device: shapes only, no memory and no compute. A model
    that cannot be built there (its ``__init__`` reads a tensor's value: ``float()``, ``.item()``,
    ``.tolist()``) is built on the CPU and run on one sample of zeros instead.
    """
    h, w, c = sample_shape
    for device in ("meta", "cpu"):
        with torch.device(device):
            try:
                model = build_model(name, num_classes=num_classes, width=width, in_channels=c, args=args)
            except Exception:  # noqa: BLE001 - a user model that cannot be built here: try the next device
                continue
            try:
                with torch.no_grad():
                    model.eval()(torch.zeros((1, c, h, w)))
            except (RuntimeError, ValueError, AssertionError) as e:
                text = str(e).strip()
                return text.splitlines()[0] if text else type(e).__name__
            return None
    return None
