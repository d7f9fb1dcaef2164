"""What `dflash-train sweep` is given: the swept settings (GridAxis) and the sweep's own fields
(SweepConfig), each checked when built. Whether every run the sweep plans is a valid train config,
and whether torch can place a run on each device, is checked when the runs are planned
(dflash_train.sweep.plan.plan_runs, before anything trains)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from dflash_common.errors import ConfigError
from dflash_train.settings.measure_config import MeasureConfig
from dflash_train.settings.train_config import TrainConfig

SEED_PATHS = (("seed",), ("data", "seed"), ("noise", "seed"))
"""What a sweep's seed sets: the drafter's initial weights, the epoch order and anchors, the noise."""

DESIGNS = ("full", "one-at-a-time")

MAX_SWEEP_RUNS = 1000
"""Most runs one sweep plans (grid combinations times seeds; the full grid for one-at-a-time,
which is chosen from it): each is a training run, and planning checks every one's config."""

MAX_PARALLEL = 256
"""Most runs one sweep trains at once (each a process of its own)."""


def check_sweep_size(grid: Sequence[GridAxis], seeds: int | None, parallel: int) -> None:
    """Refuse a sweep larger than MAX_SWEEP_RUNS or MAX_PARALLEL, from the counts alone (before a
    combination is made), naming the counts and the fix."""
    combinations = 1
    for axis in grid:
        combinations *= len(axis.values)
    runs = combinations * (seeds or 1)
    if combinations > MAX_SWEEP_RUNS or runs > MAX_SWEEP_RUNS:
        counted = " x ".join(f"{len(a.values):,} {a.key}" for a in grid) + (f" x {seeds:,} seeds" if seeds else "")
        raise ConfigError(f"the sweep would plan {runs:,} runs ({counted}), more than the {MAX_SWEEP_RUNS:,} one sweep "
                          "plans; give fewer --grid values or --seeds (or split it into several sweeps)")
    if parallel > MAX_PARALLEL:
        raise ConfigError(f"--parallel {parallel:,} is more than the {MAX_PARALLEL} runs one sweep trains at once; pass "
                          f"--parallel {min(MAX_PARALLEL, runs)} or less")


def value_label(value: Any) -> str:
    """How a value reads in run names, tables and legends: strings bare, the rest as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))


@dataclass(frozen=True)
class GridAxis:
    """One swept setting and the values it takes."""

    key: str
    """Canonical key shown in run names and table headers: the short name, else the dotted path."""

    path: tuple[str, ...]
    """The config field it sets, e.g. ("loss", "kind") or ("steps",); () for an axis whose values
    only name bundles of settings, which its extras carry (e.g. "objective=ce+decay")."""

    values: tuple[Any, ...]
    """The values, in the order runs are made."""

    extras: tuple[tuple[tuple[str, Any], ...], ...] = ()
    """Further settings each value brings along, as ((dotted config path, value), ...) per value
    in the order of ``values`` (empty: none), e.g. the preset's noise=constant also sets
    noise.start=0.05. They are part of the run's config, not of its name."""

    def __post_init__(self):
        if not self.values:
            raise ConfigError(f"grid key {self.key!r} has no values; pass e.g. --grid {self.key}=a,b")
        if not self.path and len(self.extras) != len(self.values):
            raise ConfigError(f"grid key {self.key!r} sets no config field, so each of its values needs its field values "
                              "as extras; give one set per value")
        if self.extras and len(self.extras) != len(self.values):
            raise ConfigError(f"grid key {self.key!r} has {len(self.values)} values but {len(self.extras)} sets of "
                              "extra settings; give one (possibly empty) set per value")
        counts = Counter(value_label(v) for v in self.values)  # not list.count: a long axis would be quadratic
        repeated = sorted(x for x, n in counts.items() if n > 1)
        if repeated:
            shown = repeated[:5] + ([f"... {len(repeated) - 5:,} more"] if len(repeated) > 5 else [])
            raise ConfigError(f"grid key {self.key!r} repeats value(s) {shown}; list each value once")


