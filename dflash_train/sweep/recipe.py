"""What a sweep with seeds measures beyond its final numbers, and the statistics of its summary.

A sweep with ``measure`` set (see MeasureConfig; ``--preset recipe`` sets it) keeps a checkpoint
at evenly spaced steps of every run, evaluates each on the held-out split after the run
(``measure_run``: held-out tau against the training tokens seen, from the run's own epoch plan),
and decodes held-out prompts greedily with the real teacher and the exported drafter, checking
that the output equals the teacher's own greedy output (computed once per sweep:
``reference_outputs``). Each run's measurements go to ``runs/<name>/measure.json``.

``summarize`` then groups the runs into configurations (every grid value but the seed) and
writes ``summary.md``/``summary.csv`` and ``tau_vs_tokens.png``: per configuration the mean and
a 95% t-interval over seeds (``t_interval``), the difference from the reference configuration
paired by seed (``paired_difference``: seed i of both used the same drafter init, anchors and
noise), tau at fixed fractions of the run, and the tokens a configuration needs to reach the
reference's final tau (``tokens_to_reach``). All statistics are pure functions of the per-seed
numbers.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from dflash_common.errors import ConfigError
from dflash_common.values import is_real

MEASURE_FILE = "measure.json"
"""A run's curve and decoding measurements, in its folder."""

REFERENCE_FILE = "teacher_outputs.json"
"""The teacher's own greedy outputs for the sweep's prompts, in the sweep folder."""

BUDGETS = (0.25, 0.5, 1.0)
"""Fractions of the run at which the summary tabulates held-out tau."""

# t_{0.975, df} for df = 1..30 (two-sided 95%); beyond, the Cornish-Fisher expansion below.
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)
_Z975 = 1.959964


