"""Trainer: builds the parts from their config sections and runs the solver loop (see ``dptrain.train``)."""
from __future__ import annotations

import functools
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import torch

from dptrain.assemble import RunSetup, build_model_and_params, input_error, running_stats
from dptrain.config import TrainConfig, config_to_dict, dump_toml
from dptrain.data import build_source
from dptrain.data.base import DeviceFeeder
from dptrain.data.sampling import SampleOrder, batches_per_epoch
from dptrain.distributed.buckets.tuner import attach_bucket_tuner
from dptrain.distributed.comm import Communicator
from dptrain.distributed.control import NONFINITE, ControlChannel, StopFlag
from dptrain.distributed.reducer import Reducer
from dptrain.distributed.straggler import StepClock, StragglerMonitor
from dptrain.distributed.unused import UnusedParams
from dptrain.inductor import point_caches
from dptrain.models import is_import_path
from dptrain.observe.metrics import MetricsWriter, TensorBoardWriter
from dptrain.observe.trace import NullTracer, PhaseTimer, Tracer
from dptrain.optimizer import MasterOptimizer
from dptrain.overflow import OverflowLocator, first_nonfinite_layer
from dptrain.param_groups import resolve_multipliers
from dptrain.precision import DTYPES, LossScaler, warn_if_slow_on_cpu
from dptrain.snapshots import RunDir, Snapshots, StateParts
from dptrain.train import attention
from dptrain.train.compiled import compile_for_training, eager
from dptrain.train.display import DisplayWindow
from dptrain.train.health import HealthWatch, check_loss_scale_floor
from dptrain.train.outputs import check_logits, split_output, training_loss
from dptrain.train.scoring import BAD, score, score_record, score_rounds
from dptrain.train.stops import StopAgreed, StopProtocol

log = logging.getLogger(__name__)


