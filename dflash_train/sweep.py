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
dflash_train.sweep_worker``), at most ``parallel`` at once, each in a device slot of its own
(``device_slots``: one per listed device or visible GPU; on CPU each takes its share of the cores);
``assign_runs`` (pure) decides which waiting run starts in which free slot. Either way a run that
fails does not stop the others: the report is written from the runs that finished, then the sweep
raises a SweepError naming every failed run and its log.

The pieces are separate so other launchers (a cluster scheduler) can reuse them: ``plan_runs``
(pure: every combination's name and TrainConfig), ``run_status`` (what a run folder already
holds), ``train_run`` (train or resume one run; replace its config's ``device`` first), and
``write_report`` once every run is done.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterable, Sequence

from dflash_common.errors import CacheError, ConfigError, DFlashError
from dflash_common.progress import Progress
from dflash_train.config import TrainConfig, config_differences, config_from_dict, merge
from dflash_train.recipe import (
    REFERENCE_FILE,
    MeasureConfig,
    RunOutcome,
    measure_run,
    read_measure,
    reference_outputs,
    write_measure,
    write_summary,
)

# Short grid keys -> config field paths. One short name per path, so a run's name is the same
# whether the user typed the short name or the dotted path.
GRID_ALIASES: dict[str, tuple[str, ...]] = {
    "loss": ("loss", "kind"),
    "mix_lambda": ("loss", "mix_lambda"),
    "weighting": ("loss", "weighting"),
    "gamma": ("loss", "gamma"),
    "streak_smoothing": ("loss", "streak_smoothing"),
    "streak_decay": ("loss", "streak_decay"),
    "noise": ("noise", "schedule"),
    "noise_distribution": ("noise", "distribution"),
    "noise_start": ("noise", "start"),
    "noise_end": ("noise", "end"),
    "lr": ("optim", "lr"),
    "min_lr_ratio": ("optim", "min_lr_ratio"),
    "warmup_steps": ("optim", "warmup_steps"),
    "weight_decay": ("optim", "weight_decay"),
    "grad_clip": ("optim", "grad_clip"),
    "grad_accum": ("optim", "grad_accum"),
    "block_size": ("model", "block_size"),
    "num_layers": ("model", "num_layers"),
    "num_anchors": ("data", "num_anchors"),
    "batch_tokens": ("data", "batch_tokens"),
    "data_seed": ("data", "seed"),
    "steps": ("steps",),
    "epochs": ("epochs",),
    "seed": ("seed",),
}

# Fields every run of a sweep must share: the cache and folders are the sweep's own, and the
# held-out sequences must be the same for the results to be comparable.
SHARED_FIELDS: dict[tuple[str, ...], str] = {
    ("cache",): "the sweep trains every run on one cache",
    ("out",): "run folders are named by the sweep",
    ("storage_options",): "the sweep reads one cache",
    ("eval_sequences",): "every run is evaluated on the same held-out sequences",
    ("data", "heldout_fraction"): "every run is evaluated on the same held-out split",
}

ALPHA_POSITIONS = (1, 2, 4)
"""Block positions whose held-out alpha gets a table column (plus the last position)."""

MAX_NAME_CHARS = 120
_SAFE_TOKEN = re.compile(r"[A-Za-z0-9._+-]+")


# ----------------------------------------------------------------------------- grid parsing


def config_field_paths() -> dict[str, tuple[str, ...]]:
    """Every settable TrainConfig field as "section.name" (or "name" at the top level) -> path."""
    default = TrainConfig(cache="", out="")
    paths: dict[str, tuple[str, ...]] = {}
    for f in dataclasses.fields(TrainConfig):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            for sub in dataclasses.fields(value):
                paths[f"{f.name}.{sub.name}"] = (f.name, sub.name)
        else:
            paths[f.name] = (f.name,)
    return paths


def resolve_grid_key(key: str) -> tuple[str, tuple[str, ...]]:
    """(canonical key, config path) of a grid key: a short name or a dotted config path."""
    key = key.strip()
    if key in GRID_ALIASES:
        path = GRID_ALIASES[key]
    else:
        path = config_field_paths().get(key)
        if path is None:
            fields = [name for name, p in config_field_paths().items() if p not in SHARED_FIELDS]
            raise ConfigError(f"unknown grid key {key!r}; use a short key ({', '.join(GRID_ALIASES)}) "
                              f"or a config field ({', '.join(fields)})")
    if path in SHARED_FIELDS:
        raise ConfigError(f"grid key {key!r} cannot vary in a sweep ({SHARED_FIELDS[path]}); "
                          "set it once with --set or the config file")
    short = {p: k for k, p in GRID_ALIASES.items()}
    return short.get(path, ".".join(path)), path


def split_values(text: str) -> list[str]:
    """Split "a,b,[1,2]" at the commas outside brackets, braces and double quotes."""
    parts, current, depth, quoted = [], [], 0, False
    for i, ch in enumerate(text):
        if ch == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and ch in "[{":
            depth += 1
        elif not quoted and ch in "]}":
            depth -= 1
        if ch == "," and depth == 0 and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts]


