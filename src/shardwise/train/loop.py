"""The training loop: every step from the resumed one to the last, and what happens between steps.

`TrainingLoop(trainer, state).run()` is what `Trainer.train` runs once `setup` has built the state. Each
step takes its learning rate and micro-batches, and `trainer.train_step` queues the step on the device.
Then, in this order: the ranks' stop vote (SIGTERM / SIGUSR1, train.save_minutes) is read; the step's
figures are read from the device only when something needs them (a log line, a checkpoint, an
evaluation, the compile-time report); steps whose figures are in are booked in step order; then the
replica check, the log record, the checkpoint, the stop and the evaluation. A stop saves that step's
checkpoint on every rank and ends the loop; an error names a lost node or explains an out-of-memory.

The loop owns the run's observers: metrics.jsonl and the trackers (MetricsWriter), the progress bar, the
throughput window, the compile clock, the profiler, the end-of-run tally and the stop signals. What one
step does is the trainer's (`train_step`, `settle`, `save`, `evaluate`, `check_replicas`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import TrainingError
from ..hardware import device_peak
from ..memory.estimate import run_flops
from ..parallel.launch import lost_node_message
from ..units import GIB
from .metrics import CompileClock, MetricsWriter, MfuMeter, Window, format_record, reset_peak_memory
from .oom import device_memory_bytes, explain_out_of_memory, is_out_of_memory
from .profiling import StepProfiler
from .progress import logs_above_bar, progress_bar
from .run_summary import RunFigures, RunTally, summary_lines
from .step_result import StepResult
from .stop_signals import StopDecision, StopSignals, StopVote
from .trackers import FAILED, FINISHED, KILLED

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished (or stopped) run reports back."""

    run_dir: Path
    step: int
    losses: dict[int, float] = field(default_factory=dict)
    eval: dict[str, float] | None = None
    last_checkpoint: Path | None = None
    stopped_by: str | None = None  # the signal (SIGTERM, SIGUSR1) that stopped the run before its last step
    summary: list[str] = field(default_factory=list)  # the end-of-run summary lines (run_summary.py)


@dataclass(frozen=True)
class Due:
    """What the end of a step calls for."""

    logs: bool
    saves: bool
    evaluates: bool
    stops: bool  # a stop signal: save this step's checkpoint and end the run

    @property
    def anything(self) -> bool:
        return self.logs or self.saves or self.evaluates or self.stops


