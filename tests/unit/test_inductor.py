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
