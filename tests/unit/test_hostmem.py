"""train.host_malloc: glibc's thresholds raised so freed memory is reused, not faulted in again."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from dptrain import hostmem
from dptrain.config import load_config
from dptrain.errors import ConfigError

ROUNDS = """
import resource, sys
import numpy as np
from dptrain.hostmem import keep_freed_memory
why = keep_freed_memory() if sys.argv[1] == "keep" else None
def one_round():  # a step's worth of large blocks: allocated, written, freed together
    blocks = [np.ones(2 << 20, dtype=np.float32) for _ in range(3)]  # 3 x 8 MiB
    del blocks
for _ in range(3):
    one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    one_round()
print(why, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def _faults_per_round(mode: str) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    env["NUMPY_MADVISE_HUGEPAGE"] = "0"  # a 2 MiB page faults once: the counts would not be pages
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True,
                         env=env).stdout
    why, faults = out.rsplit(maxsplit=1)
    return why, float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_keep_reuses_freed_blocks_instead_of_faulting_them_in_again():
    why, kept = _faults_per_round("keep")
    assert why == "None", why
    pages = 3 * (8 << 20) // 4096  # 6144 pages written per round
    assert kept < 0.02 * pages, f"{kept} minor faults per round of {pages} pages with keep_freed_memory"
    _, system = _faults_per_round("system")  # glibc's dynamic thresholds: this pattern is trimmed and refaulted
    assert system > 10 * max(kept, 1.0), (system, kept)


def test_the_users_own_malloc_settings_are_left_alone(monkeypatch):
    assert hostmem.users_choice({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) is None  # seen by malloc's address
    assert hostmem.users_choice({"MALLOC_ARENA_MAX": "2"}) == "MALLOC_ARENA_MAX=2"
    assert hostmem.users_choice({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}) is not None
    assert hostmem.users_choice({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}) is None
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert hostmem.keep_freed_memory() in ("the environment tunes glibc's malloc (MALLOC_TRIM_THRESHOLD_=0)",
                                           f"the platform is {sys.platform}, not Linux with glibc")


def test_a_refused_threshold_is_named():
    calls = []

    def mallopt(param: int, value: int) -> int:
        calls.append(param)
        return 0 if param == hostmem.M_TRIM_THRESHOLD else 1

    assert hostmem.set_thresholds(mallopt) == f"mallopt(M_TRIM_THRESHOLD, {hostmem.TRIM_THRESHOLD_BYTES}) was refused"
    assert calls == [hostmem.M_MMAP_THRESHOLD, hostmem.M_TRIM_THRESHOLD]
    assert hostmem.set_thresholds(lambda param, value: 1) is None


def test_setting_decides_per_device(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(hostmem, "keep_freed_memory", lambda: calls.append(1) or None)
    assert hostmem.apply_host_malloc("system", "cpu", 0) is False
    assert hostmem.apply_host_malloc("auto", "cuda", 0) is False
    assert calls == []
    assert hostmem.apply_host_malloc("auto", "cpu", 0) is True and hostmem.apply_host_malloc("keep", "cuda", 0) is True
    monkeypatch.setattr(hostmem, "keep_freed_memory", lambda: "the C library is not glibc")
    with caplog.at_level(logging.DEBUG, logger="dptrain.hostmem"):
        assert hostmem.apply_host_malloc("keep", "cpu", 3) is False
        assert hostmem.apply_host_malloc("auto", "cpu", 3) is False
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING, logging.DEBUG]
    assert caplog.records[0].getMessage().startswith("rank 3: train.host_malloc = 'keep'") and \
        caplog.records[0].getMessage().endswith("the C library is not glibc")


def test_config_key_is_checked():
    assert load_config(None, []).train.host_malloc == "auto"
    with pytest.raises(ConfigError, match=r"train.host_malloc must be one of \('auto', 'keep', 'system'\)"):
        load_config(None, ["train.host_malloc=always"])
