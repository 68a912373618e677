"""dptrain: data-parallel mixed-precision trainer in the spirit of NVCaffe 0.16."""
import logging

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())
