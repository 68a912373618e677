"""Command line: ``dptrain {train,test,export,bench,demo,make-lmdb,data-bench}``.

User errors (bad config, missing files, bad records) print one line naming the thing at
fault and exit with code 2, without a traceback. A failure of another rank exits 1 with a
message naming the rank.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dptrain.config import load_config
from dptrain.errors import (
    EXIT_RANK_FAILURE,
    EXIT_USER_ERROR,
    ConfigError,
    RankFailure,
    SetupError,
    UserError,
    first_line,
)
from dptrain.topology import Topology

log = logging.getLogger("dptrain")


def _rank_and_world() -> tuple[int, int]:
    """(rank, world size) for log and error lines; (0, 1) when the environment is unreadable
    (the command itself then reports that as an error)."""
    try:
        t = Topology.from_env()
    except SetupError:
        return 0, 1
    return t.rank, t.world_size


def error_line(e: UserError) -> str:
    """The one line a user error prints: what is wrong, where, and what to do."""
    rank, world = _rank_and_world()
    if isinstance(e, RankFailure):
        return f"dptrain: error (rank {rank}): another rank failed or hung first: {first_line(e)}"
    return f"dptrain: error{f' (rank {rank})' if world > 1 else ''}: {e}"


def say(line: str) -> None:
    """Write one line to stderr in a single write: the solvers share the launcher's pipe and
    often fail at the same moment, and ``print`` writes the text and its newline apart, so
    two ranks' lines could run together (a write of up to PIPE_BUF bytes to a pipe is atomic)."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an in-memory stream (tests capture it so)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        return
    data = (line + "\n").encode(errors="replace")
    while data:
        data = data[os.write(fd, data):]


