"""Serving speed: vLLM with and without the drafter against the built-in decoder, on the quickstart teacher.

Same teacher (examples/teacher, float32), same drafter (an export, by default the quickstart's
demo/run/drafter; without one a drafter is trained for --train-steps on the first 600 corpus rows),
same held-out prompts as token ids, greedy. Reported per engine: tokens/s with the drafter,
tokens/s of the teacher alone in the same engine, their ratio, and the mean accepted length per
draft step (vLLM: 1 + accepted / drafts from its spec-decode counters; built-in: tokens per verify
forward). vLLM decodes all prompts as one batch (continuous batching), the built-in decoder one
prompt at a time, so compare the ratios within an engine; across engines only the accepted length
is like for like.

Timings are interleaved in --rounds rounds (teacher, drafter, teacher, drafter, ...) in one vLLM
process and one built-in process, and the best round of each is reported (this machine is noisy).

    .venv/bin/python benchmarks/bench_serving.py            # 40 prompts x 128 tokens, 2 rounds (~5 min)
    .venv/bin/python benchmarks/bench_serving.py --quick    # 4 prompts x 64 tokens, 1 round
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from dflash_build import BuildConfig, build_cache  # noqa: E402
from dflash_corpus import CorpusConfig  # noqa: E402
from dflash_teacher.chat_template import stop_token_ids  # noqa: E402
from dflash_teacher.teacher import TeacherConfig, load_teacher  # noqa: E402
from dflash_train.measuring.decode_report import read_prompts  # noqa: E402
from dflash_train.measuring.replay import load_trained_drafter  # noqa: E402
from dflash_train.measuring.serving import EngineRun, run_vllm, spec_summary  # noqa: E402
from dflash_train.measuring.speculative import mean_accepted_length, speculative_generate, teacher_generate  # noqa: E402
from dflash_train.settings.data_config import DataConfig  # noqa: E402
from dflash_train.settings.model_config import ModelConfig  # noqa: E402
from dflash_train.settings.optim_config import OptimConfig  # noqa: E402
from dflash_train.settings.spec_config import SpecConfig  # noqa: E402
from dflash_train.settings.train_config import TrainConfig  # noqa: E402
from dflash_train.settings.vllm_config import VllmConfig  # noqa: E402
from dflash_train.training.export import read_export_config  # noqa: E402
from dflash_train.training.trainer import train  # noqa: E402

TEACHER = ROOT / "examples" / "teacher"
PROMPTS = ROOT / "examples" / "data" / "heldout_prompts.jsonl"


def quick_drafter(work: Path, steps: int) -> Path:
    """A quickstart-shaped drafter (3 layers, B = 8) trained briefly on the shipped corpus."""
    with open(ROOT / "examples" / "data" / "chat.jsonl") as f:
        rows = list(itertools.islice(f, 600))
    (work / "chat.jsonl").write_text("".join(rows))
    build_cache(BuildConfig(out=str(work / "cache"), corpus=CorpusConfig(data=str(work / "chat.jsonl")),
                            teacher=TeacherConfig(name_or_path=str(TEACHER), dtype="float32", num_tapped_layers=3, top_k=16)))
    cfg = TrainConfig(cache=str(work / "cache"), out=str(work / "run"), steps=steps, eval_sequences=0, save_every=steps,
                      model=ModelConfig(num_layers=3, block_size=8), optim=OptimConfig(lr=1e-3),
                      data=DataConfig(batch_tokens=1600, anchors="random", num_anchors=8, heldout_fraction=0.05))
    return train(cfg).export_dir


def builtin_rounds(drafter_dir: Path, prompts, spec: SpecConfig, rounds: int) -> dict:
    teacher = load_teacher(TeacherConfig(name_or_path=str(TEACHER), dtype="float32", device="cpu", top_k=1))
    model = teacher.model
    drafter = load_trained_drafter(str(drafter_dir), model.get_input_embeddings().weight.detach(),
                                   model.get_output_embeddings().weight.detach(), teacher.device)
    alone, spec_rate, accepted = [], [], None
    for _ in range(rounds):
        start = time.perf_counter()
        base = [teacher_generate(model, p.ids, spec) for p in prompts]
        alone.append(sum(len(r.tokens) for r in base) / (time.perf_counter() - start))
        start = time.perf_counter()
        results = [speculative_generate(model, drafter, p.ids, spec) for p in prompts]
        spec_rate.append(sum(len(r.tokens) for r in results) / (time.perf_counter() - start))
        accepted = mean_accepted_length(results)
        assert [r.tokens for r in results] == [r.tokens for r in base], "built-in output differs from the teacher's"
    return {"teacher": max(alone), "drafter": max(spec_rate), "accepted_length": accepted,
            "outputs": [r.tokens for r in base]}


def vllm_rounds(drafter_dir: Path, prompts, spec: SpecConfig, rounds: int, python: str | None) -> dict:
    block = read_export_config(drafter_dir).block_size
    runs = []
    for i in range(rounds):
        runs += [EngineRun(f"teacher-{i}"), EngineRun(f"drafter-{i}", str(drafter_dir), block - 1)]
    result = run_vllm(VllmConfig(python=python), str(TEACHER), [p.ids for p in prompts], spec.max_new_tokens,
                      spec.stop_token_ids, runs)

    def rate(run):
        return sum(len(o) for o in run["outputs"]) / run["seconds"]

    teachers = [r for r in result["runs"] if r["name"].startswith("teacher")]
    drafted = [r for r in result["runs"] if r["name"].startswith("drafter")]
    for run in drafted:
        assert run["outputs"] == teachers[0]["outputs"], "vLLM's output with the drafter differs from the teacher's"
    return {"teacher": max(map(rate, teachers)), "drafter": max(map(rate, drafted)),
            "accepted_length": spec_summary(drafted[-1], block)["accepted_length"],
            "outputs": teachers[0]["outputs"], "version": result["vllm_version"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default=str(ROOT / "demo" / "run" / "drafter"), help="an exported drafter folder")
    parser.add_argument("--train-steps", type=int, default=300, help="steps of the drafter trained when --drafter is missing")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--quick", action="store_true", help="4 prompts x 64 tokens, 1 round (a smoke test)")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.max_new_tokens, args.rounds, args.train_steps = 4, 64, 1, 30

    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        drafter = Path(args.drafter)
        if not (drafter / "config.json").exists():
            print(f"no drafter at {drafter}: training one for {args.train_steps} steps", file=sys.stderr)
            drafter = quick_drafter(Path(tmp), args.train_steps)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(TEACHER)
        prompts = read_prompts(str(PROMPTS), tokenizer, args.prompts)
        spec = SpecConfig(max_new_tokens=args.max_new_tokens, stop_token_ids=stop_token_ids(tokenizer))
        builtin = builtin_rounds(drafter, prompts, spec, args.rounds)
        served = vllm_rounds(drafter, prompts, spec, args.rounds, args.vllm_python)

    same = served["outputs"] == builtin["outputs"]
    print(f"## Serving (`bench_serving.py`): {len(prompts)} held-out prompts x {args.max_new_tokens} tokens, greedy, "
          f"float32, best of {args.rounds} round(s); vLLM {served['version']}; drafter {args.drafter if drafter == Path(args.drafter) else 'trained here'}\n")
    print("| engine | teacher alone tokens/s | with drafter tokens/s | speedup | accepted length |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, row in (("built-in decoder (one prompt at a time)", builtin), ("vLLM (all prompts batched)", served)):
        print(f"| {name} | {row['teacher']:,.1f} | {row['drafter']:,.1f} | {row['drafter'] / row['teacher']:.2f}x | "
              f"{row['accepted_length']:.3f} |")
    print(f"\nvLLM's accepted length / built-in's: {served['accepted_length'] / builtin['accepted_length']:.4f}; "
          f"teacher outputs equal across engines: {'yes' if same else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"builtin": {k: v for k, v in builtin.items() if k != "outputs"},
                                               "vllm": {k: v for k, v in served.items() if k != "outputs"},
                                               "outputs_equal": same}, indent=1))


if __name__ == "__main__":
    main()
