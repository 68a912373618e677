"""Trainer: builds the parts from their config sections and runs the solver loop.

One Trainer per solver process. The iteration is:

    for each of iter_size micro-batches:   data -> forward -> scaled loss -> backward
                                            (the reducer allreduces buckets during the last backward)
    reducer.wait()                          the only point where compute waits on communication
    solver.step()                           unscale, skip on overflow, update masters, write weights

Nothing in the step reads a device value on the host; the host syncs only when it logs,
tests, snapshots or polls for a stop request.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.comm import Communicator
from dptrain.config import TrainConfig, config_to_dict, dump_toml
from dptrain.data import build_source
from dptrain.data.base import DROPPED_LABEL, DeviceFeeder
from dptrain.data.sampling import ShardPlan, batches_per_epoch
from dptrain.errors import ConfigError, RunDirError, SetupError, SnapshotError
from dptrain.flat import FlatParams
from dptrain.metrics import MetricsWriter
from dptrain.models import build_model, check_input
from dptrain.precision import DTYPES, LossScaler, apply_precision, warn_if_slow_on_cpu
from dptrain.reducer import Reducer
from dptrain.snapshot import load_snapshot, remove_stale_temporaries, save_snapshot, snapshot_path
from dptrain.solver import MasterSGD
from dptrain.trace import NullTracer, Tracer, now_us

log = logging.getLogger(__name__)

STOP_POLL_ITERS = 10
"""With several solvers, a SIGTERM/SIGUSR1 is agreed on by a tiny allreduce every this many
iterations (a host sync), so every rank snapshots and stops at the same iteration."""


@dataclass(frozen=True)
class RunPlan:
    """Values derived once from the config and the topology; logged at startup."""

    rank: int
    world_size: int
    device: str
    batch_size: int
    iter_size: int
    global_batch: int
    micro_steps_per_epoch: int
    storage: str
    loss_scale: str

    def describe(self) -> str:
        return (
            f"global batch {self.global_batch} = batch_size {self.batch_size} x world_size "
            f"{self.world_size} x iter_size {self.iter_size}; {self.micro_steps_per_epoch // self.iter_size} "
            f"iterations per epoch; storage {self.storage}, loss scale {self.loss_scale}, device {self.device}"
        )


def pick_device(requested: str, local_rank: int) -> torch.device:
    """CUDA device ``local_rank`` when asked for or available ("auto"), else the CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SetupError("train.device = \"cuda\" but no CUDA device is visible; use \"auto\" or \"cpu\"")
    if local_rank >= torch.cuda.device_count():
        raise SetupError(
            f"LOCAL_RANK {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
            "start at most one process per GPU"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def build_model_and_params(cfg: TrainConfig, comm: Communicator, device: torch.device,
                           in_channels: int = 3) -> tuple[nn.Module, FlatParams]:
    """The model in its storage dtype with flat buffers, initialised identically on every rank.

    Rank 0's fp32 weights are broadcast *before* the cast, so the fp32 masters start from
    the exact initial weights rather than from their fp16 rounding.
    """
    torch.manual_seed(cfg.train.seed)
    m = cfg.model
    model = build_model(m.name, num_classes=m.num_classes, width=m.width, in_channels=in_channels,
                        channels_last=m.channels_last).to(device)
    comm.broadcast_module(model)
    fp32_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_precision(model, cfg.precision)
    momentum_dtype = DTYPES[cfg.precision.momentum_dtype]
    flat = FlatParams(model, momentum_dtype=momentum_dtype)
    flat.load_master_state(fp32_weights)
    return model, flat


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    """The model's normalisation running statistics (``running_mean`` / ``running_var`` buffers)."""
    return [b for name, b in model.named_buffers()
            if name.rsplit(".", 1)[-1] in ("running_mean", "running_var") and b.is_floating_point()]


def _check_run_dir(run_dir: Path) -> None:
    """train.run_dir must be a folder or creatable as one (every rank checks; rank 0 creates it)."""
    for p in (run_dir, *run_dir.parents):
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"train.run_dir {str(run_dir)!r}: {str(p)!r} is a file; choose another run_dir")
            return