def parse_value(text: str) -> Any:
    """A grid value: JSON when it parses (0.3, 7, true, null, [0, 1]), else the plain string."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return _tuples(value)


def _tuples(value: Any) -> Any:
    # Config tuples (betas, sliding_layers, noise layers) arrive as JSON lists; tuples keep the
    # frozen configs hashable and compare equal to what config_from_dict builds.
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


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
    """The config field it sets, e.g. ("loss", "kind") or ("steps",)."""

    values: tuple[Any, ...]
    """The values, in the order runs are made."""

    extras: tuple[tuple[tuple[str, Any], ...], ...] = ()
    """Further settings each value brings along, as ((dotted config path, value), ...) per value
    in the order of ``values`` (empty: none), e.g. the preset's noise=constant also sets
    noise.start=0.05. They are part of the run's config, not of its name."""

    def __post_init__(self):
        if not self.values:
            raise ConfigError(f"grid key {self.key!r} has no values; pass e.g. --grid {self.key}=a,b")
        if self.extras and len(self.extras) != len(self.values):
            raise ConfigError(f"grid key {self.key!r} has {len(self.values)} values but {len(self.extras)} sets of "
                              "extra settings; give one (possibly empty) set per value")
        labels = [value_label(v) for v in self.values]
        repeated = sorted({x for x in labels if labels.count(x) > 1})
        if repeated:
            raise ConfigError(f"grid key {self.key!r} repeats value(s) {repeated}; list each value once")


def parse_grid_item(text: str) -> GridAxis:
    """One --grid option, "key=v1,v2,...", as a GridAxis."""
    key, sep, values = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--grid takes key=value1,value2,..., got {text!r}; e.g. --grid loss=ce,kl")
    canonical, path = resolve_grid_key(key)
    raw = split_values(values)
    if any(not v for v in raw):
        raise ConfigError(f"--grid {text!r} has an empty value; separate values with single commas, e.g. {canonical}=a,b")
    return GridAxis(canonical, path, tuple(parse_value(v) for v in raw))


def parse_grid(items: Iterable[str]) -> tuple[GridAxis, ...]:
    """All --grid options; each config field may be swept by one option only."""
    axes = tuple(parse_grid_item(item) for item in items)
    seen: dict[tuple[str, ...], str] = {}
    for axis in axes:
        if axis.path in seen:
            raise ConfigError(f"grid key {axis.key!r} is given twice ({'.'.join(axis.path)}); "
                              f"put all its values in one --grid {axis.key}=a,b,...")
        seen[axis.path] = axis.key
    return axes


# ----------------------------------------------------------------------------- expansion and names


