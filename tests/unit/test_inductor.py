"""torch.compile's set-up (dptrain.inductor), each in a fresh interpreter started as a solver starts
(torch._dynamo first): inductor's caches point at dptrain's cache folder, and its first import prints no
DeprecationWarning. (A compile that writes
there: tests/distributed/test_compile.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, os, warnings
import torch
from dptrain.inductor import prepare
from dptrain.distributed.comm import import_dynamo_first
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
import json
import torch
from dptrain.inductor import cpu_compile_options, prepare
prepare()

def block(x, w):  # a graph that ends at a ReLU, as a segment of a ResNet does, and a dropout: a comparison
    # of a random draw, left as it was
    return torch.relu(x * w + 1.0), torch.nn.functional.dropout(torch.relu(x * w), 0.5, True)

def run(fn, options, recompile):
    torch._dynamo.reset()  # compile again: from inductor's on-disk cache where the key matches
    torch.manual_seed(0)
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    w = torch.randn(32, dtype=torch.bfloat16, requires_grad=True)
    dtypes = []
    compiled = torch.compile(fn, options=options or None)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (dtypes.append(str(t.dtype)), t)[1], lambda t: t):
        relu, dropped = compiled(x, w)
    (relu.float().sum() + dropped.float().sum()).backward()
    saved = {"dtypes": dtypes, "relu": relu.float().tolist(), "dropped": dropped.float().tolist(),
             "grad": w.grad.float().tolist()}
    if not recompile:
        return saved
    torch.manual_seed(1)  # a second shape: a recompile of the same function
    x2, dtypes2 = torch.randn(48, 32, dtype=torch.bfloat16), []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (dtypes2.append(str(t.dtype)), t)[1], lambda t: t):
        compiled(x2, w)
    saved["recompiled_dtypes"] = dtypes2
    return saved

got = {"torchs": run(block, {}, False), "ours": run(block, cpu_compile_options("cpu"), True),
       "off_cpu": cpu_compile_options("cuda")}
torch._inductor.config.joint_custom_post_pass = lambda graph: None  # a user's own pass
got["over_users"] = cpu_compile_options("cpu")
print(json.dumps(got))
"""


def test_cpu_graphs_save_no_comparison_mask_in_any_compile_and_are_cached_apart(tmp_path):
    """torch's own partition saves the ReLU's boolean mask (the slow kernels, dptrain/inductor.py);
    dptrain's saves the ReLU's output instead, with the same output and gradient, in a recompile at a
    new shape too, and is not served torch's artifact from the shared on-disk cache. Dropout's mask,
    a comparison of a random draw, is left to torch: the same draw, output and gradient."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    done = subprocess.run([sys.executable, "-c", PARTITION], env={**keep, "DPTRAIN_CACHE": str(tmp_path)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    torchs, ours = got["torchs"], got["ours"]
    # torch's: the ReLU's mask and dropout's; ours: dropout's only, in the first compile and the recompile
    assert torchs["dtypes"].count("torch.bool") == 2
    assert ours["dtypes"].count("torch.bool") == 1 and ours["recompiled_dtypes"].count("torch.bool") == 1
    assert len(ours["dtypes"]) == len(torchs["dtypes"])
    assert ours["relu"] == torchs["relu"] and ours["grad"] == torchs["grad"]
    assert ours["dropped"] == torchs["dropped"]  # the same draw
    assert got["off_cpu"] == {} and got["over_users"] == {}
