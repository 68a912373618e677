"""dptrain: data-parallel mixed-precision trainer in the spirit of NVCaffe 0.16.

The Python entry beside the ``dptrain`` command: :func:`fit` (``dptrain.fit(config, model=MyNet)``,
``dptrain.run.fit``), loaded on first use so that ``import dptrain`` stays light.
"""
import logging
from typing import Any

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    if name == "fit":
        from dptrain.run import fit

        return fit
    raise AttributeError(f"module 'dptrain' has no attribute {name!r}")
