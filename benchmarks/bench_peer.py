"""dflash against speculators 0.9's DFlash trainer on the same bytes (issue 54), served by vLLM.

    python benchmarks/bench_peer.py [--out peer] [--caches quickstart,manpages] [--seeds 3] [--steps 400] [--arms dflash,...]

Per cache (examples/recipe.py's caches, built under OUT/caches) and seed, every arm trains the same
drafter shape (3 layers, block 8) from the cache's bytes for the same steps over the same batches
and the same anchors (the default cover anchors: every answer position once an epoch):

    dflash            our defaults (soft-label KL, streak weights, AdamW, cosine)
    dflash-ce-dpace   ours with --loss ce --weighting dpace (speculators' objective)
    dflash-causal     ours with --causal (blocks causal inside, as speculators' default layers)
    dflash-top1       ours with --loss top1 (cross-entropy on the teacher's greedy token: speculators'
                      ce) and our streak weights
    dflash-kl-top1    ours with --loss-terms '{"kl": 1, "top1": 1}': the teacher's distribution and
                      its greedy choice
    speculators       speculators 0.9's DFlash step and its defaults (ce, D-PACE, Muon + AdamW,
                      linear schedule, clip 1.0, sliding layers causal inside the block), driven
                      by benchmarks/peer_speculators.py in the `make serving` environment on
                      batches this script writes from our loader, starting from our initial weights

Each drafter is then decoded with the teacher on the cache's held-out prompts: greedy in vLLM
0.32 (its engine and DFlash proposer; accepted length from its counters) and greedy and at T = 1
in dflash's decoder. OUT/<cache>/summary.md: means, 95% t-intervals over seeds, differences from
speculators paired by seed. Everything resumes: a finished run or eval is not redone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

import recipe  # noqa: E402  (the study caches and the man-page teacher)

OURS: dict[str, dict] = {
    "dflash": {},
    "dflash-ce-dpace": {"loss": {"kind": "ce", "weighting": "dpace"}},
    "dflash-causal": {"model": {"causal": True}},
    "dflash-top1": {"loss": {"kind": "top1"}},
    "dflash-kl-top1": {"loss": {"terms": {"kl": 1.0, "top1": 1.0}}},
}
"""Our arms: the settings each sets on top of the base config."""

PEER = "speculators"
TEMPERATURES = (0.0, 1.0)


@dataclass(frozen=True)
class PeerSettings:
    """The study's sizes (the objectives study's: the quickstart drafter's shape)."""

    out: Path = ROOT / "peer"
    steps: int = 400
    seeds: int = 3
    num_layers: int = 3
    block_size: int = 8
    batch_tokens: int = 1000
    lr: float = 1e-3
    max_prompts: int = 48
    max_new_tokens: int = 48
    vllm_python: str = str(ROOT / ".venv-vllm" / "bin" / "python")


