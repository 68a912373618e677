"""Training from an LMDB of the digits equals training from the in-memory digits, bit for bit."""
from __future__ import annotations

import json

import torch

from dptrain.config import load_config
from dptrain.distributed.comm import Communicator
from dptrain.tools.make_lmdb import make_digits_lmdb
from dptrain.topology import Topology
from dptrain.train import Trainer


def _train(tmp_path, name: str, *sets: str) -> dict[str, torch.Tensor]:
    cfg = load_config(None, ["model.name=lenet", "data.batch_size=32", "data.mean_value=[77.75]",
                             "data.scale=0.015625", "solver.base_lr=0.01", "solver.display=0",
                             f"train.run_dir={json.dumps(str(tmp_path / name))}", *sets])
    t = Trainer(cfg, Communicator.from_env(Topology(), 60, torch.device("cpu")))
    for _ in range(60):  # 60 x 32 > one epoch of 1500: crosses an epoch boundary and a reshuffle
        t.train_step()
    t.close()
    return t.flat.master_state()


def test_lmdb_and_builtin_digits_train_identically(tmp_path):
    make_digits_lmdb(tmp_path / "lmdb", encoded=True)  # PNG: lossless
    builtin = _train(tmp_path, "builtin", "data.source=digits")
    from_lmdb = _train(tmp_path, "lmdb", "data.source=lmdb", f"data.path={json.dumps(str(tmp_path / 'lmdb/train'))}",
                       "data.transformer_threads=2", "data.prefetch=1")
    # Same samples in the same order through the same math: any stale or reused sample (e.g.
    # a ring slot refilled while its labels were still needed by backward) breaks equality.
    for name, w in builtin.items():
        assert torch.equal(w, from_lmdb[name]), name


def test_a_flat_mean_image_trains_exactly_like_the_same_mean_value(tmp_path):
    """The per-pixel mean path (crop windows through the ring, gathered in DeviceFeeder) is wired into
    training: a mean image that equals mean_value everywhere changes no bit."""
    import numpy as np

    make_digits_lmdb(tmp_path / "lmdb", encoded=True)
    np.save(tmp_path / "mean.npy", np.full((1, 32, 32), 77.75))
    lmdb = ["data.source=lmdb", f"data.path={json.dumps(str(tmp_path / 'lmdb/train'))}",
            f"data.test_path={json.dumps(str(tmp_path / 'lmdb/test'))}", "data.prefetch=1"]
    by_value = _train(tmp_path, "value", *lmdb)
    by_image = _train(tmp_path, "image", *lmdb, f"data.mean_file={json.dumps(str(tmp_path / 'mean.npy'))}")
    for name, w in by_value.items():
        assert torch.equal(w, by_image[name]), name


def test_a_bad_test_record_is_not_scored(tmp_path):
    """With data.max_bad_records the test phase drops a bad record instead of scoring a substitute
    twice: test_samples counts the records actually scored, test_bad_records the dropped ones."""
    import lmdb

    make_digits_lmdb(tmp_path / "lmdb", encoded=True)
    test_db = tmp_path / "lmdb/test"
    with lmdb.open(str(test_db), subdir=True) as env, env.begin(write=True) as txn:
        key = next(iter(txn.cursor().iternext(values=False)))
        total = txn.stat()["entries"]
        txn.put(key, b"\xff\xff")  # unparsable
    cfg = load_config(None, ["model.name=lenet", "data.source=lmdb", "data.mean_value=[77.75]",
                             f"data.path={json.dumps(str(tmp_path / 'lmdb/train'))}",
                             f"data.test_path={json.dumps(str(test_db))}", "data.max_bad_records=1",
                             f"train.run_dir={json.dumps(str(tmp_path / 'run'))}"])
    t = Trainer(cfg, Communicator.from_env(Topology(), 60, torch.device("cpu")))
    try:
        res = t.test()
    finally:
        t.close()
    assert res["test_samples"] == total - 1 and res["test_bad_records"] == 1
