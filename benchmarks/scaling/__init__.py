"""The scaling model: predicted step time and scaling efficiency of dptrain on N GPUs and nodes.

Inputs: one solver's profile (forward, backward and update time; per bucket its bytes and
the time its last gradient is ready, relative to backward start), taken from a
``--trace`` (:func:`profile_from_trace`) or a JSON profile, and an alpha-beta model of the
allreduce on a machine from :data:`MACHINES`.

Allreduce of S bytes on n ranks, alpha = per-step latency, B = bus bandwidth in the
nccl-tests sense (busbw = algbw * 2(n-1)/n, nvidia/nccl-tests doc/PERFORMANCE.md):
- ring:  2(n-1) alpha + 2(n-1)/n * S/B   (reduce-scatter + allgather; Patarasuk & Yuan 2009)
- tree:  2 ceil(log2 n) alpha + 2 S/B    (reduce up a pipelined binary tree, broadcast down)
Multi-node (N nodes of g GPUs, n = N g), following NCCL's own tuning model
(src/graph/tuning.cc, ncclTopoTuneModel): ring latency counts 2N network hops and the rest
NVLink hops, bandwidth min(NVLink busbw, node network bandwidth); tree latency
2((g-1) alpha_nvlink + ceil(log2 N) alpha_net), bandwidth term 2 S/B (NCCL's tree algbw is
busbw/2); hierarchical = NVLink reduce-scatter, per-rail ring allreduce of S/g across nodes,
NVLink allgather. ``best`` takes the fastest per message, as NCCL's tuner does.

Overlap: buckets launch in plan order when ready and run one at a time on one channel;
exposed comm = max(0, end of the last allreduce - end of backward) (``dptrain.distributed.buckets.planner``,
the cost model the Reducer's ``bucket_mb = "auto"`` plans with). The costs a real step pays
beyond that (:class:`Terms`, each documented with its source in the profile files):

    compute = forward + backward + update, at least host_ms_per_step (launch + host loop)
    T_N = max(compute + contention * overlapped comm + exposed + stats + jitter_cv * compute * E[max of N normals],
              N_node * batch / input_images_per_s_per_node, batch / input_images_per_s_per_process)

and an allreduce progresses at overlap_rate of its speed while backward runs (1 on GPUs).

contention: NCCL kernels take SMs and HBM from the backward they overlap; stats: the running
statistics' allreduce where it is not overlapped; jitter: the slowest of N ranks sets the pace;
the input pipeline's ceilings, per node and per solver process. Weak-scaling efficiency = T_1 / T_N.

The input ceilings are stated, never fitted to a scaling result: an input path
(``benchmarks/scaling/profiles/inputs.toml``, :class:`InputPath`) gives a cited rate per node, or what
``dptrain data-bench`` measures (CPU ms per image, one process's ceiling), which
:func:`input_rates` turns into a node's rate with the machine's CPU cores. A path with no rate is
not modelled, and a prediction made with it says so (compute and communication only).

Sharded runs (``--shard optimizer``: ``reducer.shard = "optimizer"``, ZeRO-1; module ``shard``): each bucket,
padded to a multiple of N x 64 elements, is reduce-scattered in backward (a ring's n - 1 steps,
(n-1)/n of the bucket on the wire: half the allreduce's bytes and transfer time), the update runs on 1/N
of the parameters (memory-bound: its time falls by N), one small allreduce of partial norms sits before
it, and the updated weights are all-gathered first layers first against the next forward, each bucket
needed before the first layer holding its parameters runs. ``memory`` gives the memory per GPU (16-bit
weights and grads whole, fp32 masters and optimizer state divided by N when sharded).

Machines (``benchmarks/scaling/profiles/machines/*.toml``: GPUs per node, HBM, NVLink/NVSwitch, NIC,
contention) and workloads (``benchmarks/scaling/profiles/workloads/*.toml``: the model, its update bytes per parameter,
one-GPU rate, batch, gradient bytes, jitter, input path per machine; ResNet-50 and ViT-L/16) are data files to copy and edit for your
cluster. ``benchmarks/scaling/scaling_validate.py`` checks the model against published tables.

Modules, by role: ``profile`` (one solver's step: trace, JSON, re-bucketing, step time in the batch),
``machine`` (machines and input paths from ``profiles/``), ``allreduce`` (collective costs and the
alpha-beta fit), ``simulation`` (the overlap, the terms, efficiencies, bucket plans), ``shard`` (the
sharded step against the unsharded one per GPU count), ``memory`` (memory per GPU), ``workload`` (the
workload file and the reference profiles from a model's layer list), ``report`` (the markdown tables),
``cli`` (the command). Beside them, scripts that measure or check it: ``scaling`` (the measured scaling study),
``scaling_calibrate`` (the model on measured gloo runs), ``scaling_validate`` (against published
tables) and ``collective_bench`` (gloo allreduce alone).

    python -m benchmarks.scaling                       # DGX H100, reference ResNet-50 profile
    python -m benchmarks.scaling --profile runs/t.rank0.json --profile-batch 32 --machines dgx-h100,dgx-a100
    python -m benchmarks.scaling --workload resnet50,vit_l --shard optimizer --json shard.json
    python -m benchmarks.scaling --calibrate           # gloo alpha/beta on this machine, 2 processes
    python -m benchmarks.scaling --calibrate --measured-bench bench2.jsonl --bench-profile t.rank0.json
"""
from __future__ import annotations

