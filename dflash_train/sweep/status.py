"""What a run folder already holds (its metrics, whether it is finished), and training or resuming
one run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from dflash_common.errors import ConfigError
from dflash_common.files import refuse_links
from dflash_common.progress import Progress
from dflash_common.settings_files import load_settings_file
from dflash_train.config import config_differences
from dflash_train.sweep.measure import (
    REFERENCE_FILE,
    measure_run,
    read_measure,
    read_reference,
    write_measure,
)
from dflash_train.sweep.plan import SweepRun
from dflash_train.sweep.processes import sweep_folder


@dataclass(frozen=True)
class RunMetrics:
    """A run's metrics.jsonl, one record per step (the latest wins: a resumed run repeats steps)."""

    train: tuple[dict, ...]
    """Train records in step order."""

    evals: dict[int, dict]
    """Eval records by step (step 0: before training; the last train step: after)."""

    @property
    def last_step(self) -> int:
        return self.train[-1]["step"] if self.train else 0

    @property
    def final_eval(self) -> dict:
        """The held-out evaluation after the last train step ({} when there is none)."""
        return self.evals.get(self.last_step, {}) if self.last_step > 0 else {}

    @property
    def final_train(self) -> dict:
        return self.train[-1] if self.train else {}


def parse_metrics(lines: Iterable[str]) -> RunMetrics:
    """RunMetrics from metrics.jsonl lines."""
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill mid-write; the resumed run rewrites that step
        if not isinstance(record, dict) or "step" not in record:
            continue
        (evals if record.get("kind") == "eval" else train)[int(record["step"])] = record
    return RunMetrics(tuple(train[s] for s in sorted(train)), evals)


def read_metrics(run_dir: str | Path) -> RunMetrics:
    path = Path(run_dir) / "metrics.jsonl"
    return parse_metrics(path.read_text().splitlines() if path.exists() else [])


def is_finished(has_export: bool, metrics: RunMetrics, expects_eval: bool) -> bool:
    """A run is finished when train() got to its end: the drafter is exported (train's last act)
    and, when it evaluates, the held-out record after the last step is written."""
    return has_export and metrics.last_step > 0 and (not expects_eval or bool(metrics.final_eval))


@dataclass(frozen=True)
class RunStatus:
    """What a run folder already holds."""

    finished: bool
    """Trained to the end, evaluated, exported and (when the sweep measures) measured: nothing to do."""

    trained: bool
    """Trained to the end, evaluated and exported."""

    resumable: bool
    """Has a complete checkpoint, so train(resume=True) continues from it."""


def run_status(run: SweepRun) -> RunStatus:
    """Inspect a run folder; a folder made with other settings is refused (its results would be
    reported under the wrong name)."""
    from dflash_train.training.checkpoint import CheckpointManager
    from dflash_train.training.export import CONFIG_FILE, WEIGHTS_FILE
    from dflash_train.training.run_folder import check_run_folder

    folder = Path(run.config.out)
    refuse_links(folder, sweep_folder(run))  # a run folder linked elsewhere would be written there
    check_run_folder(folder)  # no links where a run writes; a config.json that is a run's
    saved = folder / "config.json"
    if saved.exists():
        values = load_settings_file(str(saved), fix="move the folder away (or delete it) and rerun the sweep")
        differences = config_differences(values, run.config.to_dict())
        if differences:
            said = "; ".join(f"{path}: {before!r} vs {after!r}" for path, before, after in differences)
            raise ConfigError(f"{folder} was made with other settings ({said}); "
                              "rerun the sweep with its original options or use a new --out")
    export = folder / "drafter"
    has_export = (export / CONFIG_FILE).exists() and (export / WEIGHTS_FILE).exists()
    trained = is_finished(has_export, read_metrics(folder), run.config.eval_sequences > 0)
    measured = not run.measure.active or run.measure.covers(read_measure(folder))
    resumable = CheckpointManager(folder / "checkpoints").latest() is not None
    return RunStatus(finished=trained and measured, trained=trained, resumable=resumable)


def train_run(run: SweepRun, progress: Progress | None = None) -> None:
    """Train one combination to the end, resuming from its newest checkpoint when it has one,
    then measure it when the sweep asks (curve points, real decoding)."""
    from dflash_train.training.trainer import train

    status = run_status(run)
    if not status.trained:
        train(run.config, resume=status.resumable, progress=progress)
    if run.measure.active and not run.measure.covers(read_measure(run.config.out)):
        reference = None
        if run.measure.teacher is not None:
            reference = read_reference(sweep_folder(run) / REFERENCE_FILE)
        write_measure(run.config.out, measure_run(run.config, read_metrics(run.config.out), run.measure, reference, progress))
