"""The torchrun wrapper and its exit protocol: ``python -m dptrain.torchrun`` (the launch scripts and
``dptrain demo`` call it in torchrun's place).

torchrun reports a failed worker with a Python traceback and a table, and exits 1 whatever
the workers exited with. The solvers have printed their one-line errors already, so the
wrapper prints one summary line instead (:func:`failure_summary`) and exits with the
solvers' code: 2 when any solver exited 2 (a user error). Each solver leaves its exit code in
:data:`EXIT_DIR_ENV` (:func:`report_exit`), so a stop signal to the launcher, which torchrun
forwards to the solvers, can tell "every solver snapshotted and stopped" (exit 0) from a kill.
:func:`say` writes a line in one ``write``: the solvers share the launcher's pipe.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptrain.distributed.rendezvous import RDZV_ANSWER_S, check_store_answers, port_in_use, port_in_use_error
from dptrain.errors import EXIT_USER_ERROR, SetupError

STATIC_DEFAULT_PORT = 29500
"""torchrun's ``--master-port`` default for the static rendezvous."""
C10D_DEFAULT_PORT = 29400
"""The port of a c10d ``--rdzv-endpoint`` given without one (torch's c10d backend)."""


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
    The rendezvous store (:func:`_rendezvous_store`) is one line and exit 2 where torch would give
    a traceback (its port taken, for the store this launcher creates) or wait without end (a
    store to join that never answers: :func:`dptrain.distributed.rendezvous.check_store_answers`).
    Everything else (arguments, rendezvous, restarts) is torchrun's own.
    """
    import tempfile

    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as run
    from torch.distributed.run import parse_args

    args = parse_args(argv)
    nproc = getattr(args, "nproc_per_node", None)
    if str(nproc).isdigit() and int(nproc) > 1:
        # torchrun would set the same value and announce it in a four-line warning on every launch
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = _rendezvous_store(args)
    if store is not None and not store.hosted_here:
        try:
            check_store_answers(store.host, store.port, store.answer_s)
        except SetupError as e:
            say(f"dptrain: error: {e}")
            return EXIT_USER_ERROR
    with tempfile.TemporaryDirectory(prefix="dptrain-exit-") as folder:
        os.environ[EXIT_DIR_ENV] = folder
        try:
            run(argv)
        except DistNetworkError as e:  # the agent's own store: only a taken port is the user's to fix
            if store is None or not port_in_use(e):
                raise
            say(f"dptrain: error: {port_in_use_error(store.port)}")
            return EXIT_USER_ERROR
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


@dataclass(frozen=True)
class _Store:
    """Where torchrun's rendezvous store will be, and whether this launcher creates it (static
    rendezvous, node rank 0) or joins it (another node's, or whichever c10d agent binds first)."""

    host: str
    port: int
    hosted_here: bool
    answer_s: float
    """How long the store may take to answer its handshake (:data:`RDZV_ANSWER_S`, or the
    ``read_timeout`` of ``--rdzv-conf``)."""


def _rendezvous_store(args: Any) -> _Store | None:
    """The store torchrun will use for ``args`` (as torch.distributed.run decides it); None where
    torchrun picks a free port itself (``--standalone``, one node without ``--master-port``) or
    the backend is not a TCP store."""
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config, parse_rendezvous_endpoint
    from torch.distributed.run import parse_min_max_nnodes

    conf = _parse_rendezvous_config(args.rdzv_conf)
    raw = conf.get("read_timeout", "")
    answer_s = float(raw) if raw.isdigit() and int(raw) > 0 else RDZV_ANSWER_S  # torch refuses other values itself
    if args.standalone:
        return None
    if args.rdzv_backend == "static":
        if not args.rdzv_endpoint and args.master_port is None and parse_min_max_nnodes(args.nnodes)[1] == 1:
            return None  # torchrun switches to c10d on a free port
        endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port or STATIC_DEFAULT_PORT}"
        host, port = parse_rendezvous_endpoint(endpoint, -1)
        return None if port == -1 else _Store(host, port, args.node_rank == 0, answer_s)  # -1: torch refuses it
    if args.rdzv_backend != "c10d":
        return None
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, C10D_DEFAULT_PORT)
    # whichever agent binds first hosts it; the others, and one that finds the port taken, join it
    return None if port == 0 else _Store(host, port, False, answer_s)


def report_exit(code: int) -> None:
    """Under :func:`torchrun_main`, leave this solver's exit code where the launcher looks."""
    folder, rank = os.environ.get(EXIT_DIR_ENV), os.environ.get("RANK")
    if folder and rank is not None:
        try:
            (Path(folder) / f"rank{rank}.code").write_text(str(code))
        except OSError:
            pass
