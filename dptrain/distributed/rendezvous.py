"""The rendezvous endpoint, looked at before anyone waits on it: a port another program holds
(:func:`port_in_use`) is one line instead of torch's traceback.
"""
from __future__ import annotations

from dptrain.errors import SetupError


def port_in_use(e: BaseException) -> bool:
    """Whether torch failed to create a store because its port is taken (``EADDRINUSE``)."""
    return "EADDRINUSE" in str(e)


def port_in_use_error(port: int) -> SetupError:
    """The one line for a store port another program holds on this host."""
    return SetupError(f"rendezvous port {port} is in use on this host (another program listens on it); choose "
                      f"another port with --master-port or MASTER_PORT")