class Trainer:
    """One solver: model, flat buffers, scaler, reducer, optimizer and data, from the config."""

    def __init__(self, cfg: TrainConfig, comm: Communicator, *, tracer: Tracer | None = None,
                 time_phases: bool = False, stop: StopFlag | None = None, compile_model: bool = True) -> None:
        """``compile_model=False``: never compile the model (``dptrain test`` scores eagerly)."""
        point_caches()  # before the CPU layout probe below imports torch._dynamo (dptrain.inductor)
        self.cfg, self.comm = cfg, comm
        self.rank, self.world_size, self.device = comm.rank, comm.world_size, comm.device
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
        elif self.rank == 0:
            warn_if_slow_on_cpu(cfg.precision.storage, self.device)
        self.tracer = tracer or NullTracer(self.rank)
        self.run_dir = RunDir(cfg.train.run_dir)
        self.run_dir.check_usable(writer=False)
        self.source = build_source(cfg.data, num_classes=cfg.model.num_classes, seed=cfg.train.seed, device=self.device,
                                   rank=self.rank, cores=comm.topology.cores_per_process)
        self.model, self.flat, channels_last = build_model_and_params(cfg, comm, self.device,
                                                                      in_channels=self.source.sample_shape[2])
        self._checked_modes: set[bool] = set()
        """The model modes (``model.training``) whose first forward was checked (``_forward``)."""
        ls_mode = cfg.precision.resolved_loss_scale_mode()
        self.scaler = LossScaler(cfg.precision.loss_scale, ls_mode, self.device)
        self.control = ControlChannel(comm, self.device)
        self.unused = UnusedParams(self.flat, comm, mode=cfg.model.unused_parameters, lag=self.control.lag)
        """Parameters without a gradient, agreed over the ranks (``dptrain.distributed.unused``)."""
        wire = DTYPES[cfg.wire_dtype()]
        self.reducer = Reducer(self.flat, cfg.reducer, comm, self.tracer, running_stats(self.model), self.unused,
                               wire_dtype=None if wire == DTYPES[cfg.precision.weights] else wire)
        self.bucket_tuner = attach_bucket_tuner(self.reducer)
        """The reducer.bucket_mb = "auto" planner watching the reducer (None for a fixed plan)."""
        multipliers = resolve_multipliers(self.model, cfg.solver.param_groups, cfg.solver.no_decay)
        self.overflow = OverflowLocator(self.flat, self.device, enabled=self.scaler.enabled)
        self.optimizer = MasterOptimizer(self.flat, cfg.solver, self.scaler, self.reducer.grad_divisor, multipliers,
                                         locator=self.overflow, unused=self.unused)
        self.shards = self.reducer.shards
        """This solver's slices of the masters and optimizer state (``reducer.shard = "optimizer"``), or None."""
        if self.shards is not None:  # what needs the whole gradient sums the solvers' partial sums
            self.optimizer.sum_over_ranks = self.overflow.sum_over_ranks = self.shards.sum_
        self.order = SampleOrder(self.rank, self.world_size, cfg.data.batch_size, cfg.train.seed,
                               cfg.data.shuffle == "epoch")
        self.setup = RunSetup(
            rank=self.rank, world_size=self.world_size, device=str(self.device), batch_size=cfg.data.batch_size,
            iter_size=cfg.solver.iter_size, global_batch=cfg.data.batch_size * self.world_size * cfg.solver.iter_size,
            micro_steps_per_epoch=batches_per_epoch(self.source.num_train, self.order.samples_per_step),
            storage=cfg.precision.storage, loss_scale=ls_mode, channels_last=channels_last,
            precision_mode=cfg.precision.mode, reduce_dtype=cfg.wire_dtype())
        self.dtype = DTYPES[cfg.precision.weights]
        """The dtype of the weights and of the batches fed to the model (fp32 under autocast)."""
        self._autocast = functools.partial(torch.autocast, self.device.type, dtype=DTYPES[cfg.precision.storage],
                                           enabled=cfg.precision.autocast)
        """Forward's precision context: ``torch.autocast`` in ``precision.storage``'s dtype (mode "autocast"),
        or a no-op."""
        self.iteration, self.lr = 0, 0.0
        self.phases = PhaseTimer(self.device, self.tracer, time_phases or self.tracer.enabled)
        self.stop = stop or StopFlag()
        self.stops = StopProtocol(self.stop)
        self.health = HealthWatch(self.run_dir.path, rank=self.rank, world_size=self.world_size,
                                  max_nonfinite=cfg.solver.max_nonfinite, scaled=self.scaler.enabled,
                                  first_bad_layer=self._first_nonfinite_layer)
        self._feeder: DeviceFeeder | None = None
        self._iter_loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self.window = DisplayWindow(self.device, 0)
        self._last: dict[str, Any] = {}
        """The latest display and test records: what fit returns."""
        self.metrics = MetricsWriter(self.run_dir.metrics if self.rank == 0 else None)
        self.tensorboard = TensorBoardWriter(self.run_dir.path / "tensorboard") \
            if cfg.train.tensorboard and self.rank == 0 else None
        self.snapshots = Snapshots(StateParts(self.model, self.flat, self.optimizer, self.reducer, comm),
                                   self.run_dir.path, config_to_dict(cfg), health=self.health, metrics=self.metrics)
        self.clock = StepClock(self.device)
        self.stragglers = StragglerMonitor(comm, cfg.train.straggler_warn, comm.allgather_object(socket.gethostname()))
        (h, w, c), b = self.source.sample_shape, cfg.data.batch_size
        self.attention = attention.TORCH
        """The kernel of the model's SDPA calls (``model.attention``, ``dptrain.train.attention``): torch's
        own dispatch while compiling (a compiled model keeps it), then the resolved setting."""
        self.compiled = compile_for_training(
            self.model, cfg.model.compile if compile_model else False, graphs=cfg.model.compile_graphs,
            storage=cfg.precision.storage, bucket_mb=cfg.reducer.bucket_mb, forward=self._forward,
            batch_shape=(b, c, h, w), dtype=self.dtype, channels_last=channels_last, flat=self.flat, comm=comm)
        """The compiled model's segments (None: the model runs eagerly), ``dptrain.train.compiled``."""
        self.attention = self._attention_kernel()
        self.snapshots.config["model"]["attention"] = self.attention  # a resume keeps the measured choice
        self._gather_in_forward = (self.shards is not None and cfg.reducer.gather_wait == "forward"
                                   and self.compiled is None and self.world_size > 1)
        """Sharded weights waited for module by module in forward (``reducer.gather_wait``)."""
        if self._gather_in_forward:
            self.shards.wait_in_forward(self.model)

    # ------------------------------------------------------------------ data

    def _feeder_for(self, stream: Any) -> DeviceFeeder:
        return DeviceFeeder(stream, device=self.device, dtype=self.dtype, mean=self.source.mean,
                            scale=self.source.scale, channels_last=self.setup.channels_last,
                            mean_image=self.source.mean_image)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._feeder is None:
            start = self.iteration * self.setup.iter_size
            self._feeder = self._feeder_for(self.source.train_batches(self.order, start))
        with self.phases("data_wait"):
            return next(self._feeder)

    def _forward(self, x: torch.Tensor) -> Any:
        """The model's output (a tensor, tuple, list or dict: ``dptrain.train.outputs``). The first call
        in each mode (training, evaluation: a model may return other outputs in eval mode) checks it:
        if the model cannot take the data's sample shape, or its logits are not [batch, num_classes],
        a ConfigError says so (``assemble.input_error``; diagnosed only then)."""
        if self.model.training in self._checked_modes:
            with self._autocast(), attention.context(self.attention):
                return self.model(x)
        try:
            with self._autocast(), attention.context(self.attention):
                out = self.model(x)
        except (RuntimeError, ValueError, AssertionError) as e:
            if (why := input_error(self.cfg, self.source.sample_shape, e)) is None:
                raise
            raise why from e
        check_logits(split_output(out)[0], len(x), self.cfg.model.num_classes, self.cfg.model.name,
                     self.model.training)
        self._checked_modes.add(self.model.training)
        return out

    def _attention_kernel(self) -> str:
        """``model.attention`` resolved: "auto" measured on rank 0 and agreed (``dptrain.train.attention``)."""
        setting = self.cfg.model.attention
        if setting != "auto":
            return setting
        if not is_import_path(self.cfg.model.name) or self.compiled is not None or self.device.type != "cpu":
            return attention.TORCH
        kernel, times = attention.TORCH, {}
        if self.rank == 0:
            h, w, c = self.source.sample_shape
            sample = torch.zeros((attention.RECORD_BATCH, c, h, w), dtype=self.dtype, device=self.device)
            if self.setup.channels_last:
                sample = sample.contiguous(memory_format=torch.channels_last)
            kernel, times = attention.choose(self.model, sample, self.cfg.data.batch_size, self._autocast)
            if times:
                log.info("model.attention = \"auto\": %s for the model's attention (forward and backward per step: %s)",
                         kernel, ", ".join(f"{k} {1000 * t:.1f} ms" for k, t in sorted(times.items(), key=lambda kv: kv[1])))
        return self.comm.broadcast_object(kernel)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return split_output(self._forward(x))[0]

    def _observe(self, step: int, sums: torch.Tensor) -> None:
        """What the control sums of ``step`` decide besides a stop: the run's health, and the gather of
        parameters newly left without a gradient."""
        self.health.observe(step, sums)
        self.unused.observe(step, sums)

    def _first_nonfinite_layer(self) -> str:
        with eager(), self._autocast():  # its forward hooks look inside the segments
            return first_nonfinite_layer(self.model, self._next_batch()[0], logits_of=lambda out: split_output(out)[0])

    # ------------------------------------------------------------------ step

    def train_step(self) -> None:
        """One iteration: iter_size micro-batches, the reduce, and the fused update."""
        self.model.train()
        self.comm.flight.iteration = self.iteration
        if not self._gather_in_forward:
            self.weights_whole()
        n = self.setup.iter_size
        self._iter_loss.zero_()
        self.flat.release_grads()  # the update left the flat gradients zero: backward hands its own over
        try:
            for micro in range(n):
                x, y = self._next_batch()
                self.clock.batch_ready()
                last = micro == n - 1
                with self.phases("forward"):
                    if self.compiled is not None:
                        self.compiled.step_begins()
                    loss = training_loss(self._forward(x), y, label_smoothing=self.cfg.solver.label_smoothing,
                                         aux_weight=self.cfg.model.aux_loss_weight) / n
                self._iter_loss += loss.detach()
                control = self.control.vector(self.stop.requested, self._iter_loss,
                                              self.unused.control_flag()) if last else None
                self.reducer.begin(sync=last, control=control)
                if last and self._feeder is not None:
                    self._feeder.prefetch()  # next batch's H2D copy overlaps this backward
                with self.phases("backward"):
                    self.scaler.scale_loss(loss).backward()
        except BaseException:
            self.flat.zero_grads()  # a failed step leaves no partial gradient for a retry to add to
            self.flat.restore_grads()
            raise
        self.unused.iteration = self.iteration
        self.unused.note(self.flat.restore_grads())
        self.clock.backward_done()
        self.window.add(self._iter_loss)
        self.clock.wait_start()
        with self.phases("exposed_comm"):
            self.reducer.wait()
        self.clock.wait_done()
        self.scaler.record_nonfinite_loss(control[NONFINITE])  # no loss scaling: skip, summed over the ranks
        with self.phases("update"):
            self.weights_whole()  # a gather in flight (a module forward skipped) must not race the update
            self.lr = self.optimizer.step(self.iteration)
        if self.shards is not None:
            with self.phases("gather"):  # communication, timed apart from the update it follows
                self.shards.gather_weights()  # waited for before the next forward reads them
        self.iteration += 1
        self.control.submit(self.iteration, reduce=False)  # summed by the reducer's collective

    def weights_whole(self) -> None:
        """With sharded masters: wait for the updated weights' all-gathers (before anything reads them)."""
        if self.shards is not None:
            self.shards.wait_weights()

    def time_phases(self, active: bool) -> None:
        """Start (or stop) timing the phases of the coming steps, from zero."""
        self.phases.reset()
        self.phases.active = active or self.tracer.enabled

    def phase_totals_ms(self) -> dict[str, float]:
        """Milliseconds per phase over the steps timed since :meth:`time_phases`."""
        return self.phases.totals_ms()

    # ------------------------------------------------------------------ test

    def test(self) -> dict[str, float]:
        """Top-1/top-5 over the whole test set, every sample counted once across ranks
        (``dptrain.train.scoring``); a stop request abandons it with StopAgreed."""
        self.weights_whole()
        bs = self.cfg.data.test_batch_size
        rounds = score_rounds(self.source.num_test, self.world_size, bs, self.cfg.solver.test_iter)
        feeder = self._feeder_for(self.source.test_batches(self.rank, self.world_size, bs))
        self.model.eval()
        try:
            with eager():  # rare: not worth a second compile for the evaluation graph
                counts = score(self._logits, feeder, rounds, num_classes=self.cfg.model.num_classes, comm=self.comm,
                               device=self.device, stops=self.stops)
            counts[BAD] += feeder.last_info.get("bad_records", 0)
        finally:
            feeder.close()
            self.model.train()
        self.comm.allreduce_sum_(counts)
        return score_record(counts.tolist())

    # ------------------------------------------------------------------ snapshots

    def _data_at(self, iteration: int) -> dict[str, Any]:
        """The data position and setup a snapshot records (and a resume compares); an image folder's
        class names too, which its labels follow."""
        data: dict[str, Any] = {"micro_step": iteration * self.setup.iter_size, "world_size": self.world_size,
                                "batch_size": self.setup.batch_size, "seed": self.cfg.train.seed}
        classes = getattr(self.source, "classes", None)
        if classes is not None:
            data["classes"] = list(classes)
        return data

    def save(self) -> Path | None:
        """Write snapshot_iter_<iteration>.pt (rank 0 gets its path); see ``dptrain.snapshots``."""
        self.weights_whole()
        return self.snapshots.save(self.iteration, self._data_at(self.iteration), self.window)

    def checkpoint(self) -> None:
        """A scheduled snapshot: first the loss-scale floor check, whose error names the culprits."""
        check_loss_scale_floor(self.scaler, self.overflow.most_often)
        self.save()

    def resume(self, path: Path) -> None:
        """Continue from snapshot ``path``: every rank checks first that all start at its iteration."""
        self.weights_whole()
        state = self.snapshots.resume(path, self._data_at)
        self._keep_attention(state["config"].get("model", {}).get("attention"))
        self.iteration = int(state["iteration"])
        self._feeder = None
        self.window.load(state["display"], self.rank, self.iteration)

    def _keep_attention(self, then: str | None) -> None:
        """A resume runs the snapshot's attention kernel where this run measured its own ("auto",
        eager): the same numerics as the interrupted run, whatever this start-up's timing said."""
        if (self.cfg.model.attention != "auto" or self.compiled is not None or then is None or then == self.attention
                or then not in (attention.TORCH, *attention.KERNELS)):
            return
        if self.rank == 0:
            log.info("model.attention: %s, as the snapshot's run chose (this start measured %s)", then, self.attention)
        self.attention = then
        self.snapshots.config["model"]["attention"] = then

    # ------------------------------------------------------------------ loop

    def _display(self) -> dict[str, Any]:
        """The display record (a host sync): loss and images/s since the last display, the
        scaler, overflow and straggler figures; warns where they call for it."""
        since = self.window.it_last
        window, ms_per_iter = self.window.close(self.iteration, self.comm, self.setup.global_batch)
        rec = {"iter": self.iteration,
               "epoch": round(self.iteration * self.setup.iter_size / self.setup.micro_steps_per_epoch, 4),
               **window, "lr": self.lr, **self.scaler.stats()}
        if self._feeder is not None and "bad_records" in self._feeder.last_info:
            rec["bad_records"] = self._feeder.last_info["bad_records"]  # skipped under data.max_bad_records
        overflowed = self.overflow.collect()
        if overflowed:
            rec["overflow_params"] = overflowed
            if self.rank == 0:
                log.warning("iter %d: %d step(s) skipped for overflow so far; non-finite gradients since iter %d in: "
                            "%s", self.iteration, rec["skipped_steps"], since, ", ".join(overflowed))
        rec.update(self.stragglers.gather(self.clock))
        warning = self.stragglers.judge(rec, ms_per_iter)
        if warning is not None and self.rank == 0:
            log.warning("%s", warning)
        check_loss_scale_floor(self.scaler, self.overflow.most_often)
        self.write_metrics(rec)
        log.info("iter %d loss %.4f lr %.5g %.1f img/s scale %g skipped %d", rec["iter"], rec["loss"], rec["lr"],
                 rec["images_per_s"], rec["loss_scale"], rec["skipped_steps"])
        self.window.restart_clock(self.iteration)  # the next images/s counts steps, not this display's work
        return rec

    def write_metrics(self, record: dict[str, Any]) -> None:
        """Append a record to metrics.jsonl (and TensorBoard); rank 0 only writes."""
        self.metrics.write(record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def fit(self) -> dict[str, Any]:
        """Train to solver.max_iter (or until SIGTERM/SIGUSR1/Ctrl-C); return the last metrics.

        Every stop goes one way (``dptrain.train.stops``): after the iteration a stop request
        reaches every rank, between test batches, or before a test starts, every rank raises
        StopAgreed at the same point, and fit writes a snapshot and returns. The final
        snapshot is written before the final test, so a stop during that test loses nothing.
        """
        s = self.cfg.solver
        if self.rank == 0:
            self.run_dir.prepare(dump_toml(self.cfg))
        log.info("%s", self.setup.describe())
        log.info("%s", self.optimizer.describe())
        if self.iteration >= s.max_iter:  # e.g. --resume auto on a finished run: its final test and snapshot exist
            log.warning("iteration %d is already at solver.max_iter = %d: nothing to train; raise solver.max_iter "
                        "to continue", self.iteration, s.max_iter)
            return {}
        with self.stop.installed():
            try:
                self._train_to(s.max_iter)
                self.stops.settle(self.control, self._observe)
                self.checkpoint()  # before the final test: a stop during it loses nothing
                return {**self._last, **self._test_and_log()}
            except StopAgreed:
                log.warning("rank %d: %s; snapshot at iteration %d and stop", self.rank, self.stops.why,
                            self.iteration)
                self.save()
                return {**self._last, "stopped_by_signal": True}

    def _train_to(self, max_iter: int) -> None:
        """Steps, displays, tests and snapshots up to ``max_iter``; raises StopAgreed on a stop."""
        s = self.cfg.solver
        bar = _progress(self.rank, max_iter, self.iteration)
        self.window.restart_clock(self.iteration)
        try:
            while self.iteration < max_iter:
                self.train_step()
                bar.update(1)
                self.stops.read(self.control, self.iteration, self._observe)
                self.unused.maybe_agree(self.iteration)
                it = self.iteration
                if s.display and it % s.display == 0:
                    self._last = self._display()
                if s.test_interval and it % s.test_interval == 0 and it < max_iter:
                    self.stops.settle(self.control, self._observe)
                    self.stops.vote(self.comm, self.device)
                    self._last = {**self._last, **self._test_and_log()}
                if s.snapshot and it % s.snapshot == 0 and it < max_iter:
                    self.checkpoint()
        finally:
            bar.close()

    def _test_and_log(self) -> dict[str, Any]:
        if self.source.num_test == 0:  # no data.test_path (or an empty one): no test phase, no made-up 0 %
            return {}
        log.info("iter %d: test phase over %d samples", self.iteration, self.source.num_test)
        res = self.test()
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
