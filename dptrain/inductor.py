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

**No boolean masks between forward and backward on the CPU** (:func:`cpu_compile_options`). Inductor's
C++ kernels read and write a ``torch.bool`` tensor many times slower than the same values
computed from a bf16 or fp32 tensor, because their vector code converts a mask element by element,
through ``VecMask::from(ptr, count)``, even for whole vectors (docs/measurements.md#boolean-masks).
AOT autograd's min-cut partitioner saves the cheapest tensors for backward, and a ReLU's bool mask
(1 byte an element) beats its output (2 or 4); where a graph ends at a ReLU, as a segment of a
ResNet does, it saves the mask, and its forward and backward kernels then crawl.
:func:`cpu_compile_options` has every comparison in the joint graph marked "must recompute"
(torch's selective-checkpoint tag), so the partitioner saves the tensor compared instead (a ReLU's
output, alive anyway as the next layer's input) and the backward compares it again; a
comparison of a random draw (dropout's) is left as it was. CUDA's
Triton kernels have no such cost, so only the CPU partition is changed, and only inside dptrain's
own compile.
"""
from __future__ import annotations

import functools
import logging
import os
import warnings
from pathlib import Path
from typing import Any

from dptrain.csrc.build import cache_dir

log = logging.getLogger(__name__)

TORCH_OWN_DEPRECATION = r"`torch\.jit\.script_method` is deprecated"
"""The one warning :func:`prepare` silences, during inductor's import only (module docstring)."""


def point_caches() -> Path:
    """Point inductor's caches at dptrain's cache folder unless the user set one (Triton's follow:
    inductor keeps them in ``<folder>/triton/<device>``); the inductor folder. Must run before anything
    asks inductor for its folder: the first ask (``torch._dynamo``'s import does) writes torch's
    default into the environment, which then looks like the user's choice. Called by
    ``dptrain.distributed.comm.import_dynamo_first``, the Trainer (first thing) and :func:`prepare`."""
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


COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")
"""aten's comparisons: the ops whose boolean result the CPU partition recomputes in backward."""
RANDOM_DEPTH = 4
"""How far back a comparison's inputs are searched for a random draw (dropout compares its draw
after a cast): such a comparison is left to the partitioner, so a dropout mask is drawn as before."""


def cpu_compile_options(device_type: str) -> dict[str, Any]:
    """``torch.compile`` options for dptrain's model graphs: on the CPU, a joint-graph pass after
    which the partitioner saves no comparison's boolean result for backward (module docstring),
    given per compiled function so that every recompile of it has it too. Empty off the CPU (nothing
    of torch's touched there), where the user set a joint-graph pass (theirs is kept; logged), and
    where this torch has no custom graph passes. The pass's ``uuid`` (a hash of this file) enters
    inductor's and AOT autograd's cache keys, so graphs compiled with and without it, or with an
    older version of it, are cached apart."""
    if device_type != "cpu":
        return {}
    try:
        from torch._inductor import config
        from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: F401 - torch >= 2.6
    except ImportError as e:
        log.info("model.compile: this torch has no custom graph passes (%s); the CPU partition is torch's", e)
        return {}
    if getattr(config, "joint_custom_post_pass", None) is not None:
        log.info("model.compile: a joint-graph pass is set (torch._inductor.config.joint_custom_post_pass), and "
                 "dptrain's CPU partition pass is left out")
        return {}
    return {"joint_custom_post_pass": _recompute_comparisons()}


@functools.cache
def _recompute_comparisons() -> Any:
    """The joint-graph pass of :func:`cpu_compile_options` (one per process)."""
    import torch
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
    from torch.utils.checkpoint import CheckpointPolicy

    targets = {getattr(torch.ops.aten, op).Tensor for op in COMPARISONS} | {
        getattr(torch.ops.aten, op).Scalar for op in COMPARISONS}

    def draws_random(node: torch.fx.Node, depth: int) -> bool:
        if node.op != "call_function" or depth < 0:
            return False
        tags = getattr(node.target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags or any(w in str(node.target) for w in ("random", "seed")):
            return True
        return any(draws_random(a, depth - 1) for a in node.all_input_nodes)

    class RecomputeComparisons(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            for node in graph.nodes:
                if (node.op == "call_function" and node.target in targets
                        and not any(draws_random(a, RANDOM_DEPTH) for a in node.all_input_nodes)):
                    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE

        def uuid(self) -> bytes:
            return get_hash_for_files((__file__,))

    return RecomputeComparisons()