class TrainingLoop:
    """Runs a set-up trainer's steps, with its metrics, checkpoints, evaluations and stops."""

    def __init__(self, trainer: Any, state: Any) -> None:  # Trainer, TrainState (trainer.py builds both)
        self.trainer, self.state = trainer, state
        self.cfg = trainer.config
        self.result = TrainResult(run_dir=Path(self.cfg.train.output_dir), step=state.start)
        self.pending: list[StepResult] = []  # steps whose figures are not booked yet (still on the device)
        # The observers: opened by run() (`_open`), inside the block whose end closes them (`_close`).
        self.writer: MetricsWriter | None = None
        self.bar: Any = None
        self.profiler: StepProfiler | None = None
        self.signals: StopSignals | None = None

    def _open(self) -> None:
        """The observers: metrics and trackers, the progress bar, the clocks, the profiler, the stop signals."""
        cfg, s = self.cfg, self.state
        run_dir = self.result.run_dir
        self.mfu = MfuMeter(run_flops(cfg).total, device_peak(s.device, s.plan.dtype, cfg.train.peak_tflops,
                                                              measure=s.ctx.is_main))  # only rank 0 logs MFU
        self.writer = MetricsWriter(run_dir, loggers=cfg.train.loggers, config=cfg.model_dump(mode="json"),
                                    enabled=s.ctx.is_main, resume_step=s.start)
        self.bar = progress_bar(s.total_steps, s.start, cfg.train.progress_bar and s.ctx.is_main)
        self.window = Window(time.perf_counter())  # the figures since the last log record
        self.compile_clock = CompileClock(cfg.run.compile is True, self.window.start)
        reset_peak_memory(s.device)
        self.tally = RunTally(self.window.start)  # the figures of the end-of-run summary
        self.profiler = StepProfiler(cfg.train.profile, run_dir, s.device, s.ctx.rank).start(s.start + 1,
                                                                                               s.total_steps)
        self.signals = StopSignals().install()  # SIGTERM / SIGUSR1: stop after a step, with its checkpoint
        self.vote = StopVote(self.signals, cfg.train.save_minutes, s.ctx.is_main)

    def run(self) -> TrainResult:
        """Every remaining step; the result, with the end-of-run summary."""
        s = self.state
        status = FAILED  # how the trackers' runs end, until the loop ends without an error
        try:
            self._open()
            self.writer.check_started(s.ctx.world_size)  # a tracker that did not start on rank 0 stops every rank
            with logs_above_bar(self.bar):
                for step in range(s.start, s.total_steps):
                    if self._step(step):
                        break
                self.vote.close()
                with self.tally.aside():  # train.async_save: publish the last checkpoint (a failed write raises)
                    s.checkpointer.wait()
            self.tally.end()
            status = KILLED if self.result.stopped_by else FINISHED
        except KeyboardInterrupt:
            status = KILLED
            raise
        except Exception as exc:
            explained = self._explained(exc)
            if explained is None:
                raise
            raise explained from exc
        finally:
            self._close(status)
        self.result.summary = self._summary()
        return self.result

    # --- one step and what follows it -------------------------------------------------------------

    def _step(self, step: int) -> bool:
        """0-based step `step` and what its end calls for; True when a stop signal ended the run."""
        s, trainer = self.state, self.trainer
        lr = s.schedule.apply(s.optimizer, step)
        fetched = time.perf_counter()
        micro_batches = s.loader.next_step()
        self.tally.data_s += time.perf_counter() - fetched  # the host's time in the loader (no device sync)
        current = trainer.train_step(micro_batches, step)
        self.pending.append(current)
        done = self.result.step = step + 1
        self.bar.update(1)
        decision = self.vote.after_step()  # the same on every rank, after the same step
        due = self._due(done, decision)
        if due.anything or self.compile_clock.waiting:
            trainer.settle(current)  # nothing is saved, evaluated or logged past a step that must stop
        self._report_compile_time()
        self._book_settled()
        every = self.cfg.train.check_replicas_steps
        if every and done % every == 0:
            trainer.check_replicas(done)
        if due.logs:
            self._log(done, lr, current)
        if due.saves:  # save first: a failure during evaluation must not cost the step's checkpoint
            self._save(done)
        if due.stops:
            self._stop(done, decision)
            return True
        if due.evaluates:
            self._evaluate(done)
        # train.profile: a trace span is one whole iteration; writing its files is left out of the throughput
        spent = self.profiler.step(done)
        self.window.start += spent
        self.tally.set_aside(spent)
        return False

    def _due(self, done: int, decision: StopDecision) -> Due:
        t, total = self.cfg.train, self.state.total_steps
        last = done == total
        stops = bool(decision.signal) and not last
        return Due(
            logs=done % t.log_steps == 0 or last or stops,
            saves=bool(t.save_steps and done % t.save_steps == 0) or last or decision.save_due or stops,
            evaluates=not stops and self.trainer.eval_dataset is not None and (
                last or bool(t.eval_steps and done % t.eval_steps == 0)),
            stops=stops,
        )

    def _report_compile_time(self) -> None:
        if self.compile_clock.waiting:
            line = self.compile_clock.tick(time.perf_counter())
            if line:
                log.info(line)

    def _book_settled(self) -> None:
        """Book the steps whose figures are in, in step order (each step settles the one before it)."""
        while self.pending and self.pending[0].settled:
            out = self.pending.pop(0)
            self.result.losses[out.step + 1] = out.loss
            self.window.add(out.loss, out.tokens.real, out.tokens.target, out.skipped)
            self.tally.booked(out.tokens.real, out.skipped)

    def _log(self, done: int, lr: float, current: StepResult) -> None:
        s = self.state
        record = self.window.record(done, lr, current.grad_norm, current.scale, self.mfu, s.device, s.ctx.world_size)
        record.update(current.rewards())  # preference tuning: the logged step's reward margin and accuracy
        load = current.expert_load()
        if load:  # mixture of experts: the logged step's busiest expert over the mean, per MoE block
            record["expert_load"] = load
        read = s.loader.samples_by_source()
        if read:  # a mixture of data sources: tokens read from each since the run's start, over all ranks
            seq = s.loader.dataset.seq_length
            record["tokens_by_source"] = {name: samples * seq for name, samples in read.items()}
        self.writer.write(record)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        log.info(format_record(record))
        self.window = Window(time.perf_counter())
        self.tally.last_record = record

    def _save(self, done: int) -> None:
        with self.tally.aside():
            self.result.last_checkpoint = self.trainer.save(done)
        self.tally.checkpoints += 1
        self.vote.saved()
        self.window.start = time.perf_counter()  # the save is left out of the next record's throughput

    def _stop(self, done: int, decision: StopDecision) -> None:
        with self.tally.aside():
            self.state.checkpointer.wait()  # train.async_save: published before the process ends
        self.result.stopped_by = decision.signal_name
        log.info("stopped by %s after step %d: checkpoint %s saved; continue with --resume auto",
                 self.result.stopped_by, done, self.result.last_checkpoint.name)

    def _evaluate(self, done: int) -> None:
        with self.tally.aside():
            result = self.result.eval = self.trainer.evaluate()
        self.writer.write({"step": done, **{f"eval_{k}": v for k, v in result.items()}})
        by_source = "".join(f", {name} {loss:.4f}" for name, loss in result.get("loss_by_source", {}).items())
        if "reward_accuracy" in result:  # preference tuning: a pair loss, no perplexity
            log.info("step %d eval loss %.4f reward accuracy %.3f margin %.4f", done, result["loss"],
                     result["reward_accuracy"], result["reward_margin"])
        else:
            log.info("step %d eval loss %.4f perplexity %.2f%s", done, result["loss"], result["perplexity"], by_source)
        self.window.start = time.perf_counter()  # evaluation is left out of the next record's throughput

    # --- the end of the run -----------------------------------------------------------------------

    def _explained(self, exc: Exception) -> TrainingError | None:
        """A clearer error for a lost node (a collective's peer went away: which node, not gloo's words
        alone) or an out-of-memory (what to change); None for anything else."""
        s = self.state
        lost = lost_node_message(exc, s.ctx.rank) if isinstance(exc, RuntimeError) else None
        if lost:
            return TrainingError(lost)
        if not is_out_of_memory(exc):
            return None
        pp_rank = s.meshes["pp"].get_local_rank() if s.dims.pp > 1 else 0
        return TrainingError(explain_out_of_memory(self.cfg, s.ctx.world_size, s.ctx.rank, self.trainer.phase,
                                                   s.device, pp_rank, s.ctx.local_world_size))

    def _close(self, status: str) -> None:
        """Whatever happened: the profile written, the signal handlers back, an earlier finished step's
        pending save published, the loader's workers, the bar, the metrics and the trackers' runs closed
        (`status`: FINISHED, FAILED or KILLED); an observer that `_open` did not get to is skipped."""
        s = self.state
        if self.profiler is not None:
            self.profiler.stop()
        if self.signals is not None:
            self.signals.restore()
        s.checkpointer.wait(training_failed=True)
        s.loader.close()
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close(status)

    def _summary(self) -> list[str]:
        """The end-of-run summary (run_summary.py): its lines, logged (by rank 0: the others log warnings only)."""
        s, cfg, tally, result = self.state, self.cfg, self.tally, self.result
        wall, in_steps = tally.elapsed(), tally.step_s()
        capacity = device_memory_bytes(s.device)
        record = tally.last_record or {}
        figures = RunFigures(
            steps=tally.steps, last_step=result.step, tokens=tally.tokens, wall_s=wall, data_s=tally.data_s,
            mfu=self._mfu(tally.tokens, wall), step_s=in_steps, step_mfu=self._mfu(tally.tokens, in_steps),
            compiled=cfg.run.compile is True,
            peak_memory_gb=record.get("peak_memory_gb", float("nan")), capacity_gb=capacity / GIB if capacity else None,
            device_type=s.device.type, final_loss=result.losses.get(result.step, float("nan")),
            eval_loss=result.eval["loss"] if result.eval else None, checkpoints=tally.checkpoints,
            skipped_steps=tally.skipped, mixed_precision=cfg.optimize.mixed_precision, recompute=cfg.optimize.recompute)
        lines = summary_lines(figures)
        for line in lines:
            log.info(line)
        return lines

    def _mfu(self, tokens: int, seconds: float) -> float:
        """The model FLOPs utilisation of `tokens` (all ranks') in `seconds`, per device."""
        return self.mfu.of(tokens / seconds / self.state.ctx.world_size)[0] if seconds > 0 else float("nan")
