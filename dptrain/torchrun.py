"""``python -m dptrain.torchrun …``: torchrun with the solvers' exit code and one summary line
instead of its traceback (see :mod:`dptrain.launcher`). The launch scripts and
``dptrain demo`` call it in torchrun's place.
"""
from __future__ import annotations

import sys

from dptrain.launcher import torchrun_main

if __name__ == "__main__":
    sys.exit(torchrun_main())
