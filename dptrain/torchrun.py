"""``python -m dptrain.torchrun …``: torchrun, with the solvers' exit code and without its traceback.

torchrun reports a failed worker by raising ``ChildFailedError``: a Python traceback and a
table on stderr, and exit code 1 whatever the workers exited with. dptrain's solvers have
already printed their one-line errors by then, so this wrapper prints one summary line
and exits 2 when any solver exited 2 (a user error), else with the first failure's code.
A SIGTERM/SIGINT to the launcher (which torchrun forwards) ends in one line and 128 + signal.
Everything else (arguments, rendezvous, signals, restarts) is torchrun's own; the launch
scripts and ``dptrain demo`` call it in torchrun's place.
"""
from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

EXIT_USER_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun_main(argv)
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in sorted(e.failures.items())}
        listed = ", ".join(f"rank {r} exit {c}" for r, c in codes.items())
        print(f"dptrain: {len(codes)} solver process(es) failed ({listed}); their errors are above", file=sys.stderr)
        if EXIT_USER_ERROR in codes.values():
            return EXIT_USER_ERROR
        first = next(iter(codes.values()))
        return first if 0 < first < 256 else 1
    except SignalException as e:  # torchrun forwarded it and waited for the solvers, which snapshot on it
        print(f"dptrain: launcher got {e.sigval.name}; the solvers were told to snapshot and stop", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