class PhaseTimer:
    """Times phases of a step. Inactive (free) unless tracing or benchmarking; when active
    it synchronises the device at phase boundaries so the times are device times."""

    def __init__(self, device: torch.device, tracer: Tracer, active: bool) -> None:
        self.device, self.tracer, self.active = device, tracer, active
        self.totals_ms: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.active:
            yield
            return
        self._sync()
        start = now_us()
        yield
        self._sync()
        end = now_us()
        self.totals_ms[name] += (end - start) / 1000.0
        self.tracer.complete(name, start, end)


class _StopFlag:
    """Set by SIGTERM, SIGUSR1 or SIGINT (Ctrl-C); the trainer snapshots at the next agreed
    iteration boundary and exits 0, as Caffe does on SIGINT. A second Ctrl-C stops at once,
    without a snapshot."""

    def __init__(self) -> None:
        self.requested = False
        self.signum = 0

    def __call__(self, signum: int, frame: object) -> None:
        if self.signum == signal.SIGINT and signum in (signal.SIGINT, signal.SIGTERM):
            raise KeyboardInterrupt  # a second Ctrl-C; torchrun turns its own second one into a SIGTERM
        if signum == signal.SIGINT:
            log.warning("Ctrl-C: snapshot at the next agreed iteration and stop; press it again to stop at once")
        self.requested = True
        self.signum = self.signum or signum

    @contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is threading.main_thread():
            old = {s: signal.signal(s, self) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)
        else:
            yield


