"""What a sweep trains: the seeds and designs (full grid, one at a time), the presets, the sweep's
config from a command line's parts, and every run's name and TrainConfig."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dflash_common.errors import ConfigError
from dflash_common.knobs import Knob, config_knobs, set_path
from dflash_train.config import config_from_dict, merge
from dflash_train.settings.measure_config import MeasureConfig
from dflash_train.settings.sweep_config import SEED_PATHS, GridAxis, SweepConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.sweep.grid import expand_grid, parse_grid, run_name, run_overrides

SEED_KEY = "seed"
"""The column and run-name part of a sweep's seed."""


def seed_overrides(seed: int) -> dict:
    """Nested config values of replicate ``seed``: the same number for every seed of the run."""
    out: dict = {}
    for path in SEED_PATHS:
        set_path(out, path, seed)
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
    """What is measured of the run after training (see dflash_train.sweep.measure)."""


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


def sweep_knobs() -> tuple[Knob, ...]:
    """The settings of a sweep a command line gives, declared by SweepConfig's and MeasureConfig's
    fields (the grid, the preset's choices and the train settings come separately)."""
    return config_knobs(SweepConfig, ("parallel", "devices", "seeds", "design", "measure"), panel="sweep settings",
                        sections={"measure": MeasureConfig})


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"--preset {name!r} is unknown; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def sweep_config(out: str, base: TrainConfig, grid: Sequence[str] = (), preset_name: str | None = None,
                 given: dict | None = None) -> SweepConfig:
    """The SweepConfig of `dflash-train sweep`: the shared train config, the swept values (--grid
    texts, or a --preset's design) and the sweep's own fields as nested values (sweep_knobs'); a
    preset's seeds and curve points are defaults that given fields override."""
    given = dict(given or {})
    chosen = preset(preset_name) if preset_name else None
    if chosen and grid:
        raise ConfigError(f"--preset {preset_name} sets the grid; drop --grid {grid[0]} (or drop --preset)")
    measure = MeasureConfig(**{"curve_points": chosen.curve_points if chosen else 0, **given.pop("measure", {})})
    choices = {"grid": chosen.grid, "seeds": chosen.seeds, "reference": chosen.reference, "centers": chosen.centers,
               "include": chosen.include} if chosen else {"grid": parse_grid(grid)}
    cfg = SweepConfig(out=out, base=base, measure=measure, **{**choices, **given})
    plan_runs(cfg)  # every combination must be a valid train config before anything trains
    return cfg


def check_device(text: str) -> None:
    """Refuse a --devices entry torch cannot place a run on ('auto' SweepConfig refuses itself)."""
    import torch

    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--devices entry {text!r} is not a device; use cpu, cuda or cuda:N, "
                          "e.g. --devices cuda:0,cuda:1") from None


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
    for device in cfg.devices:
        check_device(device)
    base = cfg.base.to_dict()
    if cfg.measure.curve_points:
        from dflash_train.training.session import DEFAULT_STEPS

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