def setup_logging() -> None:
    rank, world = _rank_and_world()
    fmt = f"%(asctime)s {'rank%d ' % rank if world > 1 else ''}%(levelname).1s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=fmt,
                        datefmt="%H:%M:%S", stream=sys.stderr)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="TOML recipe, e.g. launch/configs/digits.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (TOML literal; bare words are strings); repeatable")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dptrain",
        description="Data-parallel mixed-precision trainer: one solver process per GPU (launch with torchrun), "
                    "FP16/BF16 weights with FP32 masters, bucketed allreduce overlapped with backprop.",
        epilog="Examples:\n  dptrain train --config launch/configs/digits.toml\n"
               "  dptrain test --config launch/configs/digits.toml --weights runs/digits/snapshot_iter_400.pt\n"
               "  dptrain export runs/digits/snapshot_iter_400.pt lenet_digits.pt\n"
               "  torchrun --standalone --nproc-per-node=8 -m dptrain train --config launch/configs/resnet50_imagenet.toml\n"
               "  dptrain bench --config launch/configs/resnet50_synthetic.toml --steps 50",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("train", help="train a model (one process per GPU under torchrun)",
                       description="Train from a TOML recipe. Writes config.toml, metrics.jsonl and "
                                   "snapshot_iter_<N>.pt into train.run_dir. SIGTERM/SIGUSR1/Ctrl-C snapshot and exit 0.")
    _add_config_args(t)
    t.add_argument("--resume", metavar="PATH|auto",
                   help="continue bit-exactly from a snapshot; 'auto' picks the newest one in train.run_dir")
    t.add_argument("--trace", metavar="PATH", help="write a Chrome trace per rank to PATH.rank<r>.json")
    t.add_argument("--weights", metavar="PATH",
                   help="start a new run from the model weights in PATH (a dptrain snapshot, or a torch state_dict "
                        "such as torchvision's ResNet-50); iteration, solver state and RNG start fresh")
    t.add_argument("--weights-skip", action="append", default=[], metavar="GLOB",
                   help="names not to load with --weights, keeping their initial values (e.g. 'fc.*' for a new "
                        "classifier head); repeatable")

    s = sub.add_parser("test", help="score model weights on the test set; rank 0 prints one JSON line",
                       description="Run the test phase alone, on every solver under torchrun (counts are summed "
                                   "over the ranks), and print test_top1, test_top5 and test_samples as one JSON "
                                   "line. Writes nothing into train.run_dir.")
    _add_config_args(s)
    s.add_argument("--weights", required=True, metavar="PATH",
                   help="the weights to score: a dptrain snapshot or a torch state_dict")

    e = sub.add_parser("export", help="write a snapshot's model as an fp32 state_dict (torchvision names for "
                                      "its ResNets)",
                       description="Write the model of a dptrain snapshot as an fp32 state_dict, loadable with "
                                   "torch.load(weights_only=True) into a module of the same architecture; the "
                                   "ImageNet ResNets in torchvision's names. Prints one JSON line.")
    e.add_argument("snapshot", metavar="SNAPSHOT", help="a snapshot_iter_<N>.pt")
    e.add_argument("out", metavar="OUT.pt", help="the state_dict file to write (replaced atomically)")

    b = sub.add_parser("bench", help="measure training throughput; rank 0 prints one JSON line",
                       description="Time training steps after a warm-up and print images/s, step time "
                                   "percentiles and a per-phase breakdown as one JSON line.")
    _add_config_args(b)
    b.add_argument("--synthetic", action="store_true", help="use synthetic data (takes the input pipeline out)")
    b.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    b.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps (default 5)")
    b.add_argument("--phase-steps", type=int, default=5,
                   help="extra steps timed phase by phase with device syncs (default 5)")
    b.add_argument("--trace", metavar="PATH", help="write a Chrome trace per rank of the phase-timed steps")

    d = sub.add_parser("demo", help="train the digits recipe with N solver processes and print test top-1")
    d.add_argument("--config", default="launch/configs/digits.toml", help="recipe (default: %(default)s)")
    d.add_argument("--nproc", type=int, default=0, help="solver processes (default: GPUs, or 2 on CPU)")
    d.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    d.add_argument("--lmdb", default="runs/digits_lmdb", metavar="DIR",
                   help="train from Caffe LMDBs of the digits in DIR/train and DIR/test, written by "
                        "`make-lmdb --digits --encoded DIR` if missing (default: %(default)s)")
    d.add_argument("--builtin", action="store_true", help="train from the in-memory digits instead of the LMDB")

    pl = sub.add_parser("plot", help="draw a run's metrics.jsonl into one PNG",
                        description="Loss, test accuracy, images/s, loss scale and skipped steps, and compute "
                                    "time per rank, from RUN_DIR/metrics.jsonl, into one PNG (needs matplotlib).")
    pl.add_argument("run_dir", metavar="RUN_DIR", help="a train.run_dir")
    pl.add_argument("--out", metavar="PNG", help="output file (default: RUN_DIR/metrics.png)")

    try:
        from dptrain.tools.make_lmdb import add_make_lmdb_args

        add_make_lmdb_args(sub.add_parser("make-lmdb", help="convert images into a Caffe Datum LMDB"))
    except ImportError:  # the LMDB tools are optional at import time only while developing
        pass
    try:
        from dptrain.tools.data_bench import add_data_bench_args

        add_data_bench_args(sub.add_parser("data-bench", help="measure the input pipeline alone"))
    except ImportError:
        pass
    return ap


def cmd_train(args: argparse.Namespace) -> int:
    from dptrain.run import run_training

    run_training(load_config(args.config, args.set), resume=args.resume, trace=args.trace, weights=args.weights,
                 weights_skip=tuple(args.weights_skip))
    return 0


def cmd_test(args: argparse.Namespace) -> int:
    from dptrain.tools.evaluate import run_scoring

    record = run_scoring(load_config(args.config, args.set), args.weights)
    if record is not None:
        print(json.dumps(record), flush=True)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Rank 0 alone writes the file (under torchrun the others have nothing to do)."""
    from dptrain.weights import export_snapshot

    if _rank_and_world()[0] == 0:
        print(json.dumps(export_snapshot(args.snapshot, args.out)), flush=True)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from dptrain.tools.plot import plot_run

    print(json.dumps({"plot": str(plot_run(args.run_dir, args.out))}), flush=True)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from dptrain.tools.bench import run_bench

    overrides = list(args.set)
    if args.synthetic:
        overrides.append('data.source="synthetic"')
    cfg = load_config(args.config, overrides)
    record = run_bench(cfg, steps=args.steps, warmup=args.warmup, phase_steps=args.phase_steps,
                       trace=args.trace)
    if record is not None:
        print(json.dumps(record), flush=True)
    return 0


DEMO_RUN_DIR = "runs/demo"
DEMO_MARK = ".dptrain-demo"
"""Marks a run_dir the demo wrote: only there does it delete an earlier run's outputs."""