def expand_grid(axes: Sequence[GridAxis]) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination as ((key, value), ...) in grid order; the first key varies slowest."""
    return [tuple(zip((a.key for a in axes), combo)) for combo in itertools.product(*(a.values for a in axes))]


def _safe_token(text: str) -> str:
    if _SAFE_TOKEN.fullmatch(text):
        return text
    # Keep what is readable and add a hash of the original, so distinct values stay distinct.
    slug = re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-") or "value"
    return f"{slug}-{hashlib.sha1(text.encode()).hexdigest()[:6]}"


def run_name(assignment: Sequence[tuple[str, Any]]) -> str:
    """Folder name of one combination: (("loss", "kl"), ("noise", "cosine")) -> "loss-kl_noise-cosine".

    Only letters, digits and ``._+-`` appear, so the name is safe on every filesystem and object
    store; it depends on the values alone, so rerunning the same sweep finds the same folders.
    Other characters become "-" plus a hash of the value, so distinct values keep distinct names.
    """
    name = "_".join(f"{_safe_token(key)}-{_safe_token(value_label(value))}" for key, value in assignment)
    if len(name) > MAX_NAME_CHARS:
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = f"{name[:MAX_NAME_CHARS - 11]}-{digest}"
    return name


def _set_path(out: dict, path: Sequence[str], value: Any) -> None:
    *sections, last = path
    target = out
    for section in sections:
        target = target.setdefault(section, {})
    target[last] = list(value) if isinstance(value, tuple) else value


def run_overrides(axes: Sequence[GridAxis], assignment: Sequence[tuple[str, Any]]) -> dict:
    """Nested config values that one combination sets."""
    out: dict = {}
    for axis, (_, value) in zip(axes, assignment):
        _set_path(out, axis.path, value)
        if axis.extras:
            for dotted, extra in axis.extras[axis.values.index(value)]:
                _set_path(out, dotted.split("."), extra)
        # steps and epochs are exclusive: a swept one replaces the base's other one.
        if axis.path == ("steps",):
            out["epochs"] = None
        elif axis.path == ("epochs",):
            out["steps"] = None
    return out


SEED_PATHS = (("seed",), ("data", "seed"), ("noise", "seed"))
"""What a sweep's seed sets: the drafter's initial weights, the epoch order and anchors, the noise."""

SEED_KEY = "seed"
"""The column and run-name part of a sweep's seed."""

DESIGNS = ("full", "one-at-a-time")


def seed_overrides(seed: int) -> dict:
    """Nested config values of replicate ``seed``: the same number for every seed of the run."""
    out: dict = {}
    for path in SEED_PATHS:
        _set_path(out, path, seed)
    return out


def one_factor_neighbours(combos: Sequence[tuple[tuple[str, Any], ...]],
                          centers: Sequence[tuple[tuple[str, Any], ...]]) -> list[tuple[tuple[str, Any], ...]]:
    """The combinations that differ from one of ``centers`` in at most one grid key (a
    one-factor-at-a-time design around each center), in grid order."""
    wanted = [dict(center) for center in centers]
    return [combo for combo in combos
            if any(sum(center.get(k) != v for k, v in combo) <= 1 for center in wanted)]


@dataclass(frozen=True)
class SweepRun:
    """One combination of the grid (and one seed of it, when the sweep has seeds)."""

    name: str
    """Folder name under ``out/runs`` (see run_name)."""

    values: tuple[tuple[str, Any], ...]
    """(grid key, value) pairs of this combination, in grid order."""

    config: TrainConfig
    """Its full train config: the base config with the values applied and ``out`` set."""

    seed: int | None = None
    """The sweep's seed of this run (see SEED_PATHS); None when the sweep has no --seeds."""

    measure: MeasureConfig = field(default_factory=MeasureConfig)
    """What is measured of the run after training (see dflash_train.recipe)."""


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
    """Runs trained at once, each in its own process; 1 with no ``devices`` trains them one after
    the other in this process. None: one per entry of ``devices``, or 1 when none are listed."""

    devices: tuple[str, ...] = ()
    """Devices of the parallel slots, e.g. ("cuda:0", "cuda:1"); slot i uses devices[i % len], so
    a device listed twice (or parallel above the count) holds two runs at once. Empty: one slot per
    visible GPU when the base device is auto or cuda and CUDA is present, else the base device."""

    seeds: int | None = None
    """Seeds per combination: run i of a combination sets the drafter init, the anchor sampling
    and the noise (SEED_PATHS) all to i, for i in 0..seeds-1, and the report gives each
    configuration's mean and 95% interval over them. None: one run per combination with the
    base config's seeds (no seed in the run names)."""

    design: str = "full"
    """"full": every combination of the grid; "one-at-a-time": only those that differ from one
    of ``centers`` in at most one grid key."""

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
    """Held-out tau during training and real decoding per run (dflash_train.recipe)."""

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
        devices = tuple(check_device(str(d)) for d in self.devices)
        object.__setattr__(self, "devices", devices)
        parallel = self.parallel if self.parallel is not None else (len(devices) or 1)
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ConfigError(f"--parallel must be a whole number of at least 1, got {self.parallel!r}; e.g. --parallel 2")
        object.__setattr__(self, "parallel", parallel)
        plan_runs(self)  # every combination must be a valid train config before anything trains

    @property
    def in_processes(self) -> bool:
        """Whether runs train in processes of their own (any parallel sweep, or devices chosen)."""
        return self.parallel > 1 or bool(self.devices)