def t_quantile(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ConfigError(f"a t-interval needs at least 2 values (df >= 1), got df {df}; run --seeds 2 or more")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Interval:
    """A mean over seeds and its 95% t-interval (low = high = mean when n < 2: no spread known)."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def text(self, digits: int = 3) -> str:
        if self.n < 2:
            return f"{self.mean:.{digits}f} (n=1)"
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"


def t_interval(values: Sequence[float]) -> Interval:
    """mean ± t_{0.975,n-1} · s/√n of the values (s the sample standard deviation)."""
    values = [float(v) for v in values]
    if not values:
        raise ConfigError("a t-interval of no values; every configuration needs at least one finished seed")
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return Interval(mean, mean, mean, n)
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(n - 1) * s / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def paired_difference(values: Mapping[int, float], reference: Mapping[int, float]) -> Interval | None:
    """The t-interval of value[seed] - reference[seed] over the seeds both have (None if none)."""
    seeds = sorted(set(values) & set(reference))
    if not seeds:
        return None
    return t_interval([values[s] - reference[s] for s in seeds])


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y at x through (x, y) points sorted by x; clamped at both ends."""
    if not points:
        raise ConfigError("no points to interpolate")
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def tokens_to_reach(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first x at which the piecewise-linear curve through (tokens, tau) points reaches
    ``target``, None when it never does."""
    if not points:
        return None
    if points[0][1] >= target:
        return points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y1 >= target:
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    return None


def tokens_by_step(batch_tokens: Sequence[int], grad_accum: int, steps: int) -> list[int]:
    """Training tokens seen after each step 1..steps, from the tokens of consecutive batches
    (``grad_accum`` batches a step; the batches repeat when the list is shorter)."""
    if not batch_tokens:
        raise ConfigError("the run's epoch plan has no batches")
    out, total, i = [], 0, 0
    for _ in range(steps):
        for _ in range(grad_accum):
            total += int(batch_tokens[i % len(batch_tokens)])
            i += 1
        out.append(total)
    return out


def ranks(values: Mapping[str, float]) -> dict[str, int]:
    """1 = the highest value; ties share the better rank."""
    ordered = sorted(values.values(), reverse=True)
    return {k: ordered.index(v) + 1 for k, v in values.items()}


def spearman(a: Mapping[str, float], b: Mapping[str, float]) -> float | None:
    """Spearman's rank correlation of two scores of the same keys (None for fewer than 3 keys
    or a constant score)."""
    keys = sorted(set(a) & set(b))
    if len(keys) < 3:
        return None
    ra, rb = _average_ranks([a[k] for k in keys]), _average_ranks([b[k] for k in keys])
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return None if va == 0 or vb == 0 else cov / math.sqrt(va * vb)


def _average_ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


# ----------------------------------------------------------------------------- what is measured


@dataclass(frozen=True)
class MeasureConfig:
    """What a sweep measures of every run besides its final held-out evaluation."""

    curve_points: int = 0
    """Held-out evaluations during each run, at evenly spaced steps (a checkpoint is kept at
    each and evaluated after the run), for held-out tau against training tokens; 0: none."""

    teacher: str | None = None
    """Teacher folder for real greedy decoding of held-out prompts with each run's drafter
    (None: no decoding)."""

    prompts: str | None = None
    """JSONL prompts for the decoding (the rows `dflash-train eval --prompts` reads)."""

    max_prompts: int = 24
    """Prompts decoded per run (the first ones of the file)."""

    max_new_tokens: int = 64
    """Tokens generated per prompt."""

    sample_temperature: float = 0.0
    """Also decode the prompts by speculative sampling at this temperature (e.g. 1, seeded by the
    run's seed) and report its accepted length beside greedy's; 0: greedy only."""

    def __post_init__(self):
        if isinstance(self.curve_points, bool) or not isinstance(self.curve_points, int) or self.curve_points < 0:
            raise ConfigError(f"--curve-points must be 0 or more, got {self.curve_points!r}; e.g. --curve-points 3")
        if (self.teacher is None) != (self.prompts is None):
            raise ConfigError("real decoding in a sweep needs both --teacher and --prompts (got only "
                              f"{'--teacher' if self.teacher else '--prompts'}); give both or neither")
        if not is_real(self.sample_temperature, finite=True) or self.sample_temperature < 0:
            raise ConfigError(f"--sample-temperature must be a number >= 0 (0: greedy only), got {self.sample_temperature!r}")
        if self.max_prompts < 1 or self.max_new_tokens < 2:
            raise ConfigError(f"--max-prompts must be >= 1 and --max-new-tokens >= 2, got {self.max_prompts} and "
                              f"{self.max_new_tokens}")

    @property
    def active(self) -> bool:
        return self.curve_points > 0 or self.teacher is not None

    def covers(self, record: dict | None) -> bool:
        """Whether a run's measure.json holds what these settings measure (a sampled decoding
        asked for later is measured then)."""
        if record is None:
            return False
        sampled = (record.get("sampling") or {}).get("temperature")
        return self.sample_temperature == 0 or self.teacher is None or sampled == self.sample_temperature

    def save_every(self, steps: int) -> int:
        """Checkpoint spacing that puts one checkpoint at each curve point (and the last step)."""
        return max(1, steps // (self.curve_points + 1))


def _spec(tokenizer, max_new_tokens: int, temperature: float = 0.0, seed: int = 0):
    from dflash_cache.chat import stop_token_ids
    from dflash_train.speculative import SpecConfig

    return SpecConfig(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop_token_ids(tokenizer),
                      seed=seed)


def reference_outputs(measure: MeasureConfig, sweep_dir: str | Path, template_kwargs: dict | None) -> dict:
    """The teacher's own greedy outputs for the prompts, computed once per sweep and kept in
    REFERENCE_FILE (recomputed when the teacher, prompts or lengths differ)."""
    from dflash_cache.teacher import TeacherConfig, load_teacher
    from dflash_train.decoding import read_prompts
    from dflash_train.speculative import teacher_generate

    path = Path(sweep_dir) / REFERENCE_FILE
    key = {"teacher": str(Path(measure.teacher).resolve()), "prompts": str(Path(measure.prompts).resolve()),
           "max_prompts": measure.max_prompts, "max_new_tokens": measure.max_new_tokens,
           "chat_template_kwargs": template_kwargs}
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved
    teacher = load_teacher(TeacherConfig(name_or_path=measure.teacher, dtype="float32", device="cpu", top_k=1))
    prompts = read_prompts(measure.prompts, teacher.tokenizer, measure.max_prompts, template_kwargs)
    spec = _spec(teacher.tokenizer, measure.max_new_tokens)
    record = {"key": key, "prompts": [{"id": p.id, "ids": p.ids, "output": teacher_generate(teacher.model, p.ids, spec).tokens}
                                      for p in prompts]}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
    return record


@functools.lru_cache(maxsize=2)
def _teacher(path: str, device: str):
    # a serial sweep decodes every run with the same teacher: load it once per process
    from dflash_cache.teacher import TeacherConfig, load_teacher

    return load_teacher(TeacherConfig(name_or_path=path, dtype="float32", device=device, top_k=1))


def decode_heldout(drafter_dir: str | Path, measure: MeasureConfig, reference: dict, device: str,
                   temperature: float = 0.0, seed: int = 0) -> dict:
    """Speculative decoding of the reference prompts, greedy (temperature 0) or sampled: the
    accepted length and, greedy, whether every output equals the teacher's own greedy output."""
    from dflash_train.evaluate import load_trained_drafter
    from dflash_train.speculative import mean_accepted_length, speculative_generate

    teacher = _teacher(str(Path(measure.teacher).resolve()), device)
    head = teacher.model
    drafter = load_trained_drafter(str(drafter_dir), head.get_input_embeddings().weight.detach(),
                                   head.get_output_embeddings().weight.detach(), teacher.device)
    teacher.layer_ids = list(drafter.cfg.target_layer_ids)
    spec = _spec(teacher.tokenizer, measure.max_new_tokens, temperature, seed)
    results, matched = [], []
    for prompt in reference["prompts"]:
        result = speculative_generate(teacher.model, drafter, prompt["ids"], spec)
        results.append(result)
        matched.append(result.tokens == prompt["output"] or not spec.greedy)
    lengths = [n for result in results for n in result.accepted_lengths]
    return {"accepted_length": mean_accepted_length(results), "temperature": temperature,
            # rounds by tokens produced (index n: n tokens): acceptance by block position follows
            "accepted_histogram": [lengths.count(n) for n in range(max(lengths, default=0) + 1)],
            "matched_teacher": all(matched) if spec.greedy else None,
            "prompts": len(results), "mismatched": [p["id"] for p, ok in zip(reference["prompts"], matched) if not ok]}


def run_tokens(config, steps: int) -> list[int]:
    """Training tokens after each step of a run, from its epoch plan (what its loader reads)."""
    from dflash_cache import open_cache
    from dflash_train.data import EpochPlan

    cache = open_cache(config.cache, config.storage_options)
    plan = EpochPlan(cache, config.data)
    per_batch: list[int] = []
    epoch = 0
    while len(per_batch) < steps * config.optim.grad_accum:
        per_batch += [sum(int(cache.shards[s].lengths[i]) for s, i in batch) for batch in plan.batches(epoch)]
        epoch += 1
    return tokens_by_step(per_batch, config.optim.grad_accum, steps)


def measure_run(config, metrics, measure: MeasureConfig, reference: dict | None, progress=None) -> dict:
    """Evaluate a finished run's kept checkpoints on the held-out split (held-out tau against
    training tokens) and decode the reference prompts with its exported drafter."""
    import torch

    from dflash_cache import open_cache
    from dflash_cache.teacher import resolve_device
    from dflash_train.checkpoint import CheckpointManager
    from dflash_train.evaluate import evaluate, load_drafter_for

    device = resolve_device(config.device)
    steps = metrics.last_step
    tokens = run_tokens(config, steps)
    curve = []
    if 0 in metrics.evals:
        curve.append(_point(0, 0, metrics.evals[0]))
    cache = open_cache(config.cache, config.storage_options)
    checkpoints = CheckpointManager(Path(config.out) / "checkpoints").complete()
    if progress:
        progress.message(f"measuring {Path(config.out).name}: {len(checkpoints)} checkpoint(s)"
                         f"{' and real decoding' if reference else ''}")
    for path in checkpoints:
        step = int(path.name.split("-")[1])
        if step == steps and metrics.final_eval:
            record = metrics.final_eval  # the run's own final evaluation: same split, anchors and model
        else:
            model = load_drafter_for(str(path), cache, device, config.data.skip_shards)
            with torch.no_grad():
                record = evaluate(model, cache, config.data, config.loss, config.eval_sequences, device)
        curve.append(_point(step, tokens[step - 1], record))
    if metrics.final_eval and all(p["step"] != steps for p in curve):
        curve.append(_point(steps, tokens[steps - 1], metrics.final_eval))
    out: dict[str, Any] = {"steps": steps, "tokens": tokens[-1], "curve": sorted(curve, key=lambda p: p["step"])}
    if reference is not None:
        out["decoding"] = decode_heldout(Path(config.out) / "drafter", measure, reference, str(device))
        if measure.sample_temperature > 0:
            out["sampling"] = decode_heldout(Path(config.out) / "drafter", measure, reference, str(device),
                                             measure.sample_temperature, config.seed)
    return out


def _point(step: int, tokens: int, record: dict) -> dict:
    return {"step": step, "tokens": tokens, "tau": record.get("tau"), "tau_greedy": record.get("tau_greedy"),
            "loss": record.get("loss")}


def read_measure(run_dir: str | Path) -> dict | None:
    path = Path(run_dir) / MEASURE_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None  # cut short by a kill mid-write: measured again


def write_measure(run_dir: str | Path, record: dict) -> None:
    path = Path(run_dir) / MEASURE_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- the summary


@dataclass(frozen=True)
class RunOutcome:
    """What the summary needs of one run."""

    configuration: str
    """Its grid values without the seed, e.g. "loss=ce, weighting=decay, noise=off"."""

    seed: int
    final: dict
    """The held-out evaluation after the last step ({} when missing)."""

    measure: dict | None
    """Its measure.json (None when not measured)."""


def _per_seed(outcomes: Sequence[RunOutcome], value) -> dict[str, dict[int, float]]:
    """configuration -> {seed: value(outcome)} for the outcomes where value is not None."""
    out: dict[str, dict[int, float]] = {}
    for o in outcomes:
        v = value(o)
        out.setdefault(o.configuration, {})
        if v is not None:
            out[o.configuration][o.seed] = float(v)
    return out


def _accepted(o: RunOutcome, kind: str = "decoding") -> float | None:
    """A run's real accepted length: greedy ("decoding") or sampled ("sampling")."""
    return ((o.measure or {}).get(kind) or {}).get("accepted_length")


def _sampled(o: RunOutcome) -> float | None:
    return _accepted(o, "sampling")


def _curve(o: RunOutcome) -> list[tuple[float, float]]:
    return [(p["tokens"], p["tau"]) for p in (o.measure or {}).get("curve", []) if p.get("tau") is not None]


def mean_curve(outcomes: Sequence[RunOutcome], metric: str = "tau") -> list[tuple[int, float, float, Interval]]:
    """(step, mean tokens, mean of the metric, its interval) at the steps every seed evaluated;
    the metric is a curve point's "tau" (sampling estimate) or "tau_greedy" (greedy streak)."""
    by_step: dict[int, list[tuple[float, float]]] = {}
    for o in outcomes:
        for p in (o.measure or {}).get("curve", []):
            if p.get(metric) is not None:
                by_step.setdefault(p["step"], []).append((p["tokens"], p[metric]))
    n = len(outcomes)
    out = []
    for step in sorted(by_step):
        points = by_step[step]
        if len(points) == n:
            interval = t_interval([tau for _, tau in points])
            out.append((step, sum(t for t, _ in points) / n, interval.mean, interval))
    return out


def tau_at_budget(outcomes: Sequence[RunOutcome], fraction: float) -> Interval | None:
    """Held-out tau at ``fraction`` of each seed's training tokens (interpolated on its curve),
    over seeds."""
    values = []
    for o in outcomes:
        curve = _curve(o)
        if curve:
            values.append(interpolate(curve, fraction * curve[-1][0]))
    return t_interval(values) if values else None


@dataclass(frozen=True)
class Summary:
    """Per configuration: intervals over seeds, differences from the reference, sample efficiency."""

    rows: tuple[dict, ...]
    reference: str
    ranking_note: str
    sample_temperature: float | None = None
    """The temperature of the sampled decodings (None: greedy only)."""


def summarize(outcomes: Sequence[RunOutcome], reference: str) -> Summary:
    """The numbers of summary.md from the per-run outcomes (pure)."""
    configurations = list(dict.fromkeys(o.configuration for o in outcomes))
    groups = {c: [o for o in outcomes if o.configuration == c] for c in configurations}
    tau = _per_seed(outcomes, lambda o: o.final.get("tau"))
    greedy = _per_seed(outcomes, lambda o: o.final.get("tau_greedy"))
    loss = _per_seed(outcomes, lambda o: o.final.get("loss"))
    accepted = _per_seed(outcomes, _accepted)
    sampled = _per_seed(outcomes, _sampled)
    ref_curve = mean_curve(groups.get(reference, []))
    ref_final = ref_curve[-1][2] if ref_curve else (t_interval(list(tau[reference].values())).mean
                                                     if tau.get(reference) else None)
    rows = []
    for c in configurations:
        curve = mean_curve(groups[c])
        row: dict[str, Any] = {"configuration": c, "seeds": len(groups[c]), "reference": c == reference}
        for name, values in (("tau", tau), ("tau_greedy", greedy), ("heldout_loss", loss), ("accepted_length", accepted),
                             ("accepted_length_sampled", sampled)):
            row[name] = t_interval(list(values[c].values())) if values.get(c) else None
        for name, values in (("tau", tau), ("tau_greedy", greedy), ("accepted_length", accepted),
                             ("accepted_length_sampled", sampled)):
            row[f"{name}_vs_reference"] = (paired_difference(values[c], values[reference])
                                           if c != reference and values.get(c) and values.get(reference) else None)
        for fraction in BUDGETS:
            row[f"tau_at_{int(fraction * 100)}pct"] = tau_at_budget(groups[c], fraction)
        reach = tokens_to_reach([(t, m) for _, t, m, _ in curve], ref_final) if ref_final is not None and curve else None
        row["tokens_to_reference_tau"] = reach
        row["run_tokens"] = curve[-1][1] if curve else None
        decodings = [(o.measure or {}).get("decoding") for o in groups[c]]
        row["matched_teacher"] = (all(d["matched_teacher"] for d in decodings) if decodings and all(decodings) else None)
        rows.append(row)
    temperatures = {(o.measure or {}).get("sampling", {}).get("temperature") for o in outcomes} - {None}
    return Summary(tuple(rows), reference, ranking_note(rows), max(temperatures) if temperatures else None)


def ranking_note(rows: Sequence[dict]) -> str:
    """Whether offline tau (both estimates) and the real accepted length rank the configurations alike."""
    real = {r["configuration"]: r["accepted_length"].mean for r in rows if r.get("accepted_length")}
    parts = []
    for key, name in (("tau", "offline tau (sampling estimate)"), ("tau_greedy", "offline tau (greedy streak)")):
        offline = {r["configuration"]: r[key].mean for r in rows if r.get(key)}
        rho = spearman(offline, real)
        if rho is None:
            continue
        best_offline, best_real = max(offline, key=offline.get), max(real, key=real.get)
        same = ("both rank the same configuration first" if best_offline == best_real else
                f"they rank different configurations first ({best_offline} offline, {best_real} real)")
        parts.append(f"Spearman rank correlation of {name} and the real accepted length over "
                     f"{len(set(offline) & set(real))} configurations: {rho:.2f}; {same}.")
    return " ".join(parts) or ("Offline tau and the real accepted length: too few configurations with both, or a score "
                               "equal for all of them, to compare their rankings.")


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, Interval):
        return value.text(digits)
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"
    return str(value)


