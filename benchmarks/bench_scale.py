"""The cache format at scale (issue #32): format 1 against format 2 at 1k and 10k shards.

Synthetic caches with the production shape's *counts* at a tiny width (hidden 8, 2 tapped layers,
top-k 2, one 2-token sequence a shard), so that thousands of shards fit this disk. Both layouts are
written in the same run by the real writer (`write_shard` with `version=1` or `2`, the commit
records, `ManifestKeeper` per rank, rank markers) as a 2-rank build, then merged by the real
`finalize_cache`. Per size and layout it measures:

- index bytes (format 1: manifest.json, which lists every record; format 2: manifest.json plus the
  merged `index/*.arrow` tables) and bytes a shard; files a shard (everything under `shards/`);
- `finalize` time (merging the 2 ranks), `open_cache` time and the trainer's start-up check
  (`integrity.quick_check`), with the local files opened and the folders listed during each,
  counted by strace on a fresh process doing just that (every ``openat`` under the cache, Arrow's
  native memory maps included; a folder opened is a listing); no product code is patched;
- `verify` time (`verify_cache`: every byte);
- with ``--s3 N``: the N-shard cache of each layout copied to the local moto S3 server (real S3 API
  on loopback) and opened there, counting the HTTP requests at open and at the start-up check
  (botocore's ``before-send`` event on the s3fs client).

Growth is reported as the ratio largest/smallest size. One process, no threads of our own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cache import format as fmt  # noqa: E402
from dflash_cache import integrity  # noqa: E402
from dflash_cache.commit import RANKS_DIR, ManifestKeeper, finalize_cache, rank_marker  # noqa: E402
from dflash_cache.reader import open_cache  # noqa: E402
from dflash_cache.settings.storage import StorageConfig
from dflash_cache.verify import verify_cache  # noqa: E402
from dflash_cache.writer import Committed, ShardData, sequences_table, write_shard

HIDDEN, LAYERS, TOP_K, SEQ_LEN, WORLD = 8, 2, 2, 2, 2


CHILD = """
import sys
from dflash_cache import integrity
from dflash_cache.reader import open_cache
cache = open_cache(sys.argv[2])
if sys.argv[1] == "check":
    integrity.quick_check(cache)