@dataclass(frozen=True)
class Preset:
    """A named sweep design (`dflash-train sweep --preset NAME`)."""

    grid: tuple[GridAxis, ...]
    reference: tuple[tuple[str, Any], ...]
    """The configuration the others are compared with."""

    centers: tuple[tuple[tuple[str, Any], ...], ...]
    """Centers of the one-at-a-time design (--design one-at-a-time)."""

    include: tuple[tuple[tuple[str, Any], ...], ...]
    """Further combinations of the one-at-a-time design."""

    seeds: int
    """Default --seeds."""

    curve_points: int
    """Default --curve-points."""


PAPER_RECIPE = (("loss", "ce"), ("weighting", "decay"), ("noise", "off"))
"""The DFlash paper's recipe: hard-label cross-entropy, exponential decay weights, no noise."""

FULL_RECIPE = (("loss", "kl"), ("weighting", "streak"), ("noise", "cosine"))
"""This toolkit's recipe as first proposed: soft-label KL, streak weights, cosine noise."""

PRESETS: dict[str, Preset] = {
    # Each noise value names its whole schedule, so the preset measures the same noise whatever
    # the defaults: constant is speculators' uniform 0.05, cosine the schedule first proposed.
    "recipe": Preset(
        grid=(GridAxis("loss", ("loss", "kind"), ("ce", "kl", "mix")),
              GridAxis("weighting", ("loss", "weighting"), ("decay", "streak")),
              GridAxis("noise", ("noise", "schedule"), ("off", "constant", "cosine"),
                       extras=((),
                               (("noise.distribution", "uniform"), ("noise.start", 0.05)),
                               (("noise.distribution", "uniform"), ("noise.start", 0.1), ("noise.end", 0.01))))),
        reference=PAPER_RECIPE, centers=(PAPER_RECIPE,), include=(FULL_RECIPE,), seeds=3, curve_points=3),
}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"--preset {name!r} is unknown; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def check_device(text: str) -> str:
    """A --devices entry as given, when torch can place a run on it."""
    import torch

    text = text.strip()
    if text == "auto":
        raise ConfigError("--devices lists concrete devices, got 'auto'; e.g. --devices cuda:0,cuda:1 "
                          "(or leave it out: one slot per visible GPU)")
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--devices entry {text!r} is not a device; use cpu, cuda or cuda:N, "
                          "e.g. --devices cuda:0,cuda:1") from None
    return text


def planned_combinations(cfg: SweepConfig) -> list[tuple[tuple[str, Any], ...]]:
    """The combinations the sweep's design trains, in grid order."""
    combos = expand_grid(cfg.grid)
    if cfg.design == "one-at-a-time":
        centers = cfg.centers or ((cfg.reference,) if cfg.reference else (combos[0],))
        wanted = set(one_factor_neighbours(combos, centers)) | {tuple(c) for c in cfg.include}
        combos = [c for c in combos if c in wanted]
    return combos


def reference_combination(cfg: SweepConfig) -> tuple[tuple[str, Any], ...]:
    return tuple(cfg.reference) if cfg.reference else planned_combinations(cfg)[0]


