"""The solver loop: one :class:`Trainer` per process, built from the config's sections.

One iteration:

    release the .grad views                 backward hands its gradients over (dptrain.flat)
    for each of iter_size micro-batches:   data -> forward -> scaled loss -> backward
                                            (the reducer sums the control flags, stop and non-finite
                                             loss, during the last backward, and allreduces buckets)
    restore the .grad views
    reducer.wait()                          the only point where compute waits on communication
    optimizer.step()                        unscale, skip on overflow, update masters, write weights

Nothing in the step reads a device value on the host: the control flags are read back
``ControlChannel.lag`` iterations later (``dptrain.distributed.control``), so a stop signal or a
diverged loss is acted on at the same iteration on every rank. The host syncs only when
it logs, tests or snapshots.

The wing:

* ``trainer``: the Trainer, which owns the parts and runs steps, displays, tests and snapshots;
* ``stops``: the one stop protocol (a stop request agreed over the ranks, in every phase) and
  the health watch (non-finite losses, divergence) that ends a diverged run;
* ``scoring``: the test phase's top-1/top-5 counts;
* ``snapshots``: writing, resuming and starting over;
* ``display``: the running loss and timing between display lines.
"""
from dptrain.train.trainer import Trainer

__all__ = ["Trainer"]