def _start_demo_run(run_dir: Path) -> None:
    """The demo starts over each time: it removes the outputs of its own earlier run, and
    refuses a folder holding a run it did not write."""
    from dptrain.checkpoint import RunDir

    d = RunDir(run_dir)
    earlier = d.earlier_run()
    if earlier and not (run_dir / DEMO_MARK).exists():
        d.refuse_earlier_run()
    for name in earlier:
        (run_dir / name).unlink()
    if earlier:
        log.info("removed the previous demo run's %s from %s", ", ".join(earlier), run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / DEMO_MARK).touch()


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the digits recipe under torchrun with ``nproc`` solvers; print wall time and top-1."""
    import torch

    from dptrain.observe.metrics import read_metrics

    sets = [f'train.run_dir="{DEMO_RUN_DIR}"', *args.set]  # its own folder (a --set may move it)
    if not args.builtin:
        lmdb_dir = Path(args.lmdb)
        if not (lmdb_dir / "train").exists():
            from dptrain.tools.make_lmdb import make_digits_lmdb

            counts = make_digits_lmdb(lmdb_dir, encoded=True)
            log.info("wrote the digits as PNG Datum LMDBs in %s: %s", lmdb_dir, counts)
        sets = ['data.source="lmdb"', f'data.path="{lmdb_dir / "train"}"', f'data.test_path="{lmdb_dir / "test"}"',
                *sets]
    cfg = load_config(args.config, sets)
    if args.nproc < 0:
        raise ConfigError(f"--nproc must be >= 1 (0: one per GPU, or 2 on CPU), got {args.nproc}")
    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    run_dir = Path(cfg.train.run_dir)
    _start_demo_run(run_dir)
    cmd = [sys.executable, "-m", "dptrain.torchrun", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "dptrain", "train", "--config", args.config, *[f"--set={s}" for s in sets]]
    env = dict(os.environ)
    if not torch.cuda.is_available():
        # N solvers share the cores; one intra-op thread each avoids oversubscription.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    log.info("running: %s", " ".join(cmd))
    start = time.perf_counter()
    rc = subprocess.call(cmd, env=env)
    wall_s = time.perf_counter() - start
    if rc != 0:
        log.error("training exited with code %d", rc)
        return rc
    tests = [r for r in read_metrics(run_dir / "metrics.jsonl") if "test_top1" in r]
    top1 = tests[-1]["test_top1"]
    print(f"demo: {nproc} solver(s), data {cfg.data.source}, {wall_s:.1f} s wall, final test top-1 "
          f"{100 * top1:.2f}% on {tests[-1]['test_samples']} held-out digits")
    return 0


def failure_summary(codes: dict[int, int]) -> str:
    """The launcher's one line about failed solvers: each rank's exit code or the signal that
    killed it, and where to look. A rank killed by a signal printed nothing (torchrun stops the
    survivors with SIGTERM, then SIGKILL), so only ranks that exited with a code are pointed to."""
    import signal

    def one(rank: int, code: int) -> str:
        if code >= 0:
            return f"rank {rank} exit {code}"
        try:
            return f"rank {rank} killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"rank {rank} killed by signal {-code}"

    listed = ", ".join(one(r, c) for r, c in codes.items())
    spoke = [r for r, c in codes.items() if c > 0]
    where = (f"the error line of rank {', '.join(map(str, spoke))} is above" if spoke else
             "none of them printed an error: they were killed (by torchrun after another failure, or by the system, "
             "e.g. out of memory)")
    return f"dptrain: {len(codes)} solver process(es) failed ({listed}); {where}"


EXIT_DIR_ENV = "DPTRAIN_EXIT_DIR"
"""Set by :func:`torchrun_main` for its solvers: each writes ``rank<R>.code`` there as it exits, so the
launcher knows how they ended when torchrun itself stopped them on a signal."""


def _solver_codes(folder: Path) -> dict[int, int]:
    codes = {}
    for f in folder.glob("rank*.code"):
        try:
            codes[int(f.stem[4:])] = int(f.read_text())
        except ValueError:
            continue
    return codes


def torchrun_main(argv: list[str] | None = None) -> int:
    """``python -m dptrain.torchrun …``: torchrun, exiting with the solvers' code and without its traceback.

    torchrun reports a failed worker by raising ``ChildFailedError`` (a Python traceback and
    a table, exit code 1 whatever the workers exited with). The solvers have already printed
    their one-line errors, so this prints one summary line and exits 2 when any solver exited
    2 (a user error), else with the first failure's code. A stop signal to the launcher, which
    torchrun forwards to the solvers (they snapshot and stop), exits 0 when every solver of
    this node reported exit 0 (each writes its code into :data:`EXIT_DIR_ENV`), as a stop
    signal to one solver does; otherwise one line naming the ranks and 128 + signal.
    Everything else (arguments, rendezvous, restarts) is torchrun's own.
    """
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as run
    from torch.distributed.run import parse_args

    nproc = getattr(parse_args(argv), "nproc_per_node", None)
    with tempfile.TemporaryDirectory(prefix="dptrain-exit-") as folder:
        os.environ[EXIT_DIR_ENV] = folder
        try:
            run(argv)
        except ChildFailedError as e:
            codes = {rank: f.exitcode for rank, f in sorted(e.failures.items())}
            say(failure_summary(codes))
            if EXIT_USER_ERROR in codes.values():
                return EXIT_USER_ERROR
            first = next(iter(codes.values()))
            return first if 0 < first < 256 else 1
        except SignalException as e:
            codes = _solver_codes(Path(folder))
            expected = int(nproc) if str(nproc).isdigit() else len(codes)
            if codes and len(codes) == expected and not any(codes.values()):
                say(f"dptrain: launcher got {e.sigval.name}; all {len(codes)} solver(s) snapshotted and stopped "
                    f"(exit 0)")
                return 0
            listed = ", ".join(f"rank {r} exit {c}" for r, c in sorted(codes.items())) or "none reported"
            say(f"dptrain: launcher got {e.sigval.name}; solvers: {listed} of {expected}; a solver that did not "
                f"report was killed before it could snapshot")
            return EXIT_USER_ERROR if EXIT_USER_ERROR in codes.values() else 128 + int(e.sigval)
        finally:
            os.environ.pop(EXIT_DIR_ENV, None)
    return 0


def _report_exit(code: int) -> None:
    """Under :func:`torchrun_main`, leave this solver's exit code where the launcher looks."""
    folder, rank = os.environ.get(EXIT_DIR_ENV), os.environ.get("RANK")
    if folder and rank is not None:
        try:
            (Path(folder) / f"rank{rank}.code").write_text(str(code))
        except OSError:
            pass


