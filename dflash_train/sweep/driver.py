"""run_sweep: train every unfinished combination, then rewrite the comparison."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dflash_common.errors import CacheError, ConfigError
from dflash_common.files import LOCK_FILE, foreign_entries, holds, one_writer, refuse_links, write_file_atomic
from dflash_common.progress import Progress
from dflash_common.settings_files import load_settings_file
from dflash_train.settings.sweep_config import SweepConfig
from dflash_train.sweep.measure import REFERENCE_FILE, reference_outputs
from dflash_train.sweep.plan import SweepRun, plan_runs
from dflash_train.sweep.processes import (
    RunFailure,
    SweepError,
    cpu_count,
    device_slots,
    record_failure,
    train_in_processes,
    visible_gpus,
)
from dflash_train.sweep.recipe import SUMMARY_FILES
from dflash_train.sweep.report import SweepReport, sweep_record, write_report
from dflash_train.sweep.status import run_status, train_run


@dataclass(frozen=True)
class SweepResult:
    """What a sweep did and found."""

    out: Path
    """The sweep folder."""

    trained: tuple[str, ...]
    """Runs trained (or resumed) by this call."""

    skipped: tuple[str, ...]
    """Runs that were already finished."""

    report: SweepReport = field(repr=False)
    """The rewritten comparison."""


SWEEP_RECORD = "sweep.json"
SWEEP_ENTRIES = (SWEEP_RECORD, "results.csv", "results.md", "loss_curves.png", "acceptance_by_position.png",
                 *SUMMARY_FILES, REFERENCE_FILE, "runs", LOCK_FILE)
"""What a sweep writes in its folder; none of them may be a symlink."""


def check_sweep_folder(out: Path) -> None:
    """Refuse an --out that is not ours to write into, as a run folder is refused: a file, a
    sweep.json that is not a sweep's, or a non-empty folder without one (a sweep writes sweep.json
    first, so its results.csv, results.md and plots would replace a user's files)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder; choose a new or empty folder for the sweep")
    refuse_links(out / SWEEP_RECORD, out)
    record = out / SWEEP_RECORD
    if record.exists():
        try:
            values = load_settings_file(str(record))
        except ConfigError:
            values = None
        if isinstance(values, dict) and {"grid", "base", "runs"} <= set(values):
            return
        raise ConfigError(f"--out {out} holds a sweep.json that is not a dflash-train sweep's; choose a new or empty "
                          "folder (the sweep would overwrite it, results.csv, results.md and its plots)")
    foreign = foreign_entries(out, lambda entry: entry.name == LOCK_FILE
                              or entry.name.startswith(f".{SWEEP_RECORD}.tmp-"))
    if foreign:
        raise ConfigError(f"--out {out} is a non-empty folder that is not a dflash-train sweep (it holds "
                          f"{holds(foreign)}); choose a new or empty folder")


def run_sweep(cfg: SweepConfig, progress: Progress | None = None) -> SweepResult:
    """Train every unfinished combination, then rewrite the comparison.

    One after the other in this process by default; with ``cfg.in_processes``, each run in a
    process of its own, ``cfg.parallel`` at once. Either way a failed run raises SweepError only
    after the others finished and the report was written. Rerunning the same sweep skips finished runs
    and resumes interrupted or failed ones from their newest checkpoints. Every run folder is
    checked before anything trains, so a folder made with other settings stops the sweep at once
    rather than after hours of training.
    """
    from dflash_cache import open_cache

    progress = progress or Progress()
    runs = plan_runs(cfg)
    # A missing or half-built cache is reported now, not by the first run after the folders exist.
    if not open_cache(cfg.base.cache, cfg.base.storage_options).complete:
        raise CacheError(f"{cfg.base.cache} is an incomplete cache; rerun its `dflash-cache build` command to finish it")
    out = Path(cfg.out)
    check_sweep_folder(out)
    # two sweeps on one folder would train the same runs at once (each run's own lock stops the
    # second there, after its teacher outputs and sweep.json were rewritten): one sweep per folder
    with one_writer(out, "dflash-train sweep", f"wait for it to end (or stop it), or choose another --out than {out}"):
        return _sweep_locked(cfg, runs, out, progress)


def _sweep_locked(cfg: SweepConfig, runs: list[SweepRun], out: Path, progress: Progress) -> SweepResult:
    from dflash_cache import open_cache

    for name in SWEEP_ENTRIES:  # every write checks again; this says so before hours of training
        refuse_links(out / name, out)
    statuses = {run.name: run_status(run) for run in runs}  # refuses mismatched folders before writing
    write_file_atomic(out / SWEEP_RECORD, (json.dumps(sweep_record(cfg, runs), indent=1) + "\n").encode())
    if cfg.measure.teacher is not None and any(not s.finished for s in statuses.values()):
        progress.message(f"teacher's own greedy outputs for {', '.join(cfg.measure.prompts)} (once per sweep)")
        reference_outputs(cfg.measure, out, open_cache(cfg.base.cache, cfg.base.storage_options).chat_template_kwargs)
    todo = [run for run in runs if not statuses[run.name].finished]
    progress.message(f"sweep of {len(runs)} runs in {out}: {len(runs) - len(todo)} finished, {len(todo)} to train")
    failures: list[RunFailure] = []
    if cfg.in_processes and todo:
        needs_gpus = not cfg.devices and cfg.base.device in ("auto", "cuda")
        slots = device_slots(cfg.parallel, cfg.devices, cfg.base.device, visible_gpus() if needs_gpus else 0, cpu_count())
        resumable = {name for name, status in statuses.items() if status.resumable}
        failures = train_in_processes(todo, resumable, slots, progress)
    else:
        for i, run in enumerate(todo, 1):
            action = "resuming" if statuses[run.name].resumable else "training"
            progress.message(f"[{i}/{len(todo)}] {action} {run.name}")
            try:
                train_run(run, progress)
            except Exception as err:  # noqa: BLE001 - one failed run must not cost the others theirs
                failures.append(record_failure(run, err))
                progress.message(f"{run.name} failed ({failures[-1].reason}); the other runs go on")
    report = write_report(cfg, runs)
    progress.message(f"results: {out / 'results.csv'}, {out / 'results.md'}, {out / 'loss_curves.png'}, "
                     f"{out / 'acceptance_by_position.png'}")
    if failures:
        raise SweepError(failures)
    return SweepResult(out=out, trained=tuple(r.name for r in todo),
                       skipped=tuple(r.name for r in runs if statuses[r.name].finished), report=report)
