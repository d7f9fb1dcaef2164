"""Runs in processes of their own: device slots, which waiting run starts where, failures and
their logs."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Iterable, Sequence

from dflash_common.errors import DFlashError
from dflash_common.files import open_append
from dflash_common.progress import Progress
from dflash_train.sweep.plan import SweepRun

LOG_FILE = "train.log"
"""Name of a run's log in its folder when it trains in its own process (appended to on resume)."""

POLL_SECONDS = 0.2
"""How often the sweep looks for finished run processes (runs last minutes; this costs nothing)."""


@dataclass(frozen=True)
class Slot:
    """A place where one run trains at a time."""

    index: int
    """0-based slot number."""

    device: str
    """The device the run's config gets, e.g. "cuda:1" or "cpu"."""

    threads: int
    """CPU threads (torch, OpenMP) of the run's process: its share of the cores."""


def device_slots(parallel: int, devices: Sequence[str], base_device: str, gpus: int, cpus: int) -> tuple[Slot, ...]:
    """The ``parallel`` slots of a sweep: listed devices round-robin; else one per visible GPU
    when the base device is auto or cuda and ``gpus`` > 0; else the base device ("auto" meaning
    cpu). Each slot's process gets an equal share of ``cpus`` threads (at least one), so N CPU
    runs at once do not each start as many threads as there are cores."""
    if devices:
        chosen = [devices[i % len(devices)] for i in range(parallel)]
    elif base_device in ("auto", "cuda") and gpus > 0:
        chosen = [f"cuda:{i % gpus}" for i in range(parallel)]
    else:
        chosen = ["cpu" if base_device == "auto" else base_device] * parallel
    share, extra = divmod(max(cpus, 1), parallel)
    return tuple(Slot(i, device, max(1, share + (i < extra))) for i, device in enumerate(chosen))


def assign_runs(pending: Sequence[str], slots: Sequence[Slot], busy: Collection[int]) -> list[tuple[str, Slot]]:
    """Which waiting runs start now, and where: the next runs in grid order, each into the free
    slot whose device holds the fewest running runs (then the lowest slot), so runs spread over
    the GPUs before any GPU takes a second one."""
    load = Counter(slot.device for slot in slots if slot.index in busy)
    free = [slot for slot in slots if slot.index not in busy]
    started = []
    for name in pending:
        if not free:
            break
        slot = min(free, key=lambda s: (load[s.device], s.index))
        free.remove(slot)
        load[slot.device] += 1
        started.append((name, slot))
    return started


def worker_job(run: SweepRun, slot: Slot) -> dict:
    """What the run's process reads on stdin (see dflash_train.sweep.worker)."""
    config = dataclasses.replace(run.config, device=slot.device)
    values = config.to_dict()
    values["storage_options"] = config.storage_options  # to_dict leaves it out; stdin never hits disk
    return {"name": run.name, "values": [[k, v] for k, v in run.values], "config": values, "threads": slot.threads,
            "seed": run.seed, "measure": dataclasses.asdict(run.measure)}


def failure_reason(log_text: str, exit_code: int) -> str:
    """One line saying why a run's process failed, from its log (this session's part): its last
    ``error:`` line, else the last line (an uncaught exception's), else the exit status."""
    session = log_text.rsplit("\n=== ", 1)[-1]
    lines = [line.strip() for line in session.splitlines()[1:] if line.strip()]
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    if errors:
        reason = errors[-1]
    elif lines:
        reason = lines[-1]
    else:
        reason = "no output"
    if exit_code < 0:
        reason = f"killed by signal {-exit_code} (out of memory?); last output: {reason}"
    return _clipped(reason)


def _clipped(reason: str) -> str:
    return reason if len(reason) <= 300 else reason[:297] + "..."


@dataclass(frozen=True)
class RunFailure:
    """A failed run: its process exited non-zero, or (serial sweeps) its training raised."""

    name: str
    log: Path
    exit_code: int
    reason: str
    """One line from its log (see failure_reason) or its error (see record_failure)."""


def record_failure(run: SweepRun, err: Exception) -> RunFailure:
    """A run that failed in this process: its error (with the traceback for anything but the
    package's own one-line errors) appended to the run's log, as a run in a process of its own
    leaves it there."""
    folder = Path(run.config.out)
    folder.mkdir(parents=True, exist_ok=True)
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    detail = "" if isinstance(err, DFlashError) else "".join(traceback.format_exception(err))
    with os.fdopen(open_append(folder / LOG_FILE, sweep_folder(run)), "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} sweep: {run.name} failed in the sweep's process\n"
                  f"{detail}error: {reason}\n")
    return RunFailure(name=run.name, log=folder / LOG_FILE, exit_code=1, reason=_clipped(reason))