def base_config(cache: str, out: Path, seed: int, s: PeerSettings, extra: dict) -> dict:
    """Our train config of one run (nested plain values)."""
    values = {"cache": cache, "out": str(out), "steps": s.steps, "device": "cpu", "seed": seed, "eval_sequences": 0,
              "log_every": max(1, s.steps // 10), "save_every": s.steps,
              "model": {"num_layers": s.num_layers, "block_size": s.block_size},
              "data": {"batch_tokens": s.batch_tokens, "seed": seed, "num_workers": 0},
              "optim": {"lr": s.lr}}
    for section, fields in extra.items():
        values.setdefault(section, {}).update(fields)
    return values


def train_ours(values: dict) -> Path:
    """Train one of our arms (skipped when its export exists); its export folder."""
    from dflash_train.config import config_from_dict
    from dflash_train.training.trainer import train

    drafter = Path(values["out"]) / "drafter"
    if not (drafter / "model.safetensors").exists():
        train(config_from_dict(values), resume=(Path(values["out"]) / "checkpoints").exists())
    return drafter


def peer_batch(batch, block_size: int) -> dict:
    """One of our packed batches as speculators' forward takes it: [1, W] tensors with each
    sequence followed by block_size padding positions (document -1, no loss), so no block reaches
    into the next sequence, and the anchors as absolute positions."""
    import torch

    parts, anchors, start = {k: [] for k in ("hidden", "input_ids", "loss_mask", "document_ids", "position_ids",
                                             "topk_ids", "topk_logprobs")}, [], 0
    for i in range(len(batch.ids)):
        t = int(batch.lengths[i])
        pad = block_size
        hidden = batch.sequence("hidden", i).float()
        parts["hidden"].append(torch.cat([hidden.flatten(1), hidden.new_zeros(pad, hidden[0].numel())]))
        parts["input_ids"].append(torch.cat([batch.sequence("input_ids", i), torch.zeros(pad, dtype=torch.long)]))
        parts["loss_mask"].append(torch.cat([batch.sequence("loss_mask", i).long(), torch.zeros(pad, dtype=torch.long)]))
        parts["document_ids"].append(torch.cat([torch.full((t,), i), torch.full((pad,), -1)]))
        parts["position_ids"].append(torch.arange(t + pad))
        ids = batch.sequence("topk_ids", i)
        parts["topk_ids"].append(torch.cat([ids, ids.new_zeros(pad, ids.shape[1])]))
        logprobs = batch.sequence("topk_logprobs", i)
        parts["topk_logprobs"].append(torch.cat([logprobs, logprobs.new_zeros(pad, logprobs.shape[1])]))
        own = batch.anchors[i]
        anchors.append(own[own >= 0] + start)
        start += t + pad
    out = {k: torch.cat(v).unsqueeze(0) for k, v in parts.items()}
    out["anchors"] = torch.cat(anchors)
    out["anchor_valid"] = torch.ones(len(out["anchors"]), dtype=torch.bool)
    return out


def write_batches(values: dict, folder: Path, steps: int) -> Path:
    """The batches our trainer reads for this config, step by step (one micro-batch a step), in
    speculators' layout, noise-free (our noise is our recipe's, drawn in the trainer)."""
    import torch

    from dflash_cache import open_cache
    from dflash_train.config import config_from_dict
    from dflash_train.training.data import LoaderState, train_loader
    from dflash_train.training.epoch_plan import EpochPlan

    if len(list(folder.glob("step-*.pt"))) >= steps:
        return folder
    cfg = config_from_dict(values)
    cache = open_cache(cfg.cache)
    plan = EpochPlan(cache, cfg.data)
    state = LoaderState(manifest_fingerprint=cache.fingerprint, partitions=1)
    folder.mkdir(parents=True, exist_ok=True)
    batches = iter(train_loader(cfg.cache, None, cfg.data, state, plan=plan,
                                draft_positions=cfg.model.block_size - 1))
    for step in range(steps):
        torch.save(peer_batch(next(batches), cfg.model.block_size), folder / f"step-{step:06d}.pt")
    return folder


def initial_export(values: dict, out: Path, causal: bool) -> Path:
    """Our drafter as our trainer initialises it for this config (seeded), exported: the peer's start."""
    import torch

    from dflash_cache import open_cache
    from dflash_train.config import config_from_dict
    from dflash_train.training.export import export_drafter
    from dflash_train.training.session import build_drafter

    if (out / "model.safetensors").exists():
        return out
    cfg = config_from_dict({**values, "model": {**values["model"], "causal": causal}})
    export_drafter(build_drafter(cfg, open_cache(cfg.cache), torch.device("cpu")), out, dtype=torch.float32)
    return out


def train_peer(values: dict, teacher: Path, run: Path, s: PeerSettings) -> Path:
    """speculators' arm (skipped when its export exists); its export folder."""
    drafter = run / "drafter"
    if (drafter / "model.safetensors").exists():
        return drafter
    batches = write_batches(values, run.parent / "batches", s.steps)
    init = initial_export(values, run / "init", causal=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([s.vllm_python, str(ROOT / "benchmarks" / "peer_speculators.py"), str(init), str(teacher),
                           str(batches), str(s.steps), str(drafter)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the speculators arm failed in {run}:\n{done.stderr[-3000:]}")
    return drafter


def evaluate(drafter: Path, teacher: Path, prompts: Path, s: PeerSettings) -> dict:
    """Real decoding of the held-out prompts: vLLM greedy, dflash's decoder greedy and at T = 1."""
    out = drafter.parent / "peer_eval.json"
    if not out.exists():
        command = [sys.executable, "-m", "cli.train", "eval", "--checkpoint", str(drafter), "--teacher", str(teacher),
                   "--prompts", str(prompts), "--max-prompts", str(s.max_prompts), "--max-new-tokens",
                   str(s.max_new_tokens), "--engine", "both", "--vllm-python", s.vllm_python, "--out", str(out),
                   "--quiet", *[a for t in TEMPERATURES for a in ("--temperature", str(t))]]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"eval of {drafter} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def answer_entropy(cache_url: str, limit: int = 500) -> float:
    """Mean per-token entropy (nats) of the teacher's next-token distribution over the answer
    positions of the first `limit` sequences, from the cache's top-k renormalised: how uncertain
    the teacher's own answers are (a lower bound on the full distribution's)."""
    import numpy as np

    from dflash_cache import open_cache

    total, count = 0.0, 0
    for n, record in enumerate(open_cache(cache_url).sequences()):
        if n == limit:
            break
        logprobs = record.topk_logprobs[np.asarray(record.loss_mask, dtype=bool)].astype(np.float64)
        p = np.exp(logprobs - logprobs.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        total += float(-(p * np.log(np.clip(p, 1e-30, None))).sum())
        count += len(p)
    return total / max(count, 1)


def measures(report: dict) -> dict[str, float]:
    """The accepted lengths one eval report gives: vLLM greedy, dflash's decoder greedy and at T = 1."""
    out = {"vllm T=0": report["vllm"]["accepted_length"]}
    for decoding in report["decodings"]:
        out[f"dflash T={decoding['temperature']:g}"] = decoding["accepted_length"]
    return out


def lossless(report: dict) -> bool:
    """Every greedy output equal to the teacher's, in vLLM and in dflash's decoder."""
    greedy = [d for d in report["decodings"] if d["temperature"] == 0]
    return bool(report["vllm"]["matched_teacher"]) and all(d["matched_teacher"] for d in greedy)


def summary(name: str, reports: dict[tuple[str, int], dict], entropy: float) -> str:
    """Markdown: per arm and measure the mean and 95% t-interval over seeds, and the difference from
    speculators paired by seed (* where its interval excludes 0)."""
    from dflash_train.measuring.summary_statistics import paired_difference, t_interval

    arms = list(dict.fromkeys(arm for arm, _ in reports))
    values = {key: measures(report) for key, report in reports.items()}
    columns = list(next(iter(values.values())))
    lines = [f"## {name}: answer entropy {entropy:.3f} nats a token (top-k renormalised)", "",
             "| arm | seeds | " + " | ".join(f"{c} | Δ vs {PEER}" for c in columns) + " | lossless |",
             "|---|---:|" + "---:|---:|" * len(columns) + "---|"]
    for arm in arms:
        seeds = sorted(seed for a, seed in reports if a == arm)
        cells = []
        for column in columns:
            own = {seed: values[arm, seed][column] for seed in seeds}
            peer = {seed: values[PEER, seed][column] for seed in seeds if (PEER, seed) in values}
            cells.append(t_interval(list(own.values())).text())
            diff = paired_difference(own, peer) if arm != PEER else None
            if diff is None:
                cells.append("")
                continue
            base = sum(peer.values()) / len(peer)
            star = " *" if diff.n > 1 and (diff.low > 0 or diff.high < 0) else ""
            cells.append(f"{diff.mean:+.3f} [{diff.low:+.3f}, {diff.high:+.3f}]{star} ({100 * diff.mean / base:+.1f}%)")
        ok = all(lossless(reports[arm, seed]) for seed in seeds)
        lines.append(f"| {arm} | {len(seeds)} | " + " | ".join(cells) + f" | {'yes' if ok else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PeerSettings.out)
    parser.add_argument("--caches", default="quickstart,manpages")
    parser.add_argument("--seeds", type=int, default=PeerSettings.seeds)
    parser.add_argument("--steps", type=int, default=PeerSettings.steps)
    parser.add_argument("--max-prompts", type=int, default=PeerSettings.max_prompts)
    parser.add_argument("--arms", default=",".join(OURS),
                        help=f"comma-separated, of our arms {', '.join(OURS)} (default all; {PEER} always runs)")
    args = parser.parse_args(argv)
    arms = {a.strip() for a in args.arms.split(",") if a.strip()}
    if arms - set(OURS):
        raise SystemExit(f"--arms {sorted(arms - set(OURS))[0]!r} is not one of our arms ({', '.join(OURS)})")
    s = PeerSettings(out=args.out, steps=args.steps, seeds=args.seeds, max_prompts=args.max_prompts)
    settings = recipe.RecipeSettings(out=args.out)
    for spec in (recipe.QUICKSTART, recipe.MANPAGES):
        if spec.name not in args.caches.split(","):
            continue
        teacher = spec.teacher or recipe.ensure_manpage_teacher(settings)
        cache = recipe.build(spec, teacher, settings)
        reports = {}
        for seed in range(s.seeds):
            for arm, extra in OURS.items():
                if arm not in arms:
                    continue
                run = args.out / spec.name / f"seed{seed}" / arm
                reports[arm, seed] = evaluate(train_ours(base_config(cache, run, seed, s, extra)), teacher,
                                              spec.prompts, s)
            run = args.out / spec.name / f"seed{seed}" / PEER
            drafter = train_peer(base_config(cache, run, seed, s, {}), teacher, run, s)
            reports[PEER, seed] = evaluate(drafter, teacher, spec.prompts, s)
            print(f"{spec.name} seed {seed}: done", flush=True)
        (args.out / spec.name / "reports.json").write_text(json.dumps({f"{a}|{sd}": r for (a, sd), r in reports.items()}))
        text = summary(spec.name, reports, answer_entropy(cache))
        (args.out / spec.name / "summary.md").write_text(text)
        print(text, flush=True)


if __name__ == "__main__":
    main()
