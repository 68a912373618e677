"""Bucket plans: ``plan`` (the deterministic plan from the parameters and a cap), ``probe`` (what
the first iterations of ``reducer.bucket_mb = "auto"`` measure) and ``planner`` (the allreduce cost
model, overlap simulation and the boundaries it chooses; shared with benchmarks/scaling_model.py).
"""
