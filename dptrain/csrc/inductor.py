"""torch.compile's set-up for dptrain: its caches in dptrain's cache folder, and a quiet first import.

Inductor (torch.compile's compiler) keeps compiled code on disk and reuses it in later
processes: FX graphs, AOT autograd graphs, C++ and Triton kernels. By default they land in
``/tmp/torchinductor_<user>``, which a reboot or a node's tmp cleaner empties, so every
job on a fresh node pays the full compile again. :func:`prepare` points them at
``<cache>/inductor`` (``dptrain.csrc.build.cache_dir``: ``$DPTRAIN_CACHE``, else
``$XDG_CACHE_HOME/dptrain``, else ``~/.cache/dptrain``; Triton's kernels go to its ``triton/``)
unless the user set ``TORCHINDUCTOR_CACHE_DIR`` already.

The quiet import: torch 2.13's inductor imports ``torch.utils.mkldnn`` (through its pre-grad
passes), whose module body still decorates fourteen methods with the deprecated
``torch.jit.script_method``, so the first ``torch.compile`` of any function prints fourteen
DeprecationWarnings that name torch's own code and that no dptrain user can act on.
:func:`prepare` imports inductor once with exactly that warning (that message, that category)
ignored; every other warning, torch's included, passes as before.
"""
from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

from dptrain.csrc.build import cache_dir

TORCH_OWN_DEPRECATION = r"`torch\.jit\.script_method` is deprecated"
"""The one warning :func:`prepare` silences, during inductor's import only (module docstring)."""


def point_caches() -> Path:
    """Point inductor's caches at dptrain's cache folder unless the user set one (Triton's follow:
    inductor keeps them in ``<folder>/triton/<device>``); the inductor folder. Must run before anything
    asks inductor for its folder: the first ask (``torch._dynamo``'s import does) writes torch's
    default into the environment, which then looks like the user's choice. Called by
    ``dptrain.dist.comm.import_dynamo_first``, the Trainer (first thing) and :func:`prepare`."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


@functools.cache
def prepare() -> Path:
    """Point the caches (:func:`point_caches`) and import inductor quietly; once per process. The
    inductor cache folder in use."""
    point_caches()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCH_OWN_DEPRECATION, category=DeprecationWarning)
        import torch._inductor.compile_fx  # noqa: F401
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
