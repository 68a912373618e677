"""``dptrain test``: score a model's weights on the test set over every solver, without training.

The solver is built as for training (the same model, precision and test data from the
config), takes the weights with :func:`dptrain.weights.load_weights`, and runs the
Trainer's own test phase once: each rank scores its slice of the test set and the counts
are summed over the ranks, so N solvers report the counts of one. ``solver.test_iter``
limits the batches as in training. Nothing is written to ``train.run_dir`` and it is not
locked: a snapshot can be scored while its run goes on, and a later ``train`` there
finds no earlier run.
"""
from __future__ import annotations

import logging
from typing import Any

from dptrain.config import TrainConfig, add_config_arguments, load_config
from dptrain.errors import ConfigError, RankFailure
from dptrain.run import open_communicator, stop_with_the_launcher
from dptrain.snapshots import check_same_classes
from dptrain.topology import Topology
from dptrain.train import Trainer
from dptrain.weights import check_weights_path, load_weights

log = logging.getLogger(__name__)


def run_scoring(cfg: TrainConfig, weights: str) -> dict[str, Any] | None:
    """Test-set top-1/top-5 of the weights in ``weights``: the record rank 0 prints, None on other ranks."""
    topology = Topology.from_env()
    path = check_weights_path(weights)
    stop_with_the_launcher(topology)  # no snapshot to save: a SIGTERM simply ends the process
    comm = open_communicator(cfg, topology)
    peer_failed = False
    try:
        trainer = Trainer(cfg, comm, compile_model=False)  # the test phase runs eagerly: no compile to pay
        try:
            if trainer.source.num_test == 0:
                raise ConfigError("dptrain test needs a test set, and this config has none: set data.test_path to "
                                  "a test LMDB")
            trained_on = load_weights(trainer.model, trainer.flat, path, model_name=cfg.model.name)
            check_same_classes(trained_on, getattr(trainer.source, "classes", None), f"--weights {str(path)!r}")
            log.info("test phase over %d samples on %d solver(s)", trainer.source.num_test, comm.world_size)
            result = trainer.test()
        finally:
            trainer.close()
    except RankFailure:
        peer_failed = True  # leaving the group would wait for the peer that failed
        raise
    finally:
        comm.close(peer_failed=peer_failed)
    if comm.rank != 0:
        return None
    return {**result, "weights": str(path), "world_size": comm.world_size}


def add_arguments(s: Any) -> None:
    """``dptrain test``'s arguments."""
    s.description = ("Run the test phase alone, on every solver under torchrun (counts are summed over the ranks), "
                     "and print test_top1, test_top5 and test_samples as one JSON line. Writes nothing into "
                     "train.run_dir.")
    add_config_arguments(s)
    s.add_argument("--weights", required=True, metavar="PATH",
                   help="the weights to score: a dptrain snapshot or a torch state_dict")


def main(args: Any) -> dict[str, Any] | None:
    """``dptrain test``: the record rank 0 prints."""
    return run_scoring(load_config(args.config, args.set), args.weights)