def run() -> None:
    """The ``dptrain`` command and ``python -m dptrain``: exit with :func:`main`'s code.

    After a rank failure the process leaves at once, skipping the interpreter's teardown:
    the process group's destructor waits for the peer that hung or died, so a survivor that
    has printed its line would otherwise sit there until torchrun kills it. Everything worth
    keeping is written by then (snapshots atomically, metrics closed, the run_dir lock goes
    with the process)."""
    code = main(own_process=True)
    _report_exit(code)
    if code == EXIT_RANK_FAILURE:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """Run one ``dptrain`` command; its exit code. ``own_process``: the command owns this process
    (the console script), so it may ignore signals on its way out."""
    setup_logging()
    args = build_parser().parse_args(argv)
    handlers = {"train": cmd_train, "test": cmd_test, "export": cmd_export, "bench": cmd_bench, "demo": cmd_demo,
                "plot": cmd_plot}
    try:
        if args.command in handlers:
            return handlers[args.command](args)
        if args.command == "make-lmdb":
            from dptrain.tools.make_lmdb import run_make_lmdb

            record = run_make_lmdb(args)
        else:
            from dptrain.tools.data_bench import run_data_bench

            record = run_data_bench(args)
        print(json.dumps(record), flush=True)  # the command's result: one JSON line on stdout
        return 0
    except UserError as e:  # the input's fault, or another rank's: one line, no traceback
        if own_process:  # leaving with its own code: a launcher's SIGTERM, sent because another rank
            # failed first, must not turn this into "killed by SIGTERM" and hide the line below
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if e.exit_code == 0:  # a stop before training began: not an error
            logging.getLogger("dptrain").info("%s", e)
        else:
            say(error_line(e))
        return e.exit_code
    except RuntimeError as e:
        from torch.distributed import DistError

        if not isinstance(e, DistError):  # a bug: keep the traceback
            raise
        # a collective outside the wrapped ones failed: a peer went away
        say(error_line(RankFailure(first_line(e))))
        return EXIT_RANK_FAILURE
    except KeyboardInterrupt:
        return 130
