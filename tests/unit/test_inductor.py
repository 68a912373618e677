"""torch.compile's set-up (dptrain.csrc.inductor), each in a fresh interpreter: the caches land in
dptrain's cache folder, and a first compile prints no DeprecationWarning."""
from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, os, warnings
warnings.simplefilter("always")
import torch
from dptrain.csrc.inductor import prepare
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    where = prepare()
    out = float(torch.compile(lambda x: (x * 2).sum())(torch.ones(4))) if os.environ.get("COMPILE") else None
print(json.dumps({"where": str(where), "env": os.environ["TORCHINDUCTOR_CACHE_DIR"],
                  "triton": os.environ["TRITON_CACHE_DIR"], "out": out,
                  "deprecations": [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)],
                  "files": sum(len(fs) for _, _, fs in os.walk(os.environ["TORCHINDUCTOR_CACHE_DIR"]))}))
"""


def run(env: dict[str, str]) -> dict:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env={**keep, **env}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_compile_caches_live_in_dptrains_cache_folder_and_torchs_own_deprecation_stays_quiet(tmp_path):
    got = run({"DPTRAIN_CACHE": str(tmp_path), "COMPILE": "1"})
    assert got["out"] == 8.0
    assert got["where"] == got["env"] == str(tmp_path / "inductor")
    assert got["triton"] == str(tmp_path / "inductor" / "triton")
    assert got["files"] > 0  # the compiled code is on disk there, for the next process
    assert got["deprecations"] == []


def test_a_users_own_cache_folder_wins(tmp_path):
    got = run({"DPTRAIN_CACHE": str(tmp_path / "d"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine")})
    assert got["where"] == str(tmp_path / "mine") and got["deprecations"] == []
