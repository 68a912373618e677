"""Trainer: builds the parts from their config sections and runs the solver loop.

One Trainer per solver process. The iteration is:

    release the .grad views                 backward hands its gradients over (dptrain.flat)
    for each of iter_size micro-batches:   data -> forward -> scaled loss -> backward
                                            (the reducer sums the control flags, stop and non-finite
                                             loss, during the last backward, and allreduces buckets)
    restore the .grad views
    reducer.wait()                          the only point where compute waits on communication
    optimizer.step()                        unscale, skip on overflow, update masters, write weights

Nothing in the step reads a device value on the host: the control flags are read back
``ControlChannel.lag`` iterations later (``dptrain.dist.control``), so a stop signal or a
diverged loss is acted on at the same iteration on every rank. The host syncs only when
it logs, tests or snapshots.
"""
from __future__ import annotations

import logging
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dptrain.assemble import RunPlan, build_model_and_params, nhwc_hazards, running_stats
from dptrain.checkpoint import (
    RunDir,
    StateParts,
    capture,
    check_same_start,
    good_snapshots,
    list_snapshots,
    load_snapshot,
    mark_diverging,
    restore,
    save_snapshot,
    snapshot_path,
    unmark_diverging,
)
from dptrain.dist.comm import Communicator
from dptrain.config import TrainConfig, config_to_dict, dump_toml
from dptrain.dist.control import LOSS, NONFINITE, STOP, ControlChannel, StopFlag
from dptrain.data import build_source
from dptrain.data.base import DROPPED_LABEL, DeviceFeeder
from dptrain.data.sampling import ShardPlan, batches_per_epoch, eval_range
from dptrain.errors import ConfigError, DivergenceError
from dptrain.layout import resolve_channels_last
from dptrain.observe.metrics import MetricsWriter, TensorBoardWriter
from dptrain.models import check_input
from dptrain.optimizer import MasterOptimizer
from dptrain.overflow import DivergenceWatch, OverflowLocator, first_nonfinite_layer
from dptrain.param_groups import resolve_multipliers
from dptrain.precision import DTYPES, LossScaler, warn_if_slow_on_cpu
from dptrain.dist.planning.auto import attach_auto_plan
from dptrain.dist.reducer import Reducer
from dptrain.dist.straggler import StepClock, StragglerMonitor
from dptrain.observe.trace import NullTracer, PhaseTimer, Tracer

log = logging.getLogger(__name__)


