"""One sweep run in its own process: ``python -m dflash_train.sweep.worker`` (started by run_sweep).

The parent writes the run as JSON on stdin, ``{"name", "values", "config", "threads"}``, where
``config`` is the run's full train config including ``storage_options``: stdin rather than a file
or the command line, so cache credentials never land on disk or in the process list. Output goes
to the run's log file (the parent redirects stdout and stderr); the exit status is 0 when the run
finished, 1 when it failed (the last ``error:`` line says why), 130 when interrupted.
"""

from __future__ import annotations

import json
import sys
import time

from dflash_common.errors import DFlashError
from dflash_common.progress import Progress

LOG_LINES_PER_PHASE = 20
"""Progress lines per phase (training, evaluation): enough to follow a run, few enough to read."""


class LogProgress(Progress):
    """Progress as plain timestamped lines, for a log file (a redrawn bar would fill it with \\r)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.total, self.done, self.every, self.desc, self.unit = None, 0, 1, "", ""

    def _line(self, text: str) -> None:
        self.stream.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
        self.stream.flush()

    def start(self, total, desc, unit):
        self.total, self.done, self.desc, self.unit = total, 0, desc, unit
        self.every = max(1, (total or 0) // LOG_LINES_PER_PHASE)
        self._line(f"{desc}: {total if total is not None else '?'} {unit}(s)")

    def advance(self, n, **stats):
        before, self.done = self.done, self.done + n
        if self.done // self.every > before // self.every or self.done == self.total:
            shown = " ".join(f"{k} {v}" for k, v in stats.items())
            self._line(f"{self.desc} {self.done}/{self.total if self.total is not None else '?'} {shown}".rstrip())

    def message(self, text):
        self._line(text)


def main() -> int:
    import torch

    from dflash_train.config import config_from_dict
    from dflash_train.settings.measure_config import MeasureConfig
    from dflash_train.sweep import SweepRun, train_run

    job = json.loads(sys.stdin.read())
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    run = SweepRun(name=job["name"], values=tuple((k, v) for k, v in job["values"]),
                   config=config_from_dict(job["config"]), seed=job.get("seed"),
                   measure=MeasureConfig(**job.get("measure", {})))
    progress = LogProgress()
    progress.message(f"run {run.name} on {run.config.device} with {torch.get_num_threads()} thread(s)")
    try:
        train_run(run, progress)
    except DFlashError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; rerun the sweep to resume", file=sys.stderr, flush=True)
        return 130
    progress.message(f"run {run.name} finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
