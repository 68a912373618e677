"""``dptrain export SNAPSHOT OUT.pt``: a snapshot's model as an fp32 state_dict
(:func:`dptrain.weights.export_snapshot`); under torchrun rank 0 alone writes it."""
from __future__ import annotations

from typing import Any

from dptrain.topology import Topology
from dptrain.weights import export_snapshot


def add_arguments(e: Any) -> None:
    """``dptrain export``'s arguments."""
    e.description = ("Write the model of a dptrain snapshot as an fp32 state_dict, loadable with "
                     "torch.load(weights_only=True) into a module of the same architecture; the ImageNet ResNets "
                     "in torchvision's names. Prints one JSON line.")
    e.add_argument("snapshot", metavar="SNAPSHOT", help="a snapshot_iter_<N>.pt")
    e.add_argument("out", metavar="OUT.pt", help="the state_dict file to write (replaced atomically)")


def main(args: Any) -> dict[str, Any] | None:
    """The record of the file written (rank 0; the other ranks have nothing to do)."""
    if Topology.from_env().rank != 0:
        return None
    return export_snapshot(args.snapshot, args.out)
