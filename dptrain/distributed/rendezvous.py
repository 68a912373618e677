"""The rendezvous endpoint, looked at before anyone waits on it: a port another program holds
(:func:`port_in_use`) and a listener that never answers as a store (:func:`check_store_answers`) are
one line each, instead of torch's traceback or a wait without end.

torch's TCPStore client does not bound its handshake: connected to a program that accepts the
connection and never replies, it waits forever whatever timeout it was given, and torchrun's c10d
rendezvous falls back to exactly that when it cannot host the store on a port that is taken.
"""
from __future__ import annotations

import datetime
import socket
import threading

from dptrain.errors import SetupError

RDZV_ANSWER_S = 5.0
"""Seconds a rendezvous endpoint that accepts a connection has to answer as a store (TCPStore's
handshake) before the launcher gives up. A store answers from its own thread at once, so this bounds
only a program that holds the port and never answers; ``--rdzv-conf read_timeout=N`` (or
``PET_RDZV_CONF``) sets another bound."""


def port_in_use(e: BaseException) -> bool:
    """Whether torch failed to create a store because its port is taken (``EADDRINUSE``)."""
    return "EADDRINUSE" in str(e)


def port_in_use_error(port: int) -> SetupError:
    """The one line for a store port another program holds on this host."""
    return SetupError(f"rendezvous port {port} is in use on this host (another program listens on it); choose "
                      f"another port with --master-port or MASTER_PORT")


def check_store_answers(host: str, port: int, timeout_s: float) -> None:
    """Raise :class:`SetupError` if a program listens on ``host:port`` but does not answer as a
    rendezvous store within ``timeout_s``.

    Nothing listening is no error: torchrun then hosts the store there, or waits for the node
    that will. The handshake runs in a daemon thread, since torch's client cannot be interrupted;
    a thread left waiting on a silent program dies with the process.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError:  # refused, unreachable or unresolvable: torch's own handling applies
        return
    answered = threading.Event()

    def handshake() -> None:
        from torch.distributed import TCPStore

        try:
            TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError, OSError):  # an answer, if not a store's: torch reports it itself
            pass
        finally:
            answered.set()

    threading.Thread(target=handshake, name="dptrain-rendezvous-probe", daemon=True).start()
    if not answered.wait(timeout_s):
        raise SetupError(f"rendezvous endpoint {host}:{port} accepts connections but does not answer as a rendezvous "
                         f"store within {timeout_s:g} s: another program holds that port; stop it, or choose "
                         f"another port (--master-port / MASTER_PORT, or --rdzv-endpoint)")
