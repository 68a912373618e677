"""One solver process's ``dptrain train``: the run directory and its lock, the stop handlers,
the process group, the Trainer, and the rank-naming error line when a peer fails
(:func:`run_training`); ``dptrain test`` shares the process setup."""
from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptrain.assemble import pick_device
from dptrain.config import TrainConfig, add_config_arguments, apply_overrides, config_to_dict, from_dict, load_config
from dptrain.distributed.comm import Communicator, agree_to_start, join_store
from dptrain.distributed.control import StopFlag
from dptrain.errors import ConfigError, RankFailure, SetupError, UserError, first_line
from dptrain.hostmem import apply_host_malloc
from dptrain.models import is_import_path
from dptrain.models import register as register_model
from dptrain.models import resolve as resolve_model
from dptrain.observe.trace import Tracer
from dptrain.snapshots import RunDir, resolve_resume
from dptrain.topology import Topology
from dptrain.train import Trainer
from dptrain.weights import check_weights_path, load_weights

log = logging.getLogger(__name__)


def stop_with_the_launcher(topology: Topology) -> None:
    """Under torchrun, ask Linux for a SIGTERM when the launcher dies (``PR_SET_PDEATHSIG``).

    torchrun stops its solvers when it is signalled, but a launcher killed with SIGKILL (an
    OOM kill, a lost node agent) leaves them training as orphans. With this, each solver
    snapshots at the next agreed iteration and exits, as on any SIGTERM.
    """
    if not sys.platform.startswith("linux") or not topology.under_launcher:
        return
    import ctypes
    import signal

    launcher = os.getppid()
    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) != 0:
        log.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return
    if os.getppid() != launcher:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def open_communicator(cfg: TrainConfig, topology: Topology, store: Any = None) -> Communicator:
    """This solver's device (its CPU thread count and host allocator settings), and the process group
    over every solver (through ``store``, :func:`dptrain.distributed.comm.join_store`, when already open)."""
    device = pick_device(cfg.train.device, topology.local_rank)
    if device.type == "cpu":
        torch.set_num_threads(cfg.train.threads or topology.cores_per_process)
    apply_host_malloc(cfg.train.host_malloc, device.type, topology.rank)
    return Communicator.from_env(topology, cfg.reducer.timeout_s, device, cfg.train.process_group_timeout_s,
                                 store=store)


def _train(cfg: TrainConfig, comm: Communicator, stop: StopFlag, *, resume: str | None, resume_path: Path | None,
           trace: str | None, weights_path: Path | None, weights_skip: tuple[str, ...]) -> dict[str, Any]:
    tracer = Tracer(comm.rank) if trace else None
    trainer = Trainer(cfg, comm, tracer=tracer, stop=stop)
    try:
        if resume_path is not None:
            trainer.resume(resume_path)
        elif resume:
            trainer.snapshots.start_over()
        elif weights_path is not None:
            load_weights(trainer.model, trainer.flat, weights_path, model_name=cfg.model.name, skip=weights_skip)
        return trainer.fit()
    finally:
        trainer.close()
        if tracer is not None and trace:
            log.info("trace written to %s", tracer.save(trace))