def plan_runs(cfg: SweepConfig) -> list[SweepRun]:
    """Every run's name and train config, in grid order, seeds innermost (reads and writes nothing)."""
    base = cfg.base.to_dict()
    if cfg.measure.curve_points:
        from dflash_train.trainer import DEFAULT_STEPS

        # operational: where checkpoints fall changes nothing the run learns
        base["save_every"] = cfg.measure.save_every(cfg.base.steps or DEFAULT_STEPS)
        base["keep_checkpoints"] = cfg.measure.curve_points + 2
    runs, names = [], set()
    for assignment in planned_combinations(cfg):
        for seed in ([None] if cfg.seeds is None else range(cfg.seeds)):
            name = run_name(assignment + (((SEED_KEY, seed),) if seed is not None else ()))
            if name in names:
                raise ConfigError(f"two combinations share the run name {name!r}; use values that differ in letters or digits")
            names.add(name)
            values = merge(base, run_overrides(cfg.grid, assignment))
            if seed is not None:
                values = merge(values, seed_overrides(seed))
            values["out"] = str(Path(cfg.out) / "runs" / name)
            values["storage_options"] = cfg.base.storage_options  # to_dict leaves it out (credentials)
            try:
                config = config_from_dict(values)
            except ConfigError as err:
                raise ConfigError(f"sweep run {name}: {err}") from None
            runs.append(SweepRun(name, assignment, config, seed, cfg.measure))
    return runs


# ----------------------------------------------------------------------------- what a run folder holds


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
    from dflash_train.checkpoint import CheckpointManager
    from dflash_train.export import CONFIG_FILE, WEIGHTS_FILE

    folder = Path(run.config.out)
    saved = folder / "config.json"
    if saved.exists():
        differences = config_differences(json.loads(saved.read_text()), run.config.to_dict())
        if differences:
            said = "; ".join(f"{path}: {before!r} vs {after!r}" for path, before, after in differences)
            raise ConfigError(f"{folder} was made with other settings ({said}); "
                              "rerun the sweep with its original options or use a new --out")
    export = folder / "drafter"
    has_export = (export / CONFIG_FILE).exists() and (export / WEIGHTS_FILE).exists()
    trained = is_finished(has_export, read_metrics(folder), run.config.eval_sequences > 0)
    measured = not run.measure.active or read_measure(folder) is not None
    resumable = CheckpointManager(folder / "checkpoints").latest() is not None
    return RunStatus(finished=trained and measured, trained=trained, resumable=resumable)


def train_run(run: SweepRun, progress: Progress | None = None) -> None:
    """Train one combination to the end, resuming from its newest checkpoint when it has one,
    then measure it when the sweep asks (curve points, real decoding)."""
    from dflash_train.trainer import train

    status = run_status(run)
    if not status.trained:
        train(run.config, resume=status.resumable, progress=progress)
    if run.measure.active and read_measure(run.config.out) is None:
        reference = None
        if run.measure.teacher is not None:
            reference = json.loads((Path(run.config.out).parent.parent / REFERENCE_FILE).read_text())
        write_measure(run.config.out, measure_run(run.config, read_metrics(run.config.out), run.measure, reference, progress))


# ----------------------------------------------------------------------------- report


def alpha_columns(alpha: Sequence[float] | None) -> dict[str, float | None]:
    """alpha at ALPHA_POSITIONS and the last position (None where the block is shorter)."""
    alpha = list(alpha or [])
    out: dict[str, float | None] = {f"alpha_{k}": alpha[k - 1] if k <= len(alpha) else None for k in ALPHA_POSITIONS}
    out["alpha_last"] = alpha[-1] if alpha else None
    return out


RESULT_COLUMNS = ("train_loss", "heldout_loss", "tau", "tau_greedy",
                  *(f"alpha_{k}" for k in ALPHA_POSITIONS), "alpha_last", "tokens_per_s", "steps")


def result_row(run: SweepRun, metrics: RunMetrics) -> dict[str, Any]:
    """One table row: the run, its grid values and its final numbers (None where missing)."""
    final, last = metrics.final_eval, metrics.final_train
    row: dict[str, Any] = {"run": run.name}
    row.update({key: value_label(value) for key, value in run.values})
    if run.seed is not None:
        row[SEED_KEY] = run.seed
    row.update({
        "train_loss": last.get("loss"),
        "heldout_loss": final.get("loss"),
        "tau": final.get("tau"),
        "tau_greedy": final.get("tau_greedy"),
        **alpha_columns(final.get("alpha")),
        "tokens_per_s": last.get("tokens_per_s"),  # the average of the run's last session
        "steps": metrics.last_step or None,
    })
    return row


