"""Does the vLLM engine idle between shards? `dflash-cache build --engine vllm` against vLLM's bare
prefill of the same token ids, in one run.

The build's throughput (tokens / the build's own clock: tokenize, send, generate with state
capture, receive, fp32 head, checks, write, commit; engine start-up apart) is divided by the
throughput of a bare `generate(prompt_token_ids, max_tokens=1)` over the same token ids, with the
same engine options (VllmArgs, dtype, max_model_len, seed) and no capture. Issue 33's goal is
>= 0.9x. Two builds: one shard at a time (the engine waits while the build takes, checks and writes
each shard: the behaviour before issue 33) and the shipped pipelined build (the next shard is in
the engine's queue while the build handles the previous one). The bare prefill runs twice: all
sequences in one generate (the engine's best), and one generate per shard, back to back (the
same per-shard groups the build runs; what cutting into shards costs on its own). Also reported:
the seconds inside the build's generates (capture included) and the seconds the engine waited
for its next shard.

Teacher: a random qwen3 (hidden 512, 8 layers, vocab 4,096) with the quickstart tokenizer. Its
LM head is ~8% of a token's forward FLOPs, near the production teacher's share (Qwen3.6-27B:
~5%): on CPU the build's fp32 head runs on the same cores as the engine, so a teacher with a
larger share (the quickstart one: vocab 512 but hidden 128) would measure the head, not the
pipeline.

    DFLASH_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python benchmarks/bench_vllm_build.py          # 256 rows (~8 min)
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

from dflash_cache import format as fmt  # noqa: E402
from dflash_cache import open_cache  # noqa: E402
from dflash_cache.build import BuildConfig, build_cache  # noqa: E402
from dflash_cache.corpus import CorpusConfig  # noqa: E402
from dflash_cache.writer import StorageConfig  # noqa: E402
from dflash_common.vllm_env import find_vllm_python  # noqa: E402
from dflash_teacher.settings.vllm_args import VllmArgs  # noqa: E402
from dflash_teacher.teacher import TeacherConfig, load_config  # noqa: E402
from dflash_teacher.vllm_engine import VllmTeacher, engine_setup, worker_environment  # noqa: E402
from dflash_teacher.vllm_process import VllmWorker  # noqa: E402

MAX_LENGTH = 2048
TAPS = 3
TOP_K = 32


def make_teacher(folder: Path) -> str:
    return wide_teacher(folder, vocab_size=4096, layers=8)


def teacher_config(teacher: str) -> TeacherConfig:
    return TeacherConfig(name_or_path=teacher, dtype="float32", num_tapped_layers=TAPS, top_k=TOP_K)


def build(teacher: str, data: str, out: Path, shard_bytes: int, in_flight: int) -> dict:
    """One vLLM build with `in_flight` shards with the engine at once (1: one shard at a time)."""
    cfg = BuildConfig(out=str(out), corpus=CorpusConfig(data=data, max_length=MAX_LENGTH), teacher=teacher_config(teacher),
                      storage=StorageConfig(shard_bytes=shard_bytes), engine="vllm")
    engine = {}
    original_close, original_depth = VllmTeacher.close, VllmTeacher.shards_in_flight

    def close(vt):  # the engine's seconds, read before it goes
        engine.update(generate_s=vt.engine_seconds, waited_s=vt.engine_waited_seconds)
        original_close(vt)

    VllmTeacher.close, VllmTeacher.shards_in_flight = close, in_flight
    start = time.perf_counter()
    try:
        manifest = build_cache(cfg)
    finally:
        VllmTeacher.close, VllmTeacher.shards_in_flight = original_close, original_depth
    run = manifest["last_run"]
    return {"in_flight": in_flight, "tokens": run["tokens"], "build_s": run["seconds"],
            "startup_s": time.perf_counter() - start - run["seconds"], **engine}


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
    parser.add_argument("--rounds", type=int, default=2, help="builds of each kind, interleaved")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--quick", action="store_true", help="32 rows, 512-token shards (a smoke test)")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.shard_tokens, args.rounds = 32, 512, 1
    (ROOT / ".bench-tmp").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-build-", dir=ROOT / ".bench-tmp") as tmp:
        work = Path(tmp)
        with open(ROOT / "examples" / "data" / "chat.jsonl") as f:
            (work / "chat.jsonl").write_text("".join(itertools.islice(f, args.rows)))
        teacher = make_teacher(work / "teacher")
        hidden = int(load_config(teacher_config(teacher)).hidden_size)
        shard_bytes = args.shard_tokens * fmt.hidden_bytes_per_token(TAPS, hidden, "float32")
        builds = []
        for round_ in range(args.rounds):  # interleaved: the machine's load drifts
            for depth in (1, 2):
                builds.append(build(teacher, str(work / "chat.jsonl"), work / f"cache-{round_}-{depth}", shard_bytes, depth))
                builds[-1]["round"] = round_
        for run in builds:
            assert run["tokens"] == builds[0]["tokens"]
        groups = shard_groups(work / "cache-0-2")
        bare = bare_prefill(teacher, groups, args.vllm_python)
        reference = [np.asarray(r.hidden) for r in open_cache(str(work / "cache-0-1")).sequences()]
        same = all(all(np.array_equal(a, np.asarray(b.hidden)) for a, b in
                       zip(reference, open_cache(str(work / f"cache-{run['round']}-{run['in_flight']}")).sequences()))
                   for run in builds)
    tokens = bare["tokens"]
    assert tokens == builds[0]["tokens"], (tokens, builds[0]["tokens"])
    bare_one, bare_shards = tokens / min(bare["one_generate_s"]), tokens / min(bare["per_shard_s"])
    print(f"{args.rows} rows, {tokens:,} tokens in {len(groups)} shards of ~{args.shard_tokens} tokens; float32, "
          f"{TAPS} taps, top-{TOP_K}; engine start-up apart (builds: "
          f"{', '.join(str(round(run['startup_s'])) for run in builds)} s, bare: {bare['startup_s']:.0f} s)\n")
    print(f"bare prefill, one generate: {bare_one:,.0f} tok/s (runs: "
          f"{', '.join(f'{tokens / s:,.0f}' for s in bare['one_generate_s'])}); one generate per shard: "
          f"{bare_shards:,.0f} tok/s (runs: {', '.join(f'{tokens / s:,.0f}' for s in bare['per_shard_s'])})\n")
    print("| build | round | tok/s | / bare prefill (one generate) | / bare prefill (per shard) | generate s | "
          "engine waited s | build s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for run in sorted(builds, key=lambda r: (r["in_flight"], r["round"])):
        rate = run["tokens"] / run["build_s"]
        name = "one shard at a time" if run["in_flight"] == 1 else f"pipelined ({run['in_flight']} in flight)"
        print(f"| {name} | {run['round'] + 1} | {rate:,.0f} | {rate / bare_one:.2f}x | {rate / bare_shards:.2f}x | "
              f"{run['generate_s']:.1f} | {run['waited_s']:.1f} | {run['build_s']:.1f} |")
    best = {depth: max(r["tokens"] / r["build_s"] for r in builds if r["in_flight"] == depth) for depth in (1, 2)}
    print(f"\nbest of each: one shard at a time {best[1] / bare_one:.2f}x, pipelined {best[2] / bare_one:.2f}x of the bare "
          f"prefill in one generate ({best[2] / best[1]:.2f}x faster); the builds' hidden states are "
          f"{'byte-identical' if same else 'NOT identical'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"builds": builds, "bare": bare, "identical": same}, indent=1))


if __name__ == "__main__":
    main()
