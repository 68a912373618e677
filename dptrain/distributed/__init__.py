"""The communication wing: what the solvers say to each other.

``comm`` (the process group, the only module that calls torch.distributed), ``cupy_nccl`` (the
cupy-nccl communicator), ``reducer`` (bucketed, overlapped gradient allreduce), ``planning/``
(bucket plans: the fixed plan, the probe that measures a run, the planner that chooses ``auto``
plans), ``rendezvous`` (the endpoint, looked at before a launcher waits on it), ``control`` (stop and loss flags on the reducer's collective), ``straggler`` (per-rank step
times) and ``flight`` (the collective flight record). ``data/`` never imports from here.
"""