def rows_to_csv(rows: Sequence[dict], columns: Sequence[str]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if row.get(c) is None else row[c] for c in columns])
    return buffer.getvalue()


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if column == "tokens_per_s":
        return f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return str(value).replace("|", "\\|")


def rows_to_markdown(rows: Sequence[dict], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---" if c == "run" or not _numeric(rows, c) else "---:" for c in columns) + "|"]
    lines += ["| " + " | ".join(_cell(c, row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _numeric(rows: Sequence[dict], column: str) -> bool:
    return any(isinstance(r.get(column), (int, float)) and not isinstance(r.get(column), bool) for r in rows)


def _legend_label(run: SweepRun) -> str:
    seed = () if run.seed is None else ((SEED_KEY, run.seed),)
    return ", ".join(f"{key}={value_label(value)}" for key, value in run.values + seed)


def _style(i: int) -> dict:
    # Ten colours, then the same colours dashed, dotted, ...: lines stay distinguishable in big grids.
    return {"color": f"C{i % 10}", "linestyle": ("-", "--", ":", "-.")[(i // 10) % 4]}


def _save_figure(fig, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # render with Agg without touching pyplot's global backend
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    os.replace(tmp, path)


def plot_loss_curves(curves: dict[str, tuple[list[int], list[float]]], path: str | Path) -> None:
    """Train loss against step, one line per run."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    for i, (label, (steps, losses)) in enumerate(curves.items()):
        ax.plot(steps, losses, label=label, linewidth=1.4, **_style(i))
    values = [v for _, losses in curves.values() for v in losses]
    if values and min(values) > 0:
        ax.set_yscale("log")  # losses of different kinds span orders of magnitude
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_title("train loss by run")
    ax.grid(alpha=0.3)
    _legend(fig, ax, len(curves))
    _save_figure(fig, Path(path))


def plot_acceptance_by_position(curves: dict[str, list[float]], path: str | Path) -> None:
    """Held-out alpha_k against block position k, one line per run."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    for i, (label, alpha) in enumerate(curves.items()):
        ax.plot(range(1, len(alpha) + 1), alpha, marker="o", markersize=3, label=label, linewidth=1.4, **_style(i))
    longest = max((len(a) for a in curves.values()), default=0)
    if longest:
        ax.set_xticks(range(1, longest + 1))
    else:
        ax.text(0.5, 0.5, "no held-out evaluation (eval_sequences = 0)", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("block position k")
    ax.set_ylabel("held-out acceptance alpha_k")
    ax.set_title("held-out acceptance by block position")
    ax.grid(alpha=0.3)
    _legend(fig, ax, len(curves))
    _save_figure(fig, Path(path))


def _legend(fig, ax, count: int) -> None:
    if count == 0:
        return
    if count <= 6:
        ax.legend(fontsize="small")
    else:  # a big grid's legend would hide the lines: put it beside the axes
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees half a table


@dataclass(frozen=True)
class SweepReport:
    """The comparison of a sweep's runs, as written to its folder."""

    rows: tuple[dict, ...]
    """One row per combination (see result_row)."""

    columns: tuple[str, ...]
    """Column order of results.csv and results.md."""

    markdown: str
    """The text of results.md."""

    summary: str | None = None
    """The text of summary.md (sweeps with --seeds or measurements), else None."""


def write_report(cfg: SweepConfig, runs: Sequence[SweepRun] | None = None) -> SweepReport:
    """(Re)write results.csv, results.md and both plots from the runs' metrics.jsonl files."""
    runs = plan_runs(cfg) if runs is None else runs
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = {run.name: read_metrics(run.config.out) for run in runs}
    rows = tuple(result_row(run, metrics[run.name]) for run in runs)
    columns = ("run", *(axis.key for axis in cfg.grid), *((SEED_KEY,) if cfg.seeds is not None else ()), *RESULT_COLUMNS)
    markdown = rows_to_markdown(rows, columns)
    _write_text(out / "results.csv", rows_to_csv(rows, columns))
    _write_text(out / "results.md", markdown)
    plot_loss_curves({_legend_label(run): ([r["step"] for r in metrics[run.name].train if "loss" in r],
                                           [r["loss"] for r in metrics[run.name].train if "loss" in r])
                      for run in runs if metrics[run.name].train}, out / "loss_curves.png")
    plot_acceptance_by_position({_legend_label(run): metrics[run.name].final_eval["alpha"]
                                 for run in runs if metrics[run.name].final_eval.get("alpha")},
                                out / "acceptance_by_position.png")
    summary = None
    if cfg.seeds is not None or cfg.measure.active:
        summary = write_summary(out, [RunOutcome(configuration=value_label_of(run.values), seed=run.seed or 0,
                                                 final=metrics[run.name].final_eval, measure=read_measure(run.config.out))
                                      for run in runs], value_label_of(reference_combination(cfg)))
    return SweepReport(rows=rows, columns=columns, markdown=markdown, summary=summary)


def value_label_of(assignment: Sequence[tuple[str, Any]]) -> str:
    """A combination as "loss=ce, weighting=decay": how summary.md and its plot name it."""
    return ", ".join(f"{key}={value_label(value)}" for key, value in assignment)


def sweep_record(cfg: SweepConfig, runs: Sequence[SweepRun]) -> dict:
    """The content of sweep.json: the grid, the base config and the run names."""
    return {
        "grid": [{"key": a.key, "field": ".".join(a.path), "values": list(a.values),
                  **({"extras": [dict(e) for e in a.extras]} if a.extras else {})} for a in cfg.grid],
        "base": cfg.base.to_dict(),
        "seeds": cfg.seeds,
        "design": cfg.design,
        "planned": [dict(c) for c in planned_combinations(cfg)],
        "reference": dict(reference_combination(cfg)),
        "measure": dataclasses.asdict(cfg.measure),
        "runs": [{"name": r.name, "values": {k: v for k, v in r.values}, **({"seed": r.seed} if r.seed is not None else {})}
                 for r in runs],
    }


# ----------------------------------------------------------------------------- runs in processes of their own

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
    """What the run's process reads on stdin (see dflash_train.sweep_worker)."""
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
    with open(folder / LOG_FILE, "a") as log:
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


def _log_tail(path: Path, size: int = 65536) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - size))
        return f.read().decode(errors="replace")


def _start(run: SweepRun, slot: Slot, action: str) -> subprocess.Popen:
    folder = Path(run.config.out)
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(slot.threads), MKL_NUM_THREADS=str(slot.threads), PYTHONUNBUFFERED="1")
    with open(folder / LOG_FILE, "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} sweep: {action} {run.name} on {slot.device}, "
                  f"{slot.threads} thread(s)\n")
        log.flush()
        # A fresh interpreter, not a fork: no CUDA context, thread pool or open cache is shared.
        proc = subprocess.Popen([sys.executable, "-m", "dflash_train.sweep_worker"], stdin=subprocess.PIPE,
                                stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        proc.stdin.write(json.dumps(worker_job(run, slot)))
        proc.stdin.close()
    except OSError:
        pass  # it died before reading; its exit status and log say why
    return proc


def _stop(procs: Iterable[subprocess.Popen]) -> None:
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
        _stop(proc for _, proc, _ in running.values())  # interrupted: leave no run behind
        progress.close()
    return failures


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ----------------------------------------------------------------------------- the sweep


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
    out.mkdir(parents=True, exist_ok=True)
    statuses = {run.name: run_status(run) for run in runs}  # refuses mismatched folders before writing
    _write_text(out / "sweep.json", json.dumps(sweep_record(cfg, runs), indent=1) + "\n")
    if cfg.measure.teacher is not None and any(not s.finished for s in statuses.values()):
        progress.message(f"teacher's own greedy outputs for {cfg.measure.prompts} (once per sweep)")
        reference_outputs(cfg.measure, out, open_cache(cfg.base.cache, cfg.base.storage_options).chat_template_kwargs)
    todo = [run for run in runs if not statuses[run.name].finished]
    progress.message(f"sweep of {len(runs)} runs in {out}: {len(runs) - len(todo)} finished, {len(todo)} to train")
    failures: list[RunFailure] = []
    if cfg.in_processes and todo:
        needs_gpus = not cfg.devices and cfg.base.device in ("auto", "cuda")
        slots = device_slots(cfg.parallel, cfg.devices, cfg.base.device, _visible_gpus() if needs_gpus else 0, _cpu_count())
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
