"""``python -m dptrain.torchrun …``: torchrun with the solvers' exit code and one summary line
instead of its traceback (see :func:`dptrain.cli.torchrun_main`). The launch scripts and
``dptrain demo`` call it in torchrun's place.
"""
from __future__ import annotations

import sys

from dptrain.cli import torchrun_main

if __name__ == "__main__":
    sys.exit(torchrun_main())