from benchmarks.scaling.allreduce import (
    Algorithm,
    Cost,
    allreduce_cost,
    comm_fn,
    fit_alpha_beta,
    ring_allreduce,
    ring_scatter_gather,
    scatter_gather_cost,
    scatter_gather_fn,
    tree_allreduce,
    wire_bytes,
)
from benchmarks.scaling.cli import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB, main
from benchmarks.scaling.machine import (
    GB,
    INPUTS,
    MACHINES,
    PROFILES,
    InputPath,
    Link,
    Machine,
    input_path_from_data_bench,
    input_rates,
    load_inputs,
    load_machine,
)
from benchmarks.scaling.memory import MemoryPerGpu, memory_per_gpu, padded_numel
from benchmarks.scaling.profile import (
    MIB,
    BatchCost,
    BucketTiming,
    Profile,
    batch_points,
    fit_batch_cost,
    json_lines,
    last_json_line,
    load_profile,
    profile_from_json,
    profile_from_trace,
    profile_to_json,
    rebucket,
    recut,
    scale_compute,
    scale_to_batch,
)
from benchmarks.scaling.report import (
    EFFICIENCY_FLOOR,
    TermsFn,
    breakdown_lines,
    calibration_report,
    emit_report,
    explain,
    plain_terms,
    report_predictions,
    strong_rows,
    weak_rows,
)
from benchmarks.scaling.shard import ShardedStep, compare_rows, simulate_sharded_step
from benchmarks.scaling.simulation import (
    StepPrediction,
    Terms,
    auto_plan,
    comm_step_ms,
    input_ms,
    one_solver_ms,
    simulate_step,
    strong_efficiency,
    sweep_bucket_sizes,
    weak_efficiency,
)
from benchmarks.scaling.workload import (
    MODELS,
    Workload,
    load_workload,
    reference_profile,
    resnet50_params,
    vit_l16_params,
)

__all__ = [
    "Algorithm",
    "BatchCost",
    "BucketTiming",
    "Cost",
    "DEFAULT_BUCKET_MB",
    "DEFAULT_FIRST_BUCKET_MB",
    "EFFICIENCY_FLOOR",
    "GB",
    "INPUTS",
    "InputPath",
    "Link",
    "MACHINES",
    "MIB",
    "MODELS",
    "Machine",
    "MemoryPerGpu",
    "PROFILES",
    "Profile",
    "ShardedStep",
    "StepPrediction",
    "Terms",
    "TermsFn",
    "Workload",
    "allreduce_cost",
    "auto_plan",
    "batch_points",
    "breakdown_lines",
    "calibration_report",
    "comm_fn",
    "comm_step_ms",
    "compare_rows",
    "emit_report",
    "explain",
    "fit_alpha_beta",
    "fit_batch_cost",
    "input_ms",
    "input_path_from_data_bench",
    "input_rates",
    "json_lines",
    "last_json_line",
    "load_inputs",
    "load_machine",
    "load_profile",
    "load_workload",
    "main",
    "memory_per_gpu",
    "one_solver_ms",
    "padded_numel",
    "plain_terms",
    "profile_from_json",
    "profile_from_trace",
    "profile_to_json",
    "rebucket",
    "recut",
    "reference_profile",
    "report_predictions",
    "resnet50_params",
    "ring_allreduce",
    "ring_scatter_gather",
    "scale_compute",
    "scale_to_batch",
    "scatter_gather_cost",
    "scatter_gather_fn",
    "simulate_sharded_step",
    "simulate_step",
    "strong_efficiency",
    "strong_rows",
    "sweep_bucket_sizes",
    "tree_allreduce",
    "vit_l16_params",
    "weak_efficiency",
    "weak_rows",
    "wire_bytes",
]