class Trainer:
    """One solver: model, flat buffers, scaler, reducer, solver and data, from the config."""

    def __init__(self, cfg: TrainConfig, comm: Communicator, *, tracer: Tracer | None = None,
                 time_phases: bool = False) -> None:
        self.cfg, self.comm = cfg, comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.device = comm.device
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
        elif self.rank == 0:
            warn_if_slow_on_cpu(cfg.precision.storage, self.device)
        self.tracer = tracer or NullTracer(self.rank)
        self.run_dir = Path(cfg.train.run_dir)
        _check_run_dir(self.run_dir)
        self.source = build_source(cfg.data, num_classes=cfg.model.num_classes, seed=cfg.train.seed, device=self.device,
                                   rank=self.rank, cores=comm.topology.cores_per_process)
        self.model, self.flat = build_model_and_params(cfg, comm, self.device, in_channels=self.source.sample_shape[2])
        self._input_ok = False
        ls_mode = cfg.precision.resolved_loss_scale_mode()
        self.scaler = LossScaler(cfg.precision.loss_scale, ls_mode, self.device)
        self.reducer = Reducer(self.flat, cfg.reducer, comm, self.tracer, running_stats(self.model))
        self.solver = MasterSGD(self.flat, cfg.solver, self.scaler, self.reducer.grad_divisor)
        self.shard = ShardPlan(self.rank, self.world_size, cfg.data.batch_size, cfg.train.seed,
                               cfg.data.shuffle == "epoch")
        self.plan = RunPlan(
            rank=self.rank, world_size=self.world_size, device=str(self.device),
            batch_size=cfg.data.batch_size, iter_size=cfg.solver.iter_size,
            global_batch=cfg.data.batch_size * self.world_size * cfg.solver.iter_size,
            micro_steps_per_epoch=batches_per_epoch(self.source.num_train, self.shard.global_batch),
            storage=cfg.precision.storage, loss_scale=ls_mode,
        )
        self.dtype = DTYPES[cfg.precision.storage]
        self.iteration = 0
        self.lr = 0.0
        self.phases = PhaseTimer(self.device, self.tracer, time_phases or self.tracer.enabled)
        self._feeder: DeviceFeeder | None = None
        self._loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self._loss_from = 0
        """Iteration since which _loss_sum accumulates (the last display); saved in snapshots."""
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl" if self.rank == 0 else None)

    # ------------------------------------------------------------------ data

    def _feeder_for(self, start_micro_step: int) -> DeviceFeeder:
        stream = self.source.train_batches(self.shard, start_micro_step)
        return DeviceFeeder(stream, device=self.device, dtype=self.dtype, mean=self.source.mean,
                            scale=self.source.scale, channels_last=self.cfg.model.channels_last,
                            mean_image=self.source.mean_image)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._feeder is None:
            self._feeder = self._feeder_for(self.iteration * self.plan.iter_size)
        with self.phases("data_wait"):
            return next(self._feeder)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output. If the first call fails, a sample shape the model cannot take
        becomes a ConfigError naming the data settings; the diagnosis (a forward on the meta
        device, whose first use costs ~2 s of imports) runs only then, not at every startup."""
        if self._input_ok:
            return self.model(x)
        try:
            out = self.model(x)
        except RuntimeError as e:
            m = self.cfg.model
            why = check_input(m.name, num_classes=m.num_classes, width=m.width, sample_shape=self.source.sample_shape)
            if why is None:
                raise
            h, w, c = self.source.sample_shape
            raise ConfigError(f"model.name {m.name!r} cannot take the data's {h}x{w} samples with {c} channel(s) "
                              f"({why}); set data.crop_size / data.resize (or data.image_size) to a size it takes") from e
        self._input_ok = True
        return out

    # ------------------------------------------------------------------ step

    def train_step(self) -> None:
        """One iteration: iter_size micro-batches, the reduce, and the fused update."""
        self.model.train()
        n = self.plan.iter_size
        for micro in range(n):
            x, y = self._next_batch()
            self.reducer.begin(sync=micro == n - 1)
            with self.phases("forward"):
                loss = F.cross_entropy(self._forward(x).float(), y) / n
            if micro == n - 1 and self._feeder is not None:
                self._feeder.prefetch()  # next batch's H2D copy overlaps this backward
            with self.phases("backward"):
                self.scaler.scale_loss(loss).backward()
            self._loss_sum += loss.detach()
        with self.phases("exposed_comm"):
            self.reducer.wait()
        with self.phases("update"):
            self.lr = self.solver.step(self.iteration)
        self.iteration += 1

    # ------------------------------------------------------------------ test

    @torch.no_grad()
    def test(self) -> dict[str, float]:
        """Top-1/top-5 over the whole test set; every sample counts once across ranks."""
        self.model.eval()
        counts = torch.zeros(4, dtype=torch.float64, device=self.device)  # correct1, correct5, n, bad records
        stream = self.source.test_batches(self.rank, self.world_size, self.cfg.data.test_batch_size)
        feeder = DeviceFeeder(stream, device=self.device, dtype=self.dtype, mean=self.source.mean,
                              scale=self.source.scale, channels_last=self.cfg.model.channels_last,
                              mean_image=self.source.mean_image)
        try:
            for i, (x, y) in enumerate(feeder):
                if self.cfg.solver.test_iter and i >= self.cfg.solver.test_iter:
                    break
                top5 = self._forward(x).float().topk(min(5, self.cfg.model.num_classes), dim=1).indices
                kept = y != DROPPED_LABEL  # a bad record skipped under data.max_bad_records scores nothing
                hit = (top5 == y[:, None]) & kept[:, None]
                counts[0] += hit[:, 0].sum()
                counts[1] += hit.any(dim=1).sum()
                counts[2] += kept.sum()
            counts[3] += feeder.last_info.get("bad_records", 0)
        finally:
            feeder.close()
        self.comm.allreduce_sum_(counts)
        c1, c5, total, bad = counts.tolist()
        self.model.train()
        res = {"test_top1": c1 / max(total, 1), "test_top5": c5 / max(total, 1), "test_samples": int(total)}
        return {**res, "test_bad_records": int(bad)} if bad else res

    # ------------------------------------------------------------------ snapshots

    def state_dict(self) -> dict[str, Any]:
        """Snapshot content; collective (every rank's RNG state is gathered)."""
        model_state = {k: v.detach().float().clone() if v.is_floating_point() else v.detach().clone()
                       for k, v in self.model.state_dict().items()}
        model_state.update(self.flat.master_state())
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "iteration": self.iteration,
            "model": model_state,
            "solver": self.solver.state_dict(),
            "reducer": self.reducer.state_dict(),
            "rng": self.comm.allgather_object(rng),
            "data": {"micro_step": self.iteration * self.plan.iter_size, "world_size": self.world_size,
                     "batch_size": self.plan.batch_size, "seed": self.cfg.train.seed},
            "display": {"loss_from": self._loss_from,
                        "loss_sum": self.comm.allgather_object(float(self._loss_sum))},
            "config": config_to_dict(self.cfg),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a snapshot: masters (weights re-derived), buffers, momentum, scaler, RNG, position."""
        params = {n for n, _ in self.model.named_parameters()}
        buffers = {k: v for k, v in state["model"].items() if k not in params}
        missing = self.model.load_state_dict(buffers, strict=False)
        if missing.unexpected_keys:
            raise SnapshotError(f"snapshot has keys this model lacks: {missing.unexpected_keys[:5]}; "
                             "was it written for another model.name?")
        for name, p in self.model.named_parameters():
            saved = state["model"].get(name)
            if saved is None or saved.shape != p.shape:
                got = "missing" if saved is None else f"{list(saved.shape)}"
                raise SnapshotError(f"snapshot's {name!r} is {got} but this model's is {list(p.shape)}; was it written "
                                 f"with another model.num_classes / model.width / input channels?")
        self.reducer.load_state_dict(state.get("reducer", {}))  # may re-lay out the flat buffers: first
        self.flat.load_master_state(state["model"])
        self.solver.load_state_dict(state["solver"])
        rng = state["rng"][self.rank] if self.rank < len(state["rng"]) else state["rng"][0]
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        self.iteration = int(state["iteration"])
        self._feeder = None
        display = state.get("display")  # snapshots before this field restart the running loss
        if display is not None and self.rank < len(display["loss_sum"]):
            self._loss_from = int(display["loss_from"])
            self._loss_sum.fill_(display["loss_sum"][self.rank])
        else:
            self._loss_from = self.iteration
        self._warn_if_data_setup_changed(state.get("data", {}), len(state["rng"]))

    def _warn_if_data_setup_changed(self, data: dict[str, Any], ranks_saved: int) -> None:
        """Resuming with another batch size, world size, iter_size or seed is allowed, but the run
        no longer continues the interrupted one sample for sample: say so."""
        now = {"world_size": self.world_size, "batch_size": self.plan.batch_size, "seed": self.cfg.train.seed,
               "micro_step": self.iteration * self.plan.iter_size}
        changed = [f"{k} {data[k]} -> {v}" for k, v in now.items() if k in data and data[k] != v]
        if changed and self.rank == 0:
            log.warning("resuming with another data setup than the snapshot's (%s): training goes on, but the sample "
                        "order (and, for more ranks, the RNG streams) differ from an uninterrupted run",
                        ", ".join(changed))
        if self.rank >= ranks_saved:
            log.warning("rank %d: the snapshot holds RNG states for %d rank(s); this rank starts from rank 0's",
                        self.rank, ranks_saved)

    def save(self) -> Path | None:
        """Write snapshot_iter_<iteration>.pt (rank 0) after every rank contributed its RNG state."""
        state = self.state_dict()
        if self.rank != 0:
            return None
        path = save_snapshot(state, snapshot_path(self.run_dir, self.iteration))
        log.info("snapshot %s", path)
        return path

    def check_same_start(self, iteration: int) -> None:
        """Every rank must start at the same iteration (collective; before any other collective
        of a resume): a node that found no snapshot (node-local run dirs) would otherwise train
        from scratch beside resumed ones."""
        starts = self.comm.allgather_object(iteration)
        if len(set(starts)) > 1:
            listed = ", ".join(f"rank {r}: {it}" for r, it in enumerate(starts))
            raise SnapshotError(f"the ranks resumed at different iterations ({listed}); every rank must read the "
                             f"same snapshot: use a train.run_dir all nodes share, or pass --resume PATH")

    def resume(self, path: Path) -> None:
        state = load_snapshot(path)
        self.check_same_start(int(state["iteration"]))
        self.load_state_dict(state)
        dropped = self.metrics.drop_after(self.iteration)  # lines a crashed run wrote past its last snapshot
        log.info("resumed from %s at iteration %d%s", path, self.iteration,
                 f"; dropped {dropped} metrics.jsonl line(s) past it" if dropped else "")

    # ------------------------------------------------------------------ loop

    def _display(self, t_last: float, it_last: int) -> dict[str, Any]:
        """The display record: loss averaged since the last display (across a resume, too),
        images/s over the iterations this process timed since ``t_last`` / ``it_last``."""
        loss = self._loss_sum.clone()
        self.comm.allreduce_sum_(loss)
        loss_iters = max(self.iteration - self._loss_from, 1)
        iters = max(self.iteration - it_last, 1)
        elapsed = max(time.perf_counter() - t_last, 1e-9)
        rec = {
            "iter": self.iteration,
            "epoch": round(self.iteration * self.plan.iter_size / self.plan.micro_steps_per_epoch, 4),
            "loss": float(loss) / (loss_iters * self.world_size),
            "lr": self.lr,
            "images_per_s": round(self.plan.global_batch * iters / elapsed, 2),
            **self.scaler.stats(),
        }
        if self._feeder is not None and "bad_records" in self._feeder.last_info:
            rec["bad_records"] = self._feeder.last_info["bad_records"]  # skipped under data.max_bad_records
        self._loss_sum.zero_()
        self._loss_from = self.iteration
        self.scaler.check_floor()
        return rec

    def _stop_agreed(self, flag: _StopFlag) -> bool:
        if self.world_size == 1:
            return flag.requested
        if self.iteration % STOP_POLL_ITERS:
            return False
        t = torch.tensor([1.0 if flag.requested else 0.0], device=self.device)
        self.comm.allreduce_sum_(t)
        return bool(t.item() > 0)

    def fit(self) -> dict[str, Any]:
        """Train to solver.max_iter (or until SIGTERM/SIGUSR1/Ctrl-C); return the last metrics."""
        s = self.cfg.solver
        if self.rank == 0:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                (self.run_dir / "config.toml").write_text(dump_toml(self.cfg))
            except OSError as e:
                raise RunDirError(f"cannot write {str(self.run_dir / 'config.toml')!r} ({e.strerror or e}); "
                                 f"choose another train.run_dir") from e
            if removed := remove_stale_temporaries(self.run_dir):
                log.info("removed %d temporary file(s) of interrupted snapshot writes", removed)
        log.info("%s", self.plan.describe())
        log.info("bytes per parameter: %s (%d parameters)", self.flat.bytes_per_param(), self.flat.num_params)
        if self.iteration >= s.max_iter:  # e.g. --resume auto on a finished run: its final test and snapshot exist
            log.warning("iteration %d is already at solver.max_iter = %d: nothing to train; raise solver.max_iter "
                        "to continue", self.iteration, s.max_iter)
            return {}
        flag, last, bar = _StopFlag(), {}, _progress(self.rank, s.max_iter, self.iteration)
        t_last, it_last = time.perf_counter(), self.iteration
        with flag.installed():
            while self.iteration < s.max_iter:
                self.train_step()
                bar.update(1)
                it = self.iteration
                if s.display and it % s.display == 0:
                    last = self._display(t_last, it_last)
                    t_last, it_last = time.perf_counter(), it
                    self.metrics.write(last)
                    log.info("iter %d loss %.4f lr %.5g %.1f img/s scale %g skipped %d", it, last["loss"],
                             last["lr"], last["images_per_s"], last["loss_scale"], last["skipped_steps"])
                if s.test_interval and it % s.test_interval == 0 and it < s.max_iter:
                    last = {**last, **self._test_and_log()}
                if s.snapshot and it % s.snapshot == 0 and it < s.max_iter:
                    self.scaler.check_floor()
                    self.save()
                if self._stop_agreed(flag):
                    why = f"signal {signal.Signals(flag.signum).name} received" if flag.signum else \
                        "another rank received a stop signal"
                    log.warning("rank %d: %s; snapshot at iteration %d and stop", self.rank, why, it)
                    self.save()
                    return {**last, "stopped_by_signal": True}
            bar.close()
            # still under the handlers: a SIGTERM now only sets the flag, and this save is the snapshot it asks for
            self.scaler.check_floor()
            last = {**last, **self._test_and_log()}
            self.save()
        return last

    def _test_and_log(self) -> dict[str, Any]:
        if self.source.num_test == 0:  # no data.test_path (or an empty one): no test phase, no made-up 0 %
            return {}
        res = self.test()
        self.metrics.write({"iter": self.iteration, **res})
        log.info("iter %d test top-1 %.4f top-5 %.4f (%d samples)", self.iteration, res["test_top1"],
                 res["test_top5"], res["test_samples"])
        return res

    def close(self) -> None:
        """Stop the input threads, unhook the reducer and close metrics.jsonl."""
        if self._feeder is not None:
            self._feeder.close()
            self._feeder = None
        self.reducer.close()
        self.metrics.close()


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(rank: int, total: int, start: int) -> Any:
    """A tqdm bar on rank 0 when stderr is a terminal; plain log lines otherwise."""
    if rank != 0 or not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=start, unit="it", dynamic_ncols=True)