@dataclass(frozen=True)
class SweepConfig:
    """What `dflash-train sweep` needs: a base train config and the values to sweep."""

    out: str
    """Sweep folder: runs/<name>/ per combination, results.csv, results.md, plots, sweep.json."""

    base: TrainConfig
    """Settings shared by every run (cache, steps, model, ...); its ``out`` is replaced per run."""

    grid: tuple[GridAxis, ...]
    """Swept settings (see parse_grid); every combination of their values is one run."""

    parallel: int | None = None
    """Runs trained at once, each in a process of its own with its log in runs/<name>/train.log; 1
    with no devices trains them one after the other in this process. Unset: one per entry of
    devices, or 1 when none are listed."""

    devices: tuple[str, ...] = ()
    """Devices of the parallel runs, e.g. cuda:0,cuda:1; slot i uses device i modulo their count, so a
    device listed twice (or parallel above the count) holds two runs at once. Empty: one slot per
    visible GPU when the base device is auto or cuda and CUDA is present, else the base device
    (on CPU the cores are shared out)."""

    seeds: int | None = None
    """Runs per combination with seeds 0..N-1: run i sets the drafter init, the anchor sampling and
    the noise all to i (SEED_PATHS), and summary.md gives each configuration's mean and 95%
    interval over them. Unset: one run per combination with the base config's seeds (no seed in
    the run names)."""

    design: str = "full"
    """"full": every combination of the grid; "one-at-a-time": only those that differ from a center
    (the reference, or a preset's) in at most one grid key, with --preset recipe plus the full
    recipe."""

    centers: tuple[tuple[tuple[str, Any], ...], ...] = ()
    """Combinations ((key, value), ...) around which "one-at-a-time" varies one key at a time
    (default: the reference alone)."""

    include: tuple[tuple[tuple[str, Any], ...], ...] = ()
    """Combinations "one-at-a-time" trains besides the centers' neighbours (e.g. the full recipe
    beside the paper recipe's one-part changes)."""

    reference: tuple[tuple[str, Any], ...] | None = None
    """The combination every other is compared with in summary.md (paired by seed); None: the
    first combination of the grid."""

    measure: MeasureConfig = field(default_factory=MeasureConfig)
    """Held-out tau during training and real decoding per run (dflash_train.sweep.measure)."""

    def __post_init__(self):
        if not str(self.out).strip():
            raise ConfigError("--out is empty; pass the sweep folder, e.g. --out sweeps/loss")
        if not self.grid:
            raise ConfigError("a sweep needs at least one --grid key=v1,v2 (e.g. --grid loss=ce,kl)")
        object.__setattr__(self, "grid", tuple(self.grid))
        if self.seeds is not None:
            if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
                raise ConfigError(f"--seeds must be a whole number of at least 1, got {self.seeds!r}; e.g. --seeds 3")
            swept = [a.key for a in self.grid if a.path in SEED_PATHS]
            if swept:
                raise ConfigError(f"--seeds sets {', '.join('.'.join(p) for p in SEED_PATHS)} itself; drop --grid "
                                  f"{swept[0]}=... or --seeds")
        parallel = self.parallel if self.parallel is not None else (len(self.devices) or 1)
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ConfigError(f"--parallel must be a whole number of at least 1, got {self.parallel!r}; e.g. --parallel 2")
        check_sweep_size(self.grid, self.seeds, parallel)
        if self.design not in DESIGNS:
            raise ConfigError(f"--design must be one of {', '.join(DESIGNS)}, got {self.design!r}")
        keys = [a.key for a in self.grid]
        for what, combo in ([("reference", self.reference)] + [("center", c) for c in self.centers]
                            + [("included combination", c) for c in self.include]):
            if combo is None:
                continue
            combo = tuple((k, v) for k, v in combo)
            known = {a.key: a.values for a in self.grid}
            if [k for k, _ in combo] != keys or any(v not in known[k] for k, v in combo):
                raise ConfigError(f"the {what} {dict(combo)} is not a combination of the grid ({keys}); "
                                  "give one value of every grid key")
        if self.measure.curve_points and self.base.steps is None and self.base.epochs is not None:
            raise ConfigError("held-out curve points need the run length in steps; pass --steps instead of --epochs")
        object.__setattr__(self, "devices", tuple(str(d).strip() for d in self.devices))
        if "auto" in self.devices:
            raise ConfigError("--devices lists concrete devices, got 'auto'; e.g. --devices cuda:0,cuda:1 "
                              "(or leave it out: one slot per visible GPU)")
        object.__setattr__(self, "parallel", parallel)

    @property
    def in_processes(self) -> bool:
        """Whether runs train in processes of their own (any parallel sweep, or devices chosen)."""
        return self.parallel > 1 or bool(self.devices)
