"""Stage-1 speed: `dflash-cache build` with the transformers engine against the vLLM engine.

The same corpus (the first --rows rows of the quickstart corpus), the same teacher, float32, the
same taps and top-k, built once by each engine in one run; the caches are compared (ids equal,
top-1 agreement, hidden-state and log-prob error). Rates, tokens per second:
- end to end: the build's own clock (manifest last_run: tokenize, forward, top-k, write,
  commit), the teacher load and vLLM's start-up excluded (reported apart);
- engine: seconds inside the teacher forward (transformers: the padded forward and the fp32
  head; vLLM: generate, the states' trip over the socket and the same fp32 head), and vLLM's
  generate alone.
Then the other way to get top-k from vLLM: its own `prompt_logprobs=k` (one more engine start),
timed and compared with the transformers engine's fp32 head.

Teachers: the shipped quickstart teacher (qwen3, hidden 128, 8 layers, vocab 512) and a wider
random qwen3 (hidden 512, 6 layers, vocab 32,768).

    DFLASH_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python benchmarks/bench_build.py           # 256 rows (~10 min)
    DFLASH_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python benchmarks/bench_build.py --quick   # 16 rows, quickstart only
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from dflash_build import BuildConfig, build_cache  # noqa: E402
from dflash_cache import open_cache  # noqa: E402
from dflash_cache.settings.storage_config import StorageConfig  # noqa: E402
from dflash_corpus import CorpusConfig  # noqa: E402
from dflash_teacher.settings.vllm_args import VllmArgs  # noqa: E402
from dflash_teacher.teacher import Teacher, TeacherConfig  # noqa: E402
from dflash_teacher.vllm_engine import VllmTeacher, load_vllm_teacher  # noqa: E402

QUICKSTART = str(ROOT / "examples" / "teacher")
TOP_K = 32


def wide_teacher(folder: Path, vocab_size: int = 32768, layers: int = 6) -> str:
    """A random qwen3 wider than the quickstart's, with the quickstart's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=512, num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=64, intermediate_size=1536, max_position_embeddings=4096,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


class ForwardClock:
    """Seconds spent in the teachers' forward (both engines), counted around the method."""

    def __init__(self):
        self.seconds = 0.0
        self.originals = {cls: cls.forward for cls in (Teacher, VllmTeacher)}

    def __enter__(self):
        for cls, original in self.originals.items():
            def timed(teacher, sequences, _original=original):
                start = time.perf_counter()
                try:
                    return _original(teacher, sequences)
                finally:
                    self.seconds += time.perf_counter() - start
            cls.forward = timed
        return self

    def __exit__(self, *exc):
        for cls, original in self.originals.items():
            cls.forward = original


def build(teacher: str, data: str, out: Path, engine: str) -> dict:
    cfg = BuildConfig(out=str(out), corpus=CorpusConfig(data=data, max_length=2048),
                      teacher=TeacherConfig(name_or_path=teacher, dtype="float32", num_tapped_layers=3, top_k=TOP_K),
                      storage=StorageConfig(shard_bytes=64 * 2**20), engine=engine)
    engine_seconds = []
    original_close = VllmTeacher.close

    def close(teacher):  # the generate seconds, read before the engine goes
        engine_seconds.append(teacher.engine_seconds)
        original_close(teacher)

    VllmTeacher.close = close
    start = time.perf_counter()
    try:
        with ForwardClock() as clock:
            manifest = build_cache(cfg)
    finally:
        VllmTeacher.close = original_close
    wall = time.perf_counter() - start
    run = manifest["last_run"]
    return {"engine": engine, "tokens": run["tokens"], "wall_s": wall, "build_s": run["seconds"],
            "startup_s": wall - run["seconds"], "forward_s": clock.seconds,
            "generate_s": engine_seconds[0] if engine_seconds else None}


def records(url: Path) -> dict:
    return {r.id: r for r in open_cache(str(url)).sequences()}


def agreement(reference: dict, ids: dict, logprobs: dict) -> dict:
    """Top-1 agreement and the largest log-prob difference on ids both top-k lists hold."""
    top1, worst = [], 0.0
    for key, r in reference.items():
        top1.append(r.topk_ids[:, 0] == ids[key][:, 0])
        for t in range(len(r.topk_ids)):
            a = dict(zip(r.topk_ids[t].tolist(), r.topk_logprobs[t].tolist()))
            b = dict(zip(ids[key][t].tolist(), logprobs[key][t].tolist()))
            worst = max([worst] + [abs(a[i] - b[i]) for i in a.keys() & b.keys()])
    return {"top1": float(np.concatenate(top1).mean()), "logprob_error": worst}