class Trainer:
    """One solver: model, flat buffers, scaler, reducer, optimizer and data, from the config."""

    def __init__(self, cfg: TrainConfig, comm: Communicator, *, tracer: Tracer | None = None,
                 time_phases: bool = False, stop: StopFlag | None = None) -> None:
        self.cfg, self.comm = cfg, comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.device = comm.device
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
        elif self.rank == 0:
            warn_if_slow_on_cpu(cfg.precision.storage, self.device)
        self.tracer = tracer or NullTracer(self.rank)
        self.run_dir = RunDir(cfg.train.run_dir)
        self.run_dir.check_usable(writer=False)
        self.source = build_source(cfg.data, num_classes=cfg.model.num_classes, seed=cfg.train.seed, device=self.device,
                                   rank=self.rank, cores=comm.topology.cores_per_process)
        channels_last = resolve_channels_last(cfg.model.channels_last, cfg.precision.storage, self.device,
                                              nhwc_hazards(cfg, self.source.sample_shape[2])
                                              if self.device.type == "cpu" else None)
        self.model, self.flat = build_model_and_params(cfg, comm, self.device, in_channels=self.source.sample_shape[2],
                                                       channels_last=channels_last)
        self._input_ok = False
        ls_mode = cfg.precision.resolved_loss_scale_mode()
        self.scaler = LossScaler(cfg.precision.loss_scale, ls_mode, self.device)
        self.reducer = Reducer(self.flat, cfg.reducer, comm, self.tracer, running_stats(self.model))
        self.autoplan = attach_auto_plan(self.reducer)
        """The reducer.bucket_mb = "auto" planner watching the reducer (None for a fixed plan)."""
        multipliers = resolve_multipliers(self.model, cfg.solver.param_groups, cfg.solver.no_decay)
        self.overflow = OverflowLocator(self.flat, self.device, enabled=self.scaler.enabled)
        self.optimizer = MasterOptimizer(self.flat, cfg.solver, self.scaler, self.reducer.grad_divisor, multipliers,
                                         locator=self.overflow)
        self.parts = StateParts(self.model, self.flat, self.optimizer, self.reducer, comm)
        self.shard = ShardPlan(self.rank, self.world_size, cfg.data.batch_size, cfg.train.seed,
                               cfg.data.shuffle == "epoch")
        self.plan = RunPlan(
            rank=self.rank, world_size=self.world_size, device=str(self.device),
            batch_size=cfg.data.batch_size, iter_size=cfg.solver.iter_size,
            global_batch=cfg.data.batch_size * self.world_size * cfg.solver.iter_size,
            micro_steps_per_epoch=batches_per_epoch(self.source.num_train, self.shard.samples_per_step),
            storage=cfg.precision.storage, loss_scale=ls_mode,
            channels_last=channels_last,
        )
        self.dtype = DTYPES[cfg.precision.storage]
        self.iteration = 0
        self.lr = 0.0
        self.phases = PhaseTimer(self.device, self.tracer, time_phases or self.tracer.enabled)
        self.stop = stop or StopFlag()
        self.control = ControlChannel(comm, self.device)
        self._stop_at: int | None = None
        self._nonfinite_since: int | None = None
        self.divergence = DivergenceWatch()
        self._saved_at: int | None = None
        """Iteration of the snapshot last written or resumed from: a stop there writes nothing new."""
        self._feeder: DeviceFeeder | None = None
        self._iter_loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self._loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self._loss_from = 0
        """Iteration since which _loss_sum accumulates (the last display); saved in snapshots."""
        self.metrics = MetricsWriter(self.run_dir.metrics if self.rank == 0 else None)
        self.tensorboard = TensorBoardWriter(self.run_dir.path / "tensorboard") \
            if cfg.train.tensorboard and self.rank == 0 else None
        self.clock = StepClock(self.device)
        self.stragglers = StragglerMonitor(comm, cfg.train.straggler_warn, comm.allgather_object(socket.gethostname()))

    # ------------------------------------------------------------------ data

    def _feeder_for(self, stream: Any) -> DeviceFeeder:
        return DeviceFeeder(stream, device=self.device, dtype=self.dtype, mean=self.source.mean,
                            scale=self.source.scale, channels_last=self.plan.channels_last,
                            mean_image=self.source.mean_image)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._feeder is None:
            start = self.iteration * self.plan.iter_size
            self._feeder = self._feeder_for(self.source.train_batches(self.shard, start))
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
        self.comm.flight.iteration = self.iteration
        n = self.plan.iter_size
        self._iter_loss.zero_()
        self.flat.release_grads()  # the update left the flat gradients zero: backward hands its own over
        try:
            for micro in range(n):
                x, y = self._next_batch()
                self.clock.batch_ready()
                last = micro == n - 1
                with self.phases("forward"):
                    logits = self._forward(x).float()  # [B, num_classes]
                    loss = F.cross_entropy(logits, y, label_smoothing=self.cfg.solver.label_smoothing) / n
                self._iter_loss += loss.detach()
                control = self.control.vector(self.stop.requested, self._iter_loss) if last else None
                self.reducer.begin(sync=last, control=control)
                if last and self._feeder is not None:
                    self._feeder.prefetch()  # next batch's H2D copy overlaps this backward
                with self.phases("backward"):
                    self.scaler.scale_loss(loss).backward()
        except BaseException:
            self.flat.zero_grads()  # a failed step leaves no partial gradient for a retry to add to
            raise
        finally:
            self.flat.restore_grads()
        self.clock.backward_done()
        self._loss_sum += self._iter_loss
        self.clock.wait_start()
        with self.phases("exposed_comm"):
            self.reducer.wait()
        self.clock.wait_done()
        self.scaler.record_nonfinite_loss(control[NONFINITE])  # no loss scaling: skip, summed over the ranks
        with self.phases("update"):
            self.lr = self.optimizer.step(self.iteration)
        self.iteration += 1
        self.control.submit(self.iteration, reduce=False)  # summed by the reducer's collective

    def _read_control(self, flags: Any) -> None:
        """Act on the control sums read back for earlier iterations (see dptrain.dist.control)."""
        for step, sums in flags:
            if sums[STOP] > 0 and self._stop_at is None:
                self._stop_at = step + self.control.lag
            self._watch_loss(step, float(sums[LOSS]) / self.world_size)
            if self.scaler.enabled:  # a non-finite loss is an overflow there: the scaler skips the step
                continue
            if sums[NONFINITE] == 0:
                self._nonfinite_since = None
                continue
            self._nonfinite_since = self._nonfinite_since or step
            if step - self._nonfinite_since + 1 >= self.cfg.solver.max_nonfinite:
                raise self._divergence(f"the loss was not finite on {int(sums[NONFINITE])} rank(s) at iteration "
                                       f"{step}, {step - self._nonfinite_since + 1} iteration(s) in a row since "
                                       f"{self._nonfinite_since} (solver.max_nonfinite = "
                                       f"{self.cfg.solver.max_nonfinite}; those steps were skipped); first "
                                       f"non-finite layer: {self._first_nonfinite_layer()}")

    def _watch_loss(self, step: int, loss: float) -> None:
        """Feed the divergence watch; when a divergence starts, mark the snapshots it taints already."""
        began = self.divergence.observe(step, loss)
        if began is None:
            return
        if self.rank == 0:
            tainted = [p for it, p in list_snapshots(self.run_dir.path) if self.divergence.suspect(it)]
            for p in tainted:
                mark_diverging(p, began)
            log.warning("iter %d: the run may be diverging: %s; snapshots from iteration %d on are marked and not "
                        "offered for --resume auto%s", step, began, self.divergence.since,
                        f" ({len(tainted)} already written)" if tainted else "")

    def _first_nonfinite_layer(self) -> str:
        """Which layer a forward of the next batch, with the current (last good) weights, first
        makes non-finite: the diagnosis of a stop for a non-finite loss, on that path only."""
        x, _ = self._next_batch()
        return first_nonfinite_layer(self.model, x)

    def _divergence(self, what: str) -> DivergenceError:
        """The stop for a divergence, naming the newest snapshot from before it began."""
        good = good_snapshots(self.run_dir.path, before=self.divergence.since)
        began = f" (it began with the weights of iteration {self.divergence.since})" \
            if self.divergence.since is not None else ""
        kept = f"the last good snapshot is {good[0][1]}{began}" if good else f"no good snapshot was written{began}"
        return DivergenceError(f"{what}; lower solver.base_lr or set solver.clip_gradients, then resume; {kept}")

    def stop_due(self) -> bool:
        """Whether every rank stops after this iteration (reads what the control channel has)."""
        self._read_control(self.control.ready(self.iteration))
        return self._stop_at is not None and self.iteration >= self._stop_at

    def agree_stop(self) -> bool:
        """Before a test phase: settle every pending control read and ask every rank now (a
        blocking collective; tests are rare), so a stop never starts a new test."""
        self._read_control(self.control.drain())
        flag = torch.tensor([1.0 if self.stop.requested else 0.0], device=self.device)
        self.comm.allreduce_sum_(flag)
        return self._stop_at is not None or bool(flag.item() > 0)

    def time_phases(self, active: bool) -> None:
        """Start (or stop) timing the phases of the coming steps, from zero."""
        self.phases.reset()
        self.phases.active = active or self.tracer.enabled

    def phase_totals_ms(self) -> dict[str, float]:
        """Milliseconds per phase over the steps timed since :meth:`time_phases`."""
        return self.phases.totals_ms()

    # ------------------------------------------------------------------ test

    @torch.no_grad()
    def test(self) -> dict[str, float] | None:
        """Top-1/top-5 over the whole test set, every sample counted once across ranks; None
        when a stop request abandoned it (every rank at the same batch).

        Each batch sums a stop flag over the ranks (one small async collective, read back
        ``control.lag`` batches later). Every rank runs the same number of rounds, the most
        any rank's slice needs, so the collectives pair up when the slices differ by a batch.
        """
        self.model.eval()
        counts = torch.zeros(4, dtype=torch.float64, device=self.device)  # correct1, correct5, n, bad records
        bs = self.cfg.data.test_batch_size
        rounds = max(-(-len(eval_range(self.source.num_test, r, self.world_size)) // bs)
                     for r in range(self.world_size))
        if self.cfg.solver.test_iter:
            rounds = min(rounds, self.cfg.solver.test_iter)
        feeder = self._feeder_for(self.source.test_batches(self.rank, self.world_size, bs))
        control = ControlChannel(self.comm, self.device)
        abandon_at: int | None = None
        try:
            for i in range(rounds):
                batch = next(feeder, None)
                if batch is not None:
                    x, y = batch
                    top5 = self._forward(x).float().topk(min(5, self.cfg.model.num_classes), dim=1).indices
                    kept = y != DROPPED_LABEL  # a bad record skipped under data.max_bad_records scores nothing
                    hit = (top5 == y[:, None]) & kept[:, None]
                    counts[0] += hit[:, 0].sum()
                    counts[1] += hit.any(dim=1).sum()
                    counts[2] += kept.sum()
                control.vector(self.stop.requested)
                control.submit(i, reduce=True)
                for step, sums in control.ready(i):
                    if sums[STOP] > 0 and abandon_at is None:
                        abandon_at = step + control.lag
                if abandon_at is not None and i >= abandon_at:
                    break
            for step, sums in control.drain():  # the last rounds' flags: every rank reads the same
                if sums[STOP] > 0 and abandon_at is None:
                    abandon_at = step
            counts[3] += feeder.last_info.get("bad_records", 0)
        finally:
            feeder.close()
            self.model.train()
        if abandon_at is not None:
            self._stop_at = self.iteration
            return None
        self.comm.allreduce_sum_(counts)
        c1, c5, total, bad = counts.tolist()
        res = {"test_top1": c1 / max(total, 1), "test_top5": c5 / max(total, 1), "test_samples": int(total)}
        return {**res, "test_bad_records": int(bad)} if bad else res

    # ------------------------------------------------------------------ snapshots

    def _snapshot_state(self) -> dict[str, Any]:
        """The snapshot content; collective (every rank's RNG and running loss are gathered)."""
        return capture(
            self.parts, iteration=self.iteration,
            data={"micro_step": self.iteration * self.plan.iter_size, "world_size": self.world_size,
                  "batch_size": self.plan.batch_size, "seed": self.cfg.train.seed},
            display={"loss_from": self._loss_from, "loss_sum": self.comm.allgather_object(float(self._loss_sum))},
            config=config_to_dict(self.cfg))

    def save(self) -> Path | None:
        """Write snapshot_iter_<iteration>.pt (rank 0) after every rank contributed its state.

        Refuses non-finite masters (a diverged run keeps its last good snapshot), and writes
        nothing when this iteration's snapshot was just written or resumed from.
        """
        path = snapshot_path(self.run_dir.path, self.iteration)
        if self._saved_at == self.iteration:
            return path if self.rank == 0 else None
        if not all(bool(torch.isfinite(g.master).all()) for g in self.flat.groups):
            raise self._divergence(f"the weights are not finite at iteration {self.iteration}, so no snapshot was "
                                   f"written")
        state = self._snapshot_state()
        self._saved_at = self.iteration
        if self.rank != 0:
            return None
        unmark_diverging(path)  # a marker left by the run that wrote this iteration before a resume
        save_snapshot(state, path)
        if self.divergence.suspect(self.iteration):
            mark_diverging(path, f"written while diverging, since the weights of iteration {self.divergence.since}")
            log.warning("snapshot %s (marked diverging)", path)
        else:
            log.info("snapshot %s", path)
        return path

    def resume(self, path: Path) -> None:
        """Continue from snapshot ``path``: every rank checks first that all start at its iteration."""
        state = load_snapshot(path)
        check_same_start(self.comm, int(state["iteration"]))
        restore(self.parts, state)
        self.iteration = int(state["iteration"])
        self._feeder = None
        self._saved_at = self.iteration
        display = state["display"]
        if self.rank < len(display["loss_sum"]):
            self._loss_from = int(display["loss_from"])
            self._loss_sum.fill_(display["loss_sum"][self.rank])
        else:
            self._loss_from = self.iteration
        self._warn_if_data_setup_changed(state["data"])
        dropped = self.metrics.drop_after(self.iteration)  # lines a crashed run wrote past its last snapshot
        log.info("resumed from %s at iteration %d%s", path, self.iteration,
                 f"; dropped {dropped} metrics.jsonl line(s) past it" if dropped else "")

    def start_over(self) -> None:
        """``--resume auto`` found no snapshot: start at 0, dropping what a crashed run logged."""
        check_same_start(self.comm, 0)
        dropped = self.metrics.drop_after(0)  # the crashed run's lines: this run writes them again
        log.info("--resume auto: no snapshot in %s; starting fresh%s", self.run_dir.path,
                 f" (dropped {dropped} metrics.jsonl line(s) of the earlier run)" if dropped else "")

    def _warn_if_data_setup_changed(self, data: dict[str, Any]) -> None:
        """Resuming with another batch size, world size, iter_size or seed is allowed, but the run
        no longer continues the interrupted one sample for sample: say so."""
        now = {"world_size": self.world_size, "batch_size": self.plan.batch_size, "seed": self.cfg.train.seed,
               "micro_step": self.iteration * self.plan.iter_size}
        changed = [f"{k} {data[k]} -> {v}" for k, v in now.items() if k in data and data[k] != v]
        if changed and self.rank == 0:
            log.warning("resuming with another data setup than the snapshot's (%s): training goes on, but the sample "
                        "order (and, for more ranks, the RNG streams) differ from an uninterrupted run",
                        ", ".join(changed))

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
        overflowed = self.overflow.collect()
        if overflowed:
            rec["overflow_params"] = overflowed
            if self.rank == 0:
                log.warning("iter %d: %d step(s) skipped for overflow so far; non-finite gradients since iter %d in: "
                            "%s", self.iteration, rec["skipped_steps"], it_last, ", ".join(overflowed))
        rec.update(self.stragglers.gather(self.clock))
        warning = self.stragglers.judge(rec, 1000.0 * elapsed / iters)
        if warning is not None and self.rank == 0:
            log.warning("%s", warning)
        self._loss_sum.zero_()
        self._loss_from = self.iteration
        self.scaler.check_floor(self.overflow.most_often)
        return rec

    def write_metrics(self, record: dict[str, Any]) -> None:
        """Append a record to metrics.jsonl (and TensorBoard); rank 0 only writes."""
        self.metrics.write(record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def _stopped(self, last: dict[str, Any]) -> dict[str, Any]:
        log.warning("rank %d: %s; snapshot at iteration %d and stop", self.rank, self.stop.why, self.iteration)
        self.save()
        return {**last, "stopped_by_signal": True}

    def fit(self) -> dict[str, Any]:
        """Train to solver.max_iter (or until SIGTERM/SIGUSR1/Ctrl-C); return the last metrics.

        A stop request is acted on after the iteration it reaches every rank (``control.lag``
        iterations later on CUDA), between test batches, or before a test starts: the run
        writes a snapshot and returns. The final snapshot is written before the final test,
        so a stop during that test loses nothing.
        """
        s = self.cfg.solver
        if self.rank == 0:
            self.run_dir.prepare(dump_toml(self.cfg))
        log.info("%s", self.plan.describe())
        custom = sum(1 for m in self.optimizer.multipliers.values() if m != (1.0, 1.0))
        log.info("solver %s; lr_mult/decay_mult other than 1 on %d of %d parameter tensors; bytes per parameter: %s "
                 "(%d parameters)", s.type, custom, len(self.optimizer.multipliers), self.optimizer.bytes_per_param(),
                 self.flat.num_params)
        if self.iteration >= s.max_iter:  # e.g. --resume auto on a finished run: its final test and snapshot exist
            log.warning("iteration %d is already at solver.max_iter = %d: nothing to train; raise solver.max_iter "
                        "to continue", self.iteration, s.max_iter)
            return {}
        last: dict[str, Any] = {}
        bar = _progress(self.rank, s.max_iter, self.iteration)
        t_last, it_last = time.perf_counter(), self.iteration
        with self.stop.installed():
            while self.iteration < s.max_iter:
                self.train_step()
                bar.update(1)
                if self.stop_due():
                    return self._stopped(last)
                it = self.iteration
                if s.display and it % s.display == 0:
                    last = self._display(t_last, it_last)
                    t_last, it_last = time.perf_counter(), it
                    self.write_metrics(last)
                    log.info("iter %d loss %.4f lr %.5g %.1f img/s scale %g skipped %d", it, last["loss"],
                             last["lr"], last["images_per_s"], last["loss_scale"], last["skipped_steps"])
                if s.test_interval and it % s.test_interval == 0 and it < s.max_iter:
                    if self.agree_stop():
                        return self._stopped(last)
                    res = self._test_and_log()
                    if res is None:
                        return self._stopped(last)
                    last = {**last, **res}
                if s.snapshot and it % s.snapshot == 0 and it < s.max_iter:
                    self.scaler.check_floor(self.overflow.most_often)
                    self.save()
            bar.close()
            self._read_control(self.control.drain())
            if self._stop_at is not None:
                return self._stopped(last)
            self.scaler.check_floor(self.overflow.most_often)
            self.save()  # before the final test: a stop during it loses nothing
            res = self._test_and_log()
            if res is None:
                return self._stopped(last)
        return {**last, **res}

    def _test_and_log(self) -> dict[str, Any] | None:
        if self.source.num_test == 0:  # no data.test_path (or an empty one): no test phase, no made-up 0 %
            return {}
        log.info("iter %d: test phase over %d samples", self.iteration, self.source.num_test)
        res = self.test()
        if res is None:
            return None
        self.write_metrics({"iter": self.iteration, **res})
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
        if self.tensorboard is not None:
            self.tensorboard.close()


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
