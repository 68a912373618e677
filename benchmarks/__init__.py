"""dptrain's benchmarks, by topic; run each script from the repository root as ``python -m benchmarks.<topic>.<script>``.

throughput/  dptrain against its peers (DDP + torch.amp, eager and compiled): whole runs, interleaved blocks, operators
scaling/     the scaling model (a package: ``python -m benchmarks.scaling``), the measured scaling study, its
             calibration on gloo runs and its validation against published tables
data/        the input pipeline against torch's DataLoader, photo-like JPEGs, the GPU session's data stage
solvers/     the update rules against torch.optim, the update kernels' bandwidth
gpu/         gpu_session.sh: every GPU check in one device call, and its one-screen summary
results/     one current report per topic and an index (results/README.md)
"""