def run_training(cfg: TrainConfig, *, resume: str | None = None, trace: str | None = None,
                 weights: str | None = None, weights_skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``dptrain train``: check and lock the run directory, build this solver, train, test.

    Order matters for a user on a cluster: the run directory, the lock, ``--resume PATH`` and
    ``--weights PATH`` are checked before anything slow is built, and every rank learns every
    rank's verdict through the rendezvous store before any joins the process group
    (:func:`dptrain.distributed.comm.agree_to_start`), so a refused run exits 2 on every rank at once.
    The stop handlers are installed first: a SIGTERM while the ranks wait for each other ends the
    run (exit 0, nothing to snapshot yet), a later one in a snapshot at the first iteration.
    ``--weights`` starts a fresh run (iteration 0, new optimizer state, the config's seed) from a
    model's weights, as ``caffe train -weights`` does.
    """
    if weights and resume:
        raise ConfigError("--weights starts a new run from a model's weights and --resume continues a run with its "
                          "own: pass one of them (an interrupted fine-tune continues with --resume alone)")
    if weights_skip and not weights:
        raise ConfigError("--weights-skip names weights not to load, so it needs --weights PATH")
    topology = Topology.from_env()
    if is_import_path(cfg.model.name):
        resolve_model(cfg.model.name)  # a model path that does not import stops every rank before anything is written
    run_dir = RunDir(cfg.train.run_dir)
    run_dir.check_usable(writer=topology.rank == 0)
    stop = StopFlag()
    try:
        with stop.installed():
            stop_with_the_launcher(topology)
            store = join_store(topology, cfg.train.process_group_timeout_s)
            refusal = None
            try:
                if topology.rank == 0:  # rank 0 writes config.toml, metrics.jsonl and the snapshots
                    run_dir.lock()
                resume_path = resolve_resume(resume, run_dir.path) if resume else None
                weights_path = check_weights_path(weights) if weights else None
                if not resume:
                    run_dir.refuse_earlier_run()
            except UserError as e:
                refusal = e
            # every rank learns every verdict (rank 0's lock above all) before any waits on another
            # in the process group's rendezvous, where it would not even serve a SIGTERM
            agree_to_start(store, topology, None if refusal is None else first_line(refusal),
                           stopped=lambda: stop.requested, timeout_s=cfg.train.process_group_timeout_s)
            if refusal is not None:
                raise refusal
            comm = open_communicator(cfg, topology, store)
            peer_failed = False
            try:
                comm.attach_progress_store()
                result = _train(cfg, comm, stop, resume=resume, resume_path=resume_path, trace=trace,
                                weights_path=weights_path, weights_skip=weights_skip)
            except RankFailure as e:  # say which collective, and who never arrived, from the flight record
                peer_failed = True
                raise RankFailure(comm.flight.explain(run_dir.path, first_line(e))) from e
            finally:
                comm.close(peer_failed=peer_failed)
    except BaseException:
        run_dir.undo_start()  # a run that failed before writing anything leaves no run_dir behind
        raise
    finally:
        run_dir.unlock()
    if "test_top1" in result and not result.get("stopped_by_signal"):
        log.info("final test top-1 %.4f top-5 %.4f", result["test_top1"], result["test_top5"])
    return result


def add_arguments(t: Any) -> None:
    """``dptrain train``'s arguments."""
    t.description = ("Train from a TOML recipe. Writes config.toml, metrics.jsonl and snapshot_iter_<N>.pt into "
                     "train.run_dir. SIGTERM/SIGUSR1/Ctrl-C snapshot and exit 0.")
    add_config_arguments(t)
    t.add_argument("--resume", metavar="PATH|auto",
                   help="continue bit-exactly from a snapshot; 'auto' picks the newest one in train.run_dir")
    t.add_argument("--trace", metavar="PATH", help="write a Chrome trace per rank to PATH.rank<r>.json")
    t.add_argument("--weights", metavar="PATH",
                   help="start a new run from the model weights in PATH (a dptrain snapshot, or a torch state_dict "
                        "such as torchvision's ResNet-50); iteration, solver state and RNG start fresh")
    t.add_argument("--weights-skip", action="append", default=[], metavar="GLOB",
                   help="names not to load with --weights, keeping their initial values (e.g. 'fc.*' for a new "
                        "classifier head); repeatable")


def main(args: Any) -> None:
    """``dptrain train``: train this solver (:func:`run_training`)."""
    run_training(load_config(args.config, args.set), resume=args.resume, trace=args.trace, weights=args.weights,
                 weights_skip=tuple(args.weights_skip))


def setup_logging() -> None:
    """Log lines on stderr, with the rank where there are several: INFO from rank 0, WARNING from the others."""
    try:
        t = Topology.from_env()
        rank, world = t.rank, t.world_size
    except SetupError:  # the command itself reports an unreadable environment
        rank, world = 0, 1
    fmt = f"%(asctime)s {'rank%d ' % rank if world > 1 else ''}%(levelname).1s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=fmt,
                        datefmt="%H:%M:%S", stream=sys.stderr)


def fit(config: str | Path | TrainConfig | None = None, *, model: Callable[..., nn.Module] | None = None,
        overrides: Sequence[str] = (), resume: str | None = None, weights: str | None = None,
        weights_skip: Sequence[str] = ()) -> dict[str, Any]:
    """Train from a script or a notebook, as ``dptrain train`` does: ``dptrain.fit("recipe.toml",
    model=MyNet, overrides=["solver.max_iter=100"])``; the last metrics (rank 0's test top-1...).

    ``config``: a TOML file, a :class:`TrainConfig`, or None (the defaults). ``model``: a callable
    that returns an ``nn.Module`` (a class or a factory), called with ``model.args`` and
    ``num_classes`` as for ``model.name = "package.module:callable"``; the run records that import
    path, so ``--resume``, ``dptrain test`` and ``export`` find the model where it can be imported
    (a script's own ``__main__`` callable only from that script: resume with ``fit(..., resume=...)``).
    Under ``torchrun script.py`` every process calls it and becomes one solver, exactly as the
    CLI's are; user errors raise :class:`dptrain.errors.UserError` (``dptrain train`` turns them into
    one line and exit 2).
    """
    extra = list(overrides)
    if model is not None:
        extra.append(f"model.name={json.dumps(register_model(model))}")
    if isinstance(config, TrainConfig):
        cfg = from_dict(TrainConfig, apply_overrides(config_to_dict(config), extra), "")
    else:
        cfg = load_config(config, extra)
    if not logging.getLogger().handlers:
        setup_logging()
    return run_training(cfg, resume=resume, weights=weights, weights_skip=tuple(weights_skip))
