"""Command line: ``dptrain COMMAND``, one table of commands (:data:`COMMANDS`) and the exit policy.

Each command lives in its own module, which gives its arguments (``add_arguments(parser)``)
and runs it (``main(args)``, returning a record that is printed as one JSON line on stdout,
an exit code, or None). User errors (bad config, missing files, bad records) print one line
naming the thing at fault and exit with code 2, without a traceback; a failure of another
rank exits 1 with a line naming the rank; a bug keeps its traceback. The torchrun wrapper
and its exit protocol are :mod:`dptrain.launcher`'s.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass

from dptrain.errors import EXIT_RANK_FAILURE, RankFailure, SetupError, UserError, first_line
from dptrain.launcher import report_exit, say
from dptrain.run import setup_logging
from dptrain.topology import Topology


@dataclass(frozen=True)
class Command:
    """One ``dptrain`` command: its name, the module with its ``add_arguments`` and ``main``, its help line."""

    name: str
    module: str
    help: str


COMMANDS = (
    Command("train", "dptrain.run", "train a model (one process per GPU under torchrun)"),
    Command("test", "dptrain.tools.evaluate", "score model weights on the test set; rank 0 prints one JSON line"),
    Command("export", "dptrain.tools.export", "write a snapshot's model as an fp32 state_dict (torchvision names "
                                              "for its ResNets)"),
    Command("bench", "dptrain.tools.bench", "measure training throughput; rank 0 prints one JSON line"),
    Command("demo", "dptrain.tools.demo", "train the digits recipe with N solver processes and print test top-1"),
    Command("plot", "dptrain.tools.plot", "draw a run's metrics.jsonl into one PNG"),
    Command("make-lmdb", "dptrain.tools.make_lmdb", "convert images into a Caffe Datum LMDB"),
    Command("data-bench", "dptrain.tools.data_bench", "measure the input pipeline alone"),
)


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
    if world == 1:
        return f"dptrain: error: {e}"
    return f"dptrain: error (rank {rank}): {str(e).removeprefix(f'rank {rank}: ')}"  # the rank named once


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
    for c in COMMANDS:
        importlib.import_module(c.module).add_arguments(sub.add_parser(c.name, help=c.help))
    return ap


def run() -> None:
    """The ``dptrain`` command and ``python -m dptrain``: exit with :func:`main`'s code.

    After a rank failure the process leaves at once, skipping the interpreter's teardown:
    the process group's destructor waits for the peer that hung or died, so a survivor that
    has printed its line would otherwise sit there until torchrun kills it. Everything worth
    keeping is written by then (snapshots atomically, metrics closed, the run_dir lock goes
    with the process)."""
    code = main(own_process=True)
    report_exit(code)
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
    command = next(c for c in COMMANDS if c.name == args.command)
    try:
        result = importlib.import_module(command.module).main(args)
        if isinstance(result, dict):
            print(json.dumps(result), flush=True)  # the command's result: one JSON line on stdout
        return result if isinstance(result, int) else 0
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
