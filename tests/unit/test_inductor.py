"""torch.compile's set-up (dptrain.csrc.inductor), each in a fresh interpreter started as a solver starts
(torch._dynamo first): inductor's caches point at dptrain's cache folder, and its first import prints no
DeprecationWarning. (A compile that writes
there: tests/dist/test_compile.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, os, warnings
import torch
from dptrain.csrc.inductor import prepare
from dptrain.dist.comm import import_dynamo_first
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import_dynamo_first()  # as a solver starts: torch._dynamo's import asks inductor for its cache folder
    where = prepare()
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
print(json.dumps({"where": str(where), "inductor_uses": cache_dir(), "triton": triton_cache_dir(0),
                  "deprecations": [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]}))
"""


def run(env: dict[str, str]) -> dict:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env={**keep, **env}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_compile_caches_live_in_dptrains_cache_folder_and_torchs_own_deprecation_stays_quiet(tmp_path):
    got = run({"DPTRAIN_CACHE": str(tmp_path)})
    assert got["where"] == got["inductor_uses"] == str(tmp_path / "inductor")
    assert got["triton"].startswith(str(tmp_path / "inductor" / "triton"))  # inductor derives Triton's
    assert got["deprecations"] == []


def test_a_users_own_cache_folder_wins(tmp_path):
    got = run({"DPTRAIN_CACHE": str(tmp_path / "d"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine")})
    assert got["where"] == got["inductor_uses"] == str(tmp_path / "mine") and got["deprecations"] == []


PARTITION = r"""
import contextlib, json
import torch
from dptrain.csrc.inductor import cpu_partition, prepare
prepare()

def block(x, w):  # a graph that ends at a ReLU, as a segment of a ResNet does
    return torch.relu(x * w + 1.0)

def saved_bool(changed_partition):
    torch._dynamo.reset()  # compile again: from inductor's on-disk cache where the key matches
    torch.manual_seed(0)
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    w = torch.randn(32, dtype=torch.bfloat16, requires_grad=True)
    dtypes = []
    with cpu_partition("cpu") if changed_partition else contextlib.nullcontext():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (dtypes.append(t.dtype), t)[1], lambda t: t):
            out = torch.compile(block)(x, w)
        out.float().sum().backward()
    return dtypes.count(torch.bool), len(dtypes), w.grad.float().sum().item()

plain, changed = saved_bool(False), saved_bool(True)
with cpu_partition("cuda") as off_cpu:
    pass
torch._inductor.config.joint_custom_post_pass = lambda graph: None  # a user's own pass
with cpu_partition("cpu") as over_users:
    kept = torch._inductor.config.joint_custom_post_pass is not None
print(json.dumps({"plain": plain, "changed": changed, "off_cpu": off_cpu, "over_users": over_users, "kept": kept}))
"""


def test_cpu_graphs_save_no_boolean_mask_and_are_cached_apart_from_those_that_do(tmp_path):
    """torch's own partition saves the ReLU's boolean mask (the slow kernels, dptrain/csrc/inductor.py);
    dptrain's saves the ReLU's output instead, with the same gradient, and is not served the other's
    artifact from the shared on-disk cache."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    done = subprocess.run([sys.executable, "-c", PARTITION], env={**keep, "DPTRAIN_CACHE": str(tmp_path)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    (plain_bool, plain_saved, plain_grad), (bool_saved, saved, grad) = got["plain"], got["changed"]
    assert plain_bool == 1 and bool_saved == 0 and saved >= 1
    assert grad == plain_grad
    assert got["off_cpu"] is False and got["over_users"] is False and got["kept"]