def _signed(interval: Interval | None) -> str:
    if interval is None:
        return "n/a"
    mark = " *" if interval.n >= 2 and (interval.low > 0 or interval.high < 0) else ""
    return f"{interval.mean:+.3f} [{interval.low:+.3f}, {interval.high:+.3f}]{mark}" if interval.n >= 2 else \
        f"{interval.mean:+.3f} (n=1)"


def summary_markdown(summary: Summary) -> str:
    rows = summary.rows
    lines = [f"Reference: **{summary.reference}**. Intervals: 95% t-interval over seeds, mean ± "
             "t_{0.975,n-1}·s/√n; differences from the reference are paired by seed (seed i of both runs had the "
             "same drafter init, anchors and noise) and marked * when their interval excludes 0. Held-out loss is "
             "each run's own objective, so it compares runs of one loss kind only.", "",
             "### Final numbers", "",
             "| configuration | seeds | held-out tau | Δ tau vs reference | tau (greedy streak) | Δ greedy vs reference "
             "| real accepted length | Δ accepted vs reference"
             + (f" | real accepted length, T={summary.sample_temperature:g} | Δ T={summary.sample_temperature:g} vs reference"
                if summary.sample_temperature else "") + " | held-out loss | output = teacher |",
             "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if summary.sample_temperature else "") + "---:|---|"]
    for r in rows:
        name = f"**{r['configuration']}**" if r["reference"] else r["configuration"]
        sampled = (f"{_fmt(r['accepted_length_sampled'])} | {_signed(r['accepted_length_sampled_vs_reference'])} | "
                   if summary.sample_temperature else "")
        lines.append(f"| {name} | {r['seeds']} | {_fmt(r['tau'])} | {_signed(r['tau_vs_reference'])} | "
                     f"{_fmt(r['tau_greedy'])} | {_signed(r['tau_greedy_vs_reference'])} | {_fmt(r['accepted_length'])} | "
                     f"{_signed(r['accepted_length_vs_reference'])} | {sampled}"
                     f"{_fmt(r['heldout_loss'], 4)} | {_fmt(r['matched_teacher'])} |")
    budgets = [f"tau at {int(f * 100)}%" for f in BUDGETS]
    lines += ["", "### Sample efficiency", "",
              "Held-out tau (sampling estimate) at fractions of the run's training tokens (each seed's curve "
              "interpolated), and the tokens the mean curve needs to reach the reference's final mean tau (n/a: not "
              "reached); tau_vs_tokens.png also shows the greedy streak.", "",
              "| configuration | " + " | ".join(budgets) + " | tokens to reference tau | share of the run |",
              "|---|" + "---:|" * (len(budgets) + 2)]
    for r in rows:
        reach, total = r["tokens_to_reference_tau"], r["run_tokens"]
        share = f"{reach / total:.0%}" if reach is not None and total else "n/a"
        lines.append(f"| {r['configuration']} | " + " | ".join(_fmt(r[f'tau_at_{int(f * 100)}pct']) for f in BUDGETS)
                     + f" | {_fmt(float(reach)) if reach is not None else 'n/a'} | {share} |")
    lines += ["", summary.ranking_note, ""]
    return "\n".join(lines)


def summary_csv(summary: Summary) -> str:
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    header = ["configuration", "seeds", "reference"]
    for name in ("tau", "tau_greedy", "heldout_loss", "accepted_length", "accepted_length_sampled", "tau_vs_reference",
                 "tau_greedy_vs_reference", "accepted_length_vs_reference", "accepted_length_sampled_vs_reference",
                 *(f"tau_at_{int(f * 100)}pct" for f in BUDGETS)):
        header += [f"{name}_mean", f"{name}_low", f"{name}_high"]
    header += ["tokens_to_reference_tau", "run_tokens", "matched_teacher"]
    writer.writerow(header)
    for r in summary.rows:
        line = [r["configuration"], r["seeds"], r["reference"]]
        for name in header[3:-3:3]:
            interval = r.get(name.removesuffix("_mean"))
            line += ["", "", ""] if interval is None else [interval.mean, interval.low, interval.high]
        line += ["" if r[k] is None else r[k] for k in ("tokens_to_reference_tau", "run_tokens", "matched_teacher")]
        writer.writerow(line)
    return buffer.getvalue()


def plot_tau_vs_tokens(outcomes: Sequence[RunOutcome], path: str | Path, reference: str) -> None:
    """Held-out tau against training tokens, the sampling estimate and the greedy streak side by
    side: one line per configuration (mean over seeds), a band of its 95% interval."""
    from matplotlib.figure import Figure

    from dflash_train.sweep.plots import legend, save_figure, style

    fig = Figure(figsize=(14, 5.5))
    configurations = list(dict.fromkeys(o.configuration for o in outcomes))
    for panel, (metric, title) in enumerate((("tau", "held-out tau, sampling estimate"),
                                             ("tau_greedy", "held-out tau, greedy streak (what greedy decoding accepts)"))):
        ax = fig.add_subplot(1, 2, panel + 1)
        drawn = 0
        for i, c in enumerate(configurations):
            curve = mean_curve([o for o in outcomes if o.configuration == c], metric)
            if not curve:
                continue
            line_style = style(i)
            xs = [t for _, t, _, _ in curve]
            ax.plot(xs, [m for _, _, m, _ in curve], label=c + (" (reference)" if c == reference else ""),
                    linewidth=2.6 if c == reference else 1.3, **line_style)
            if all(iv.n >= 2 for *_, iv in curve):
                ax.fill_between(xs, [iv.low for *_, iv in curve], [iv.high for *_, iv in curve], color=line_style["color"],
                                alpha=0.12, linewidth=0)
            drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, "no held-out curve (curve_points = 0 or no finished run)", ha="center", va="center",
                    transform=ax.transAxes)
        ax.set_xlabel("training tokens")
        ax.set_ylabel("held-out tau (acceptance length)")
        ax.set_title(f"{title}\nmean over seeds, 95% band", fontsize="medium")
        ax.grid(alpha=0.3)
        if panel == 1:
            legend(fig, ax, drawn)
    save_figure(fig, Path(path))


