"""Gradient buckets: ``plan`` (the :class:`BucketPlan`: the deterministic cut of the flat gradients
from the parameters and a cap), and ``reducer.bucket_mb = "auto"``'s tuner: ``probe`` (what its
first iterations measure), ``planner`` (the allreduce cost model, the overlap simulation and the
boundaries it chooses; shared with the scaling model in benchmarks/) and ``tuner`` (the Reducer
observer that drives them and has the Reducer adopt the plan).
"""