class SweepError(DFlashError):
    """Runs of a sweep failed; the others finished and the report was written."""

    def __init__(self, failures: Sequence[RunFailure]):
        self.failures = tuple(failures)
        listed = ", ".join(f"{f.name} (exit {f.exit_code}: {f.reason}; log {f.log})" for f in self.failures)
        super().__init__(f"{len(self.failures)} sweep run(s) failed: {listed}; the other runs finished and the "
                         "report was written; fix the cause and rerun the same command to resume")


def sweep_folder(run: SweepRun) -> Path:
    """The sweep folder a run's folder (OUT/runs/NAME) is in: no link below it is followed."""
    return Path(run.config.out).parent.parent


def _log_tail(path: Path, size: int = 65536) -> str:
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - size))
        return f.read(size).decode(errors="replace")


def _start(run: SweepRun, slot: Slot, action: str) -> subprocess.Popen:
    folder = Path(run.config.out)
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(slot.threads), MKL_NUM_THREADS=str(slot.threads), PYTHONUNBUFFERED="1")
    with os.fdopen(open_append(folder / LOG_FILE, sweep_folder(run)), "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} sweep: {action} {run.name} on {slot.device}, "
                  f"{slot.threads} thread(s)\n")
        log.flush()
        # A fresh interpreter, not a fork: no CUDA context, thread pool or open cache is shared.
        proc = subprocess.Popen([sys.executable, "-m", "dflash_train.sweep.worker"], stdin=subprocess.PIPE,
                                stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        proc.stdin.write(json.dumps(worker_job(run, slot)))
        proc.stdin.close()
    except OSError:
        pass  # it died before reading; its exit status and log say why
    return proc


class SweepStopped(DFlashError):
    """The sweep was asked to stop (SIGTERM) while runs trained in processes of their own."""


def _stopped_by_signal(signum, frame) -> None:
    raise SweepStopped(f"the sweep was stopped by signal {signal.Signals(signum).name}; its running runs were stopped "
                       "too and resume from their newest checkpoints: rerun the same command to go on")


def _stop(procs: Iterable[subprocess.Popen]) -> None:
    """End the runs still going (SIGTERM, then SIGKILL after 30 s) and wait for each."""
    procs = [p for p in procs if p.poll() is None]
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def train_in_processes(todo: Sequence[SweepRun], resumable: Collection[str], slots: Sequence[Slot],
                       progress: Progress) -> list[RunFailure]:
    """Train ``todo`` in processes of their own, at most one per slot at a time; a failed run
    does not stop the others. Returns the failures, in the order they happened."""
    pending, failures = list(todo), []
    running: dict[int, tuple[SweepRun, subprocess.Popen, float]] = {}
    started = 0
    progress.start(len(todo), "sweep", "run")
    # SIGTERM (a scheduler, `kill`) would end this process at once and leave its runs training as
    # orphans: it raises here instead, so the finally below stops the runs and waits for them
    handles = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stopped_by_signal) if handles else None
    try:
        while pending or running:
            for name, slot in assign_runs([r.name for r in pending], slots, running):
                run = next(r for r in pending if r.name == name)
                pending.remove(run)
                started += 1
                action = "resuming" if name in resumable else "training"
                progress.message(f"[{started}/{len(todo)}] {action} {name} on {slot.device} "
                                 f"({slot.threads} thread(s)), log {Path(run.config.out) / LOG_FILE}")
                running[slot.index] = (run, _start(run, slot, action), time.monotonic())
            while not (ended := [i for i, (_, proc, _) in running.items() if proc.poll() is not None]):
                time.sleep(POLL_SECONDS)
            for index in ended:
                run, proc, began = running.pop(index)
                log = Path(run.config.out) / LOG_FILE
                if proc.returncode == 0:
                    progress.message(f"{run.name} finished in {time.monotonic() - began:,.0f} s")
                else:
                    failure = RunFailure(run.name, log, proc.returncode, failure_reason(_log_tail(log), proc.returncode))
                    failures.append(failure)
                    progress.message(f"{run.name} FAILED (exit {failure.exit_code}: {failure.reason}); log {log}")
                progress.advance(1)
    finally:
        if handles:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the waiting short
        try:
            _stop(proc for _, proc, _ in running.values())  # interrupted: leave no run behind
        finally:
            if handles:
                signal.signal(signal.SIGTERM, previous)
            progress.close()
    return failures


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