"""


def file_calls(root: Path, what: str) -> tuple[int, int] | tuple[None, None]:
    """(files opened, folders opened to list) under the cache by a fresh process that opens it
    (``what`` = "open") or opens it and runs the start-up check ("check"), seen by strace: every
    ``openat`` of the process, Arrow's and Zarr's native ones included, filtered to the cache's
    paths (imports are not under it). (None, None) where strace is not installed."""
    if shutil.which("strace") is None:
        return None, None
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as log:
        subprocess.run(["strace", "-f", "-qq", "-e", "trace=openat", "-o", log.name, sys.executable, "-c", CHILD, what,
                        str(root)], check=True, cwd=Path(__file__).resolve().parents[1],
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
        files = folders = 0
        for line in log:
            if f'"{root}' in line and "= -1" not in line:
                if "O_DIRECTORY" in line:
                    folders += 1
                else:
                    files += 1
    return files, folders


def synthetic_shard(rank: int, index: int, row: int, rng: np.random.Generator) -> ShardData:
    n = SEQ_LEN
    hidden = (rng.standard_normal((n, LAYERS, HIDDEN)).astype(np.float32) + 1.0)
    bits = (hidden.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits of a capture with no zero layer
    return ShardData(rank=rank, index=index, row_start=row, row_end=row + 1, ids=[f"s{rank}-{index:07d}"],
                     rows=np.array([row], np.int64), lengths=np.array([n], np.int32), truncated=np.zeros(1, bool),
                     input_ids=rng.integers(0, 100, n, dtype=np.int32), loss_mask=np.ones(n, np.uint8), hidden=bits,
                     topk_ids=np.tile(np.arange(TOP_K, dtype=np.int32), (n, 1)),
                     topk_logprobs=np.tile(np.array([-0.5, -1.5], np.float32), (n, 1)))


def write_cache(root: str, shards: int, version: int) -> float:
    """A 2-rank build of ``shards`` shards in format ``version``, each rank marked done (not yet
    finalized); returns the seconds it took."""
    fs, root = fmt.url_to_fs(root)
    header = fmt.manifest_header(list(range(LAYERS)), HIDDEN, "bfloat16", TOP_K, format_version=version,
                                 content_options={"world_size": WORLD})
    storage = StorageConfig()
    rng = np.random.default_rng(0)
    fs.makedirs(root, exist_ok=True)
    start = time.perf_counter()
    for rank in range(WORLD):
        keeper = ManifestKeeper(fs, root, dict(header), [], live=False, rank=rank)
        count = shards // WORLD + (rank < shards % WORLD)
        for index in range(count):
            shard = synthetic_shard(rank, index, index, rng)
            record = write_shard(fs, root, shard, storage, "bfloat16", version, list(range(LAYERS)))
            keeper.commit(record if version == 1 else Committed(record, sequences_table(shard)))
        if version != 1:
            keeper.checkpoint()
        fs.makedirs(fmt.join(root, RANKS_DIR), exist_ok=True)
        fmt.write_json_atomic(fs, rank_marker(root, rank), {"rank": rank, "seconds": 0.0, "tokens": count * SEQ_LEN,
                                                            "padding_fraction": 0.0})
    return time.perf_counter() - start


def index_bytes(root: Path) -> int:
    total = (root / fmt.MANIFEST).stat().st_size
    folder = root / "index"
    if folder.is_dir():
        total += sum(p.stat().st_size for p in folder.iterdir() if p.is_file())  # the merged tables
    return total


def files_under(folder: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(folder))


def measure(tmp: Path, shards: int, version: int) -> dict:
    root = tmp / f"v{version}-{shards}"
    row = {"shards": shards, "version": version, "write_s": write_cache(str(root), shards, version)}
    start = time.perf_counter()
    finalize_cache(str(root))
    row["finalize_s"] = time.perf_counter() - start
    row["index_bytes"] = index_bytes(root)
    row["files_per_shard"] = files_under(root / "shards") / shards
    start = time.perf_counter()
    cache = open_cache(str(root))
    row["open_s"] = time.perf_counter() - start
    row["open_opened"], row["open_listed"] = file_calls(root, "open")
    assert len(cache.shards) == shards, (len(cache.shards), shards)
    start = time.perf_counter()
    problems = integrity.quick_check(cache)
    row["check_s"] = time.perf_counter() - start
    assert not problems, problems
    opened, listed = file_calls(root, "check")
    row["check_opened"], row["check_listed"] = ((opened - row["open_opened"], listed - row["open_listed"])
                                                if opened is not None else (None, None))
    start = time.perf_counter()
    report = verify_cache(open_cache(str(root)))
    row["verify_s"] = time.perf_counter() - start
    damaged = getattr(report, "damaged", None) or getattr(report, "problems", None)
    assert not damaged, damaged
    row["root"] = str(root)
    return row


def s3_requests(rows: list[dict], shards: int) -> list[dict]:
    """Copy each layout's cache of ``shards`` shards to the local moto server and count the
    requests at open and at the start-up check."""
    import logging

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    out = []
    try:
        host, port = server.get_host_and_port()
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=f"http://{host}:{port}")
        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        count = {"n": 0}
        fs.s3.meta.events.register("before-send", lambda **kw: count.__setitem__("n", count["n"] + 1))
        for row in [r for r in rows if r["shards"] == shards]:
            key = f"bench/v{row['version']}-{shards}"
            start = time.perf_counter()
            fs.put(row["root"] + "/", key, recursive=True)
            upload = time.perf_counter() - start
            fs.invalidate_cache()
            count["n"] = 0
            start = time.perf_counter()
            cache = open_cache(f"s3://{key}")
            open_s, open_requests = time.perf_counter() - start, count["n"]
            count["n"] = 0
            start = time.perf_counter()
            integrity.quick_check(cache)
            check_s, check_requests = time.perf_counter() - start, count["n"]
            out.append({"shards": shards, "version": row["version"], "upload_s": upload, "open_s": open_s,
                        "open_requests": open_requests, "check_s": check_s, "check_requests": check_requests})
    finally:
        server.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", default="1000,10000", help="comma-separated shard counts")
    parser.add_argument("--s3", type=int, default=0,
                        help="also copy the caches of this many shards (one of --shards) to the local moto S3 server "
                             "and count the requests at open (the upload costs ~0.1 s a shard)")
    parser.add_argument("--tmp", default=None, help="scratch folder (deleted after)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.shards.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.tmp))
    rows, s3_rows = [], []
    try:
        for shards in sizes:
            for version in (1, 2):
                rows.append(measure(tmp, shards, version))
                r = rows[-1]
                print(f"# measured v{version} at {shards} shards: write {r['write_s']:.1f}s", flush=True)
        if args.s3:
            s3_rows = s3_requests(rows, args.s3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print("\n| shards | format | index bytes | bytes / shard | files / shard | finalize s | open_cache s | "
          "opened / listed at open | start-up check s | opened / listed at check | verify s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shards']:,} | v{r['version']} | {r['index_bytes']:,} | {r['index_bytes'] / r['shards']:,.0f} | "
              f"{r['files_per_shard']:.1f} | {r['finalize_s']:.2f} | {r['open_s']:.3f} | "
              f"{r['open_opened']} / {r['open_listed']} | {r['check_s']:.3f} | "
              f"{r['check_opened']} / {r['check_listed']} | {r['verify_s']:.1f} |")
    if len(sizes) > 1:
        small, large = min(sizes), max(sizes)
        print(f"\nGrowth {large:,} / {small:,} shards (x{large / small:g} shards):\n")
        print("| format | index bytes | finalize | open_cache | files opened at open | start-up check | verify |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for version in (1, 2):
            a = next(r for r in rows if r["shards"] == small and r["version"] == version)
            b = next(r for r in rows if r["shards"] == large and r["version"] == version)

            def ratio(key: str) -> str:
                return f"{b[key] / a[key]:.1f}" if a[key] else ("1.0" if a[key] == b[key] == 0 else "-")
            print(f"| v{version} | {ratio('index_bytes')} | {ratio('finalize_s')} | {ratio('open_s')} | "
                  f"{ratio('open_opened')} | {ratio('check_s')} | {ratio('verify_s')} |")
    if s3_rows:
        print("\n| shards | format | upload s | open_cache s | requests at open | start-up check s | requests at check |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in s3_rows:
            print(f"| {r['shards']:,} | v{r['version']} | {r['upload_s']:.0f} | {r['open_s']:.2f} | "
                  f"{r['open_requests']} | {r['check_s']:.2f} | {r['check_requests']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "s3": s3_rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
