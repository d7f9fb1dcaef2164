"""Many loss experiments against one cache: a grid of config values, one train run per combination.

``run_sweep(SweepConfig)`` expands the grid, trains every combination that is not finished yet
(an interrupted one resumes from its last checkpoint), then rewrites the comparison from all runs'
metrics: ``results.csv``, ``results.md``, ``loss_curves.png`` and ``acceptance_by_position.png``.
``sweep.json`` records the grid and the base config.

Layout of ``out``::

    sweep.json  results.csv  results.md  loss_curves.png  acceptance_by_position.png
    runs/<name>/   a normal `dflash-train run` folder per combination
    runs/<name>/train.log   the run's output when it ran in its own process, or its error when
                            it failed in this one (see below)

With ``parallel = 1`` and no ``devices`` (the default) runs are trained one after the other in this
process. Otherwise each run is trained in a fresh Python process (``python -m
dflash_train.sweep.worker``), at most ``parallel`` at once, each in a device slot of its own
(``device_slots``: one per listed device or visible GPU; on CPU each takes its share of the cores);
``assign_runs`` (pure) decides which waiting run starts in which free slot. Either way a run that
fails does not stop the others: the report is written from the runs that finished, then the sweep
raises a SweepError naming every failed run and its log.

The pieces are separate so other launchers (a cluster scheduler) can reuse them: ``plan_runs``
(pure: every combination's name and TrainConfig), ``run_status`` (what a run folder already
holds), ``train_run`` (train or resume one run; replace its config's ``device`` first), and
``write_report`` once every run is done.

Its config (``SweepConfig``, and ``GridAxis``, one swept setting) is in
``dflash_train.settings.sweep_config`` with the other sections; planning the runs checks what the
fields alone cannot (every run's TrainConfig, each device). Modules, in the order a sweep uses them: ``grid`` (keys, values, combinations, run names),
``plan`` (the sweep's config built from a command line's parts, seeds, designs, presets, every run's TrainConfig), ``status``
(what a run folder holds; train one run), ``processes`` (runs in processes of their own, and
``worker``, the process), ``report`` and ``plots`` (the comparison), ``recipe`` (what a sweep
with seeds measures after each run, and the statistics of its summary), ``driver`` (run_sweep).
"""

from dflash_train.settings.sweep_config import GridAxis, SweepConfig
from dflash_train.sweep.driver import SweepResult, run_sweep
from dflash_train.sweep.grid import expand_grid, parse_grid, run_name, run_overrides
from dflash_train.sweep.plan import (
    FULL_RECIPE,
    PAPER_RECIPE,
    PRESETS,
    SweepRun,
    one_factor_neighbours,
    plan_runs,
    planned_combinations,
    preset,
    sweep_config,
)
from dflash_train.sweep.processes import Slot, SweepError, assign_runs, device_slots, failure_reason
from dflash_train.sweep.report import SweepReport, alpha_columns, write_report
from dflash_train.sweep.status import is_finished, parse_metrics, run_status, train_run

__all__ = ["SweepResult", "run_sweep", "GridAxis", "expand_grid", "parse_grid", "run_name", "run_overrides", "FULL_RECIPE",
           "PAPER_RECIPE", "PRESETS", "SweepConfig", "SweepRun", "one_factor_neighbours", "plan_runs",
           "planned_combinations", "preset", "sweep_config", "Slot", "SweepError", "assign_runs", "device_slots", "failure_reason",
           "SweepReport", "alpha_columns", "write_report", "is_finished", "parse_metrics", "run_status", "train_run"]