def hidden_error(reference: dict, other: dict) -> float:
    return max(float(np.linalg.norm(np.asarray(r.hidden, np.float64) - np.asarray(other[k].hidden, np.float64))
                     / np.linalg.norm(np.asarray(r.hidden, np.float64))) for k, r in reference.items())


def prompt_logprobs(teacher: str, reference: dict, vllm_python: str | None) -> dict:
    """vLLM's own top-k (prompt_logprobs) over the cached sequences, in one generate."""
    cfg = TeacherConfig(name_or_path=teacher, dtype="float32", num_tapped_layers=3, top_k=TOP_K)
    vt = load_vllm_teacher(cfg, VllmArgs(), 2048, vllm_python, prompt_logprobs=TOP_K)
    try:
        sequences = [r.input_ids.astype(np.int32) for r in reference.values()]
        reply = vt.worker.run(sequences)
        vt.receiver.take(reply["requests"], vt.worker.alive)  # the states came too; not used here
    finally:
        vt.close()
    n = sum(len(s) for s in sequences)
    flat_ids = np.frombuffer(reply["payload"][:n * TOP_K * 4], dtype=np.int32).reshape(n, TOP_K)
    flat_lp = np.frombuffer(reply["payload"][n * TOP_K * 4:], dtype=np.float32).reshape(n, TOP_K)
    ids, lps, start = {}, {}, 0
    for key, seq in zip(reference, sequences):
        ids[key], lps[key] = flat_ids[start:start + len(seq)], flat_lp[start:start + len(seq)]
        start += len(seq)
    return {"tokens": n, "generate_s": reply["seconds"], "objects_s": reply["logprobs_seconds"],
            **agreement(reference, ids, lps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--quick", action="store_true", help="16 rows, the quickstart teacher only (a smoke test)")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args()
    if args.quick:
        args.rows = 16
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-build-") as tmp:
        work = Path(tmp)
        with open(ROOT / "examples" / "data" / "chat.jsonl") as f:
            (work / "chat.jsonl").write_text("".join(itertools.islice(f, args.rows)))
        teachers = {"quickstart": QUICKSTART}
        if not args.quick:
            teachers["wide (hidden 512, vocab 32k)"] = wide_teacher(work / "wide")
        for name, teacher in teachers.items():
            runs = {engine: build(teacher, str(work / "chat.jsonl"), work / f"{name[:4]}-{engine}", engine)
                    for engine in ("transformers", "vllm")}
            reference, other = records(work / f"{name[:4]}-transformers"), records(work / f"{name[:4]}-vllm")
            head = agreement(reference, {k: r.topk_ids for k, r in other.items()},
                             {k: r.topk_logprobs for k, r in other.items()})
            prompt = prompt_logprobs(teacher, reference, args.vllm_python)
            results.append({"teacher": name, "runs": runs, "hidden_error": hidden_error(reference, other),
                            "head": head, "prompt_logprobs": prompt})
    print(f"rows {args.rows}, float32, 3 taps, top-k {TOP_K}; tokens/s = tokens / seconds\n")
    print("| teacher | engine | tokens | start-up s | end to end tok/s | forward tok/s | vLLM generate tok/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        for engine, run in r["runs"].items():
            gen = f"{run['tokens'] / run['generate_s']:,.0f}" if run["generate_s"] else "-"
            print(f"| {r['teacher']} | {engine} | {run['tokens']:,} | {run['startup_s']:.1f} | "
                  f"{run['tokens'] / run['build_s']:,.0f} | {run['tokens'] / run['forward_s']:,.0f} | {gen} |")
    print("\n| teacher | vLLM / transformers, end to end | forward | hidden rel. error | top-1 (head) | "
          "log-prob error (head) | prompt_logprobs: generate tok/s | + objects s | top-1 | log-prob error |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        t, v, p = r["runs"]["transformers"], r["runs"]["vllm"], r["prompt_logprobs"]
        ratio_e2e = (v["tokens"] / v["build_s"]) / (t["tokens"] / t["build_s"])
        ratio_fwd = (v["tokens"] / v["forward_s"]) / (t["tokens"] / t["forward_s"])
        print(f"| {r['teacher']} | {ratio_e2e:.2f}x | {ratio_fwd:.2f}x | {r['hidden_error']:.1e} | {r['head']['top1']:.4f} | "
              f"{r['head']['logprob_error']:.1e} | {p['tokens'] / p['generate_s']:,.0f} | {p['objects_s']:.2f} | "
              f"{p['top1']:.4f} | {p['logprob_error']:.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