def plot_differences(summary: Summary, path: str | Path) -> None:
    """Each configuration's paired difference from the reference, with its interval: offline tau
    and, where measured, the real accepted length."""
    from matplotlib.figure import Figure

    from dflash_train.sweep.plots import save_figure

    rows = [r for r in summary.rows if not r["reference"]]
    fig = Figure(figsize=(9, 1.2 + 0.45 * max(len(rows), 1)))
    ax = fig.add_subplot()
    series = [("tau_vs_reference", "held-out tau (sampling estimate)", "C0"),
              ("tau_greedy_vs_reference", "held-out tau (greedy streak)", "C2"),
              ("accepted_length_vs_reference", "real accepted length, greedy", "C3")]
    if summary.sample_temperature:
        series.append(("accepted_length_sampled_vs_reference",
                       f"real accepted length, T={summary.sample_temperature:g}", "C1"))
    for offset, (key, label, color) in enumerate(series):
        ys, xs, lo, hi = [], [], [], []
        for i, r in enumerate(rows):
            if r[key] is not None:
                ys.append(i + (offset - (len(series) - 1) / 2) * 0.2)
                xs.append(r[key].mean)
                lo.append(r[key].mean - r[key].low)
                hi.append(r[key].high - r[key].mean)
        if xs:
            ax.errorbar(xs, ys, xerr=[lo, hi], fmt="o", color=color, label=label, markersize=4, capsize=2)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["configuration"] for r in rows], fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel(f"difference from {summary.reference} (paired by seed, 95% interval)")
    ax.grid(alpha=0.3, axis="x")
    if rows:
        ax.legend(fontsize="small")
    save_figure(fig, Path(path))


SUMMARY_FILES = ("summary.md", "summary.csv", "tau_vs_tokens.png", "difference_from_reference.png")


def write_summary(out: str | Path, outcomes: Sequence[RunOutcome], reference: str) -> str:
    """Write SUMMARY_FILES into the sweep folder; returns the text of summary.md."""
    from dflash_common.files import write_file_atomic

    out = Path(out)
    summary = summarize(outcomes, reference)
    markdown = summary_markdown(summary)
    write_file_atomic(out / "summary.md", markdown.encode())
    write_file_atomic(out / "summary.csv", summary_csv(summary).encode())
    plot_tau_vs_tokens(outcomes, out / "tau_vs_tokens.png", reference)
    plot_differences(summary, out / "difference_from_reference.png")
    return markdown
