"""The cache format at scale (issue #32): format 1 against format 2 at 1k, 10k and 100k shards.

Synthetic caches with the production shape's *counts* at a tiny width (hidden 8, 2 tapped layers,
top-k 2, one 2-token sequence a shard), so that 100k shards fit this disk. Each layout is a 2-rank
build: the first ``--written`` shards of each rank go through the real writer (``write_shard``
with ``version=1`` or ``2``); the rest are replicas of them (hidden-state files and tokens.arrow
hard-linked, their own sequences.arrow with their own id, their own commit record), committed
through the real ``ManifestKeeper`` (format 2: the rank's index part), rank markers, then merged
by the real ``finalize_cache``; ``verify`` passes on them. Per size and layout it measures:

- index bytes (format 1: manifest.json, which lists every record; format 2: manifest.json plus the
  merged ``index/*.arrow`` tables) and bytes a shard; files a shard (everything under ``shards/``);
- ``finalize`` time (merging the 2 ranks), ``open_cache`` time and the trainer's start-up check
  (``listing.size_problems``), with the local files opened and the folders listed during each,
  counted by strace on a fresh process doing just that (every ``openat`` under the cache, Arrow's
  native memory maps included; a folder opened is a listing); no product code is patched;
- ``verify`` time (``verify_cache``: every byte), up to ``--verify-max`` shards;
- a simulated rank's start-up to its first batch at W = 1, 8 and 32 (rank 0): the trainer's own
  sequence (``open_cache``, the size check, the loader state, ``EpochPlan``, ``train_loader`` with
  rank and world size as the trainer passes them) in a fresh process forked from one that
  imported the modules (``RankServer``); seconds per phase, and files opened and folders listed
  (strace attached to the rank's process);
- every rank's epoch at W = 2 and 8 (up to ``--epoch-max`` shards): bytes of the shards' files each
  rank opened (strace; each open charged the file's size, which a memory map of a file smaller than
  a page reads whole), as multiples of 1/W of the shards' bytes, and its sequences;
- with ``--s3 N``: the N-shard cache of each layout uploaded to the local moto S3 server (real S3
  API on loopback) and a rank started on it: the requests the server served per phase.

Growth is reported as the ratio largest/smallest size.
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
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_build.commit import RANKS_DIR, ManifestKeeper, finalize_cache, rank_marker  # noqa: E402
from dflash_build.shard_queue import Committed  # noqa: E402
from dflash_cache import format as fmt  # noqa: E402
from dflash_cache.format import index as cache_index  # noqa: E402
from dflash_cache.format.token_tables import ipc_bytes  # noqa: E402
from dflash_cache.reader import open_cache  # noqa: E402
from dflash_cache.settings.storage_config import StorageConfig  # noqa: E402
from dflash_cache.verify import verify_cache  # noqa: E402
from dflash_cache.writer import ShardData, sequences_table, write_shard  # noqa: E402

HIDDEN, LAYERS, TOP_K, SEQ_LEN, WORLD = 8, 2, 2, 2, 2


CHILD = """
import sys
from dflash_cache.reader import open_cache
cache = open_cache(sys.argv[2])
if sys.argv[1] == "check":
    cache.listing.size_problems(set())
"""


RANK_SERVER = """
import json, os, sys, time
from dataclasses import replace
from dflash_cache import open_cache
from dflash_cache.format.integrity import SIZES
from dflash_train.settings.data_config import DataConfig
import numpy as np
from dflash_train.training.data import LoaderState, train_loader
from dflash_train.training.epoch_plan import (EpochPlan, idle_ranks_warning, is_heldout, plan_partitions,
                                              resolve_partitions)


# The baseline: the plan as EpochPlan made it before it read the index's columns at once (a
# Shard object, its ids hashed and its lengths sliced, shard by shard), then the same plan.
def per_shard_plan(cache, cfg, partitions):
    sizes, tokens = [], []
    for shard in cache.shards:
        keep = np.array([not is_heldout(i, cfg.heldout_fraction) for i in shard.ids], dtype=bool)
        sizes.append(int(keep.sum()))
        tokens.append(shard.lengths[keep])
    return plan_partitions(sizes, np.concatenate(tokens), cfg.seed, 0, partitions, cfg.batch_tokens)


def rank_run(url, rank, world, mode, batch_tokens):
    cfg = DataConfig(batch_tokens=batch_tokens, anchors="random")
    start = time.perf_counter()
    clock = [time.monotonic()]  # the phases' ends, on the clock the S3 server's request log uses
    cache = open_cache(url)
    opened = time.perf_counter()
    clock.append(time.monotonic())
    assert cache.complete
    cache.ensure_intact((SIZES,), skip=cfg.skip_shards)
    checked = time.perf_counter()
    clock.append(time.monotonic())
    state = LoaderState(manifest_fingerprint=cache.fingerprint)
    state = replace(state, partitions=resolve_partitions(cfg.partitions, world, state.partitions))
    plan = EpochPlan(cache, cfg)
    idle_ranks_warning(plan, state.epoch, state.partitions, world)
    plan.steps(0, state.partitions)
    planned = time.perf_counter()
    clock.append(time.monotonic())
    batches = iter(train_loader(url, None, cfg, state, rank, world, plan=plan))
    batch = next(batches)
    first = time.perf_counter()
    clock.append(time.monotonic())
    assert batch.hidden.numel() and batch.input_ids.numel()
    out = {"open_s": opened - start, "check_s": checked - opened, "plan_s": planned - checked,
           "first_s": first - planned, "total_s": first - start, "clock": clock}
    if mode == "first":  # after the phases, so they are timed as the trainer runs them
        again = time.perf_counter()
        EpochPlan(cache, cfg).steps(0, state.partitions)
        between = time.perf_counter()
        per_shard_plan(cache, cfg, state.partitions)
        out.update(plan_again_s=between - again, plan_per_shard_s=time.perf_counter() - between)
    if mode == "epoch":
        sequences, tokens = 0, 0
        while True:
            sequences, tokens = sequences + len(batch.ids), tokens + batch.num_tokens
            if batch.state_after["epoch"] > 0:
                break
            batch = next(batches)
        out.update(epoch_s=time.perf_counter() - start, sequences=sequences, tokens=tokens,
                   training_sequences=plan.num_sequences)
    return out


for warm in sys.argv[1:]:  # lazy imports and first-use set-up done once here, not in every rank
    rank_run(warm, 0, 1, "first", 2)
for line in sys.stdin:
    request = json.loads(line)
    results, results_w = os.pipe()
    go, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the rank: a fresh process with nothing of any cache in it
        os.close(results)
        os.close(go_w)
        os.read(go, 1)
        try:
            out = rank_run(*request)
        except Exception as err:
            out = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
        os.write(results_w, json.dumps(out).encode())
        os._exit(0)
    os.close(results_w)
    os.close(go)
    print(f"PID {pid}", flush=True)
    sys.stdin.readline()  # go: the caller has attached strace (or needs not)
    os.write(go_w, b"g")
    data = b""
    while chunk := os.read(results, 1 << 16):
        data += chunk
    os.waitpid(pid, 0)
    os.close(results)
    os.close(go_w)
    print("RESULT " + data.decode(), flush=True)
"""
BATCH_TOKENS = 2 * SEQ_LEN
"""The simulated trainer's ``batch_tokens``: two shards' sequences a batch (a production batch of
8,192 tokens spans about one ~10k-token shard)."""


class RankServer:
    """Simulated training ranks, each a fresh process forked from one that imported the trainer's
    modules once (an import of torch costs seconds a process on this machine) and nothing else:
    ``run`` performs the trainer's start-up (``open_cache``, the start-up size check, the loader
    state, ``EpochPlan``) and ``train_loader`` (rank and world size as the trainer passes them,
    workers 0) to the rank's first batch (``mode`` "first") or to the end of its epoch ("epoch").
    With ``traced``, strace is attached to the rank's process before it starts: files opened
    under the cache (each charged its size at every open: at this width every file is smaller
    than a page, so a memory map of it reads it whole), split into the shards' files and the index
    (manifest, tables), and folders opened (listed)."""

    def __init__(self, warm: list[str], env: dict | None = None):
        """``warm``: small caches (one a format) a rank runs on once in the server before any fork."""
        repo = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen([sys.executable, "-c", RANK_SERVER, *warm], cwd=repo, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, **(env or {}), PYTHONPATH=str(repo), OMP_NUM_THREADS="1"))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()

    def _line(self, prefix: str) -> str:
        line = self.proc.stdout.readline()
        if not line.startswith(prefix):
            raise RuntimeError(f"the rank server said {line!r}")
        return line[len(prefix):]

    def run(self, url: str, rank: int, world: int, mode: str, traced: bool) -> dict:
        self.proc.stdin.write(json.dumps([url, rank, world, mode, BATCH_TOKENS]) + "\n")
        self.proc.stdin.flush()
        pid = int(self._line("PID "))
        with tempfile.NamedTemporaryFile("r", suffix=".strace") as log:
            tracer = None
            if traced:
                tracer = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=openat", "-o", log.name, "-p", str(pid)])
                while "TracerPid:\t0" in Path(f"/proc/{pid}/status").read_text():
                    time.sleep(0.01)
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
            out = json.loads(self._line("RESULT "))
            if tracer is not None:
                tracer.wait()
                out.update(_opened(log, Path(url)))
        if "error" in out:
            out["error"] = f"rank {rank} of {world}: {out['error']}"
        return out


def _opened(log, root: Path) -> dict:
    shards, index = str(root / fmt.SHARDS_DIR) + "/", str(root)
    counts = {"shard_files": 0, "shard_bytes": 0, "index_files": 0, "index_bytes": 0, "listed": 0}
    distinct = set()
    for line in log:
        if f'"{index}' not in line or "= -1" in line:
            continue
        path = line.split('"', 2)[1]
        if "O_DIRECTORY" in line:
            counts["listed"] += 1
        elif path.startswith(shards):
            counts["shard_files"] += 1
            counts["shard_bytes"] += os.path.getsize(path)
            distinct.add(path)
        else:
            counts["index_files"] += 1
            counts["index_bytes"] += os.path.getsize(path)
    counts["shard_bytes_distinct"] = sum(os.path.getsize(path) for path in distinct)
    return counts


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


def _replicate(root: str, template: dict, shard: ShardData, sequences: bytes, version: int) -> dict:
    """Shard ``shard`` made from an already written shard of the same rank (``template``, its
    commit record): its hidden-state files and tokens.arrow hard-linked (the same bytes, so the
    same checksums), its own sequences.arrow (``sequences``: its own id and row, encoded by the
    writer's ``sequences_table``), and its commit record the template's with this shard's name,
    index, rows, sizes and sequences checksum. No fsync: a benchmark cache need not survive a
    power cut."""
    source = fmt.shard_path(root, template["name"], version)
    target = fmt.shard_path(root, shard.name, version)
    folders = sorted({os.path.dirname(os.path.join(target, name)) for name in template["files"]} | {target})
    for folder in sorted({f for folder in folders for f in _parents(folder, target)}):
        os.mkdir(folder)
    for name in template["files"]:
        if name == fmt.SEQUENCES:
            with open(os.path.join(target, name), "wb") as f:
                f.write(sequences)
        else:
            os.link(os.path.join(source, name), os.path.join(target, name))
    files = dict(template["files"], **{fmt.SEQUENCES: len(sequences)})
    record = dict(template, name=shard.name, index=shard.index, rows=[shard.row_start, shard.row_end],
                  bytes=sum(files.values()), files=files,
                  checksums=dict(template["checksums"], **{fmt.SEQUENCES: fmt.checksum(sequences)}))
    with open(f"{target}.json", "w") as f:
        f.write(json.dumps(record, indent=1, sort_keys=False) + "\n")  # write_json_atomic's bytes
    return record


def _parents(folder: str, top: str) -> list[str]:
    """``folder`` and its parents down to ``top`` (included)."""
    out = [folder]
    while folder != top:
        folder = os.path.dirname(folder)
        out.append(folder)
    return out


def write_cache(root: str, shards: int, version: int, written: int) -> float:
    """A 2-rank build of ``shards`` shards in format ``version``, each rank marked done (not yet
    finalized); returns the seconds it took. The first ``written`` shards of each rank go through
    the real writer (``write_shard``); the rest are replicas of them (``_replicate``); every shard
    is committed through the rank's real ``ManifestKeeper`` (format 2: its index part)."""
    store = fmt.CacheStore.open(root)
    root = store.root
    header = fmt.manifest_header(list(range(LAYERS)), HIDDEN, "bfloat16", TOP_K, format_version=version,
                                 content_options={"world_size": WORLD})
    storage = StorageConfig()
    rng = np.random.default_rng(0)
    store.makedirs(root)
    start = time.perf_counter()
    for rank in range(WORLD):
        keeper = ManifestKeeper(store, dict(header), [], live=False, rank=rank)
        count = shards // WORLD + (rank < shards % WORLD)
        templates = []
        for index in range(count):
            if index < written:
                shard = synthetic_shard(rank, index, index, rng)
                record = write_shard(store, shard, storage, "bfloat16", version, list(range(LAYERS)))
                templates.append((record, shard))
                table = sequences_table(shard)
            else:
                template, data = templates[index % len(templates)]
                shard = replace(data, index=index, row_start=index, row_end=index + 1, ids=[f"s{rank}-{index:07d}"],
                                rows=np.array([index], np.int64))
                table = sequences_table(shard)
                record = _replicate(root, template, shard, ipc_bytes(table), version)
            if version == 1 or index < written:
                keeper.commit(record if version == 1 else Committed(record, table))
            else:  # ManifestKeeper.commit without its checkpoints (the part is written once, below)
                keeper.records.append(record)
                keeper.sequences.append(cache_index.sequence_rows(table, index))
        if version != 1:
            keeper.checkpoint()
        store.makedirs(store.path(RANKS_DIR))
        store.write_json_atomic(rank_marker(root, rank), {"rank": rank, "seconds": 0.0, "tokens": count * SEQ_LEN,
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


def shard_data_bytes(root: Path) -> int:
    """Bytes of every shard's files (sequences, tokens, hidden states; not the commit records)."""
    return sum(os.path.getsize(os.path.join(folder, f)) for folder, _, files in os.walk(root / fmt.SHARDS_DIR)
               for f in files if not (f.endswith(".json") and f != "zarr.json"))


def measure(tmp: Path, shards: int, version: int, args, ranks: RankServer) -> dict:
    root = tmp / f"v{version}-{shards}"
    row = {"shards": shards, "version": version, "write_s": write_cache(str(root), shards, version, args.written),
           "root": str(root)}
    start = time.perf_counter()
    finalize_cache(str(root))
    row["finalize_s"] = time.perf_counter() - start
    row["index_bytes"] = index_bytes(root)
    row["files_per_shard"] = files_under(root / "shards") / shards
    start = time.perf_counter()
    try:
        cache = open_cache(str(root))
    except Exception as err:  # format 1's manifest past the reader's bound: the finding, not a crash
        row["refused"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        return row
    row["open_s"] = time.perf_counter() - start
    row["open_opened"], row["open_listed"] = file_calls(root, "open")
    assert len(cache.shards) == shards, (len(cache.shards), shards)
    start = time.perf_counter()
    problems = cache.listing.size_problems(set())
    row["check_s"] = time.perf_counter() - start
    assert not problems, problems
    opened, listed = file_calls(root, "check")
    row["check_opened"], row["check_listed"] = ((opened - row["open_opened"], listed - row["open_listed"])
                                                if opened is not None else (None, None))
    row["verify_s"] = None
    if shards <= args.verify_max:
        start = time.perf_counter()
        report = verify_cache(open_cache(str(root)))
        row["verify_s"] = time.perf_counter() - start
        assert not report.bad_shards, report.bad_shards
    # a rank's start-up to its first batch: timed in a plain process, counted under strace
    row["first"] = {world: ranks.run(str(root), 0, world, "first", traced=False) for world in args.first_worlds}
    row["first_traced"] = ranks.run(str(root), 0, max(args.first_worlds), "first", traced=shutil.which("strace") is not None)
    if shards <= (args.epoch_max if version != 1 else args.epoch_max_v1) and shutil.which("strace"):
        total = shard_data_bytes(root)
        row["epoch"] = {}
        for world in args.epoch_worlds:
            done = [ranks.run(str(root), rank, world, "epoch", traced=True) for rank in range(world)]
            failed = [r["error"] for r in done if "error" in r]
            if failed:
                row["epoch"][world] = {"error": failed[0]}
                continue
            share = done[0]["training_sequences"] / world
            row["epoch"][world] = {
                "bytes_ratio": max(r["shard_bytes"] for r in done) / (total / world),
                "distinct_ratio": max(r["shard_bytes_distinct"] for r in done) / (total / world),
                "files": max(r["shard_files"] for r in done), "index_bytes": max(r["index_bytes"] for r in done),
                "sequences_ratio": max(r["sequences"] for r in done) / share,
                "all_sequences": sum(r["sequences"] for r in done) == done[0]["training_sequences"],
                "listed": max(r["listed"] for r in done), "total_bytes": total}
    return row


FIRST_WORLDS = (1, 8, 32)
EPOCH_WORLDS = (2, 8)
"""Defaults of --first-worlds and --epoch-worlds (the issue's)."""


class CountingApp:
    """The moto server's WSGI app, noting when it served each request (``time.monotonic``, the
    clock a rank notes its phases on)."""

    def __init__(self, app):
        self.app, self.served = app, []

    def __call__(self, environ, start_response):
        self.served.append(time.monotonic())
        return self.app(environ, start_response)

    def per_phase(self, clock: list[float]) -> list[int]:
        """Requests served in each phase between consecutive ``clock`` times."""
        served = np.array(self.served)
        return [int(((served >= a) & (served < b)).sum()) for a, b in zip(clock, clock[1:])]


def s3_requests(rows: list[dict], shards: int, versions: tuple[int, ...], worlds: list[int]) -> list[dict]:
    """Put each layout's cache of ``shards`` shards into the local moto server's store (its S3
    backend, in this process; the rank reads it over the server's S3 API) and count the requests
    the server serves while one simulated rank (a fresh process, as ``RankServer.run``) starts:
    open, start-up check, plan, first batch."""
    import logging

    import boto3
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    counting = server._server.app = CountingApp(server._server.app)
    out = []
    saved = dict(os.environ)
    try:
        host, port = server.get_host_and_port()
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                          AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
                          AWS_ENDPOINT_URL=f"http://{host}:{port}")
        boto3.client("s3").create_bucket(Bucket="bench")
        backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
        # no warm-up run here: it would start Zarr's event-loop thread, which a forked rank lacks (Zarr reads
        # an object store's hidden states on that loop: the rank would wait for it forever)
        ranks = RankServer([])  # with the environment above
        for row in [r for r in rows if r["shards"] == shards and r["version"] in versions and "refused" not in r]:
            key = f"v{row['version']}-{shards}"
            local = Path(row["root"])
            paths = [Path(folder, f) for folder, _, files in os.walk(local) for f in files]
            start = time.perf_counter()
            for path in paths:  # straight into the server's store: an upload over HTTP costs ~12 ms an object here
                backend.put_object("bench", f"{key}/{path.relative_to(local)}", path.read_bytes())
            upload = time.perf_counter() - start
            for world in worlds:
                counting.served.clear()
                result = ranks.run(f"s3://bench/{key}", 0, world, "first", traced=False)
                phases = counting.per_phase(result["clock"]) if "clock" in result else [None] * 4
                out.append({"shards": shards, "version": row["version"], "objects": len(paths), "upload_s": upload,
                            "world": world, "requests": len(counting.served), "phases": phases, **result})
        ranks.close()
    finally:
        os.environ.clear()
        os.environ.update(saved)
        server.stop()
    return out


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_tables(rows: list[dict], s3_rows: list[dict], sizes: list[int], worlds: list[int]) -> None:
    print("\n| shards | format | index bytes | bytes / shard | files / shard | finalize s | open_cache s | "
          "opened / listed at open | start-up check s | opened / listed at check | verify s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "refused" in r:
            print(f"| {r['shards']:,} | v{r['version']} | {r['index_bytes']:,} | {r['index_bytes'] / r['shards']:,.0f} | "
                  f"{r['files_per_shard']:.1f} | {r['finalize_s']:.2f} | refused | - | - | - | - |")
            continue
        print(f"| {r['shards']:,} | v{r['version']} | {r['index_bytes']:,} | {r['index_bytes'] / r['shards']:,.0f} | "
              f"{r['files_per_shard']:.1f} | {r['finalize_s']:.2f} | {r['open_s']:.3f} | "
              f"{r['open_opened']} / {r['open_listed']} | {r['check_s']:.3f} | "
              f"{r['check_opened']} / {r['check_listed']} | {_f(r['verify_s'], '.1f')} |")
    for r in rows:
        if "refused" in r:
            print(f"\nv{r['version']} at {r['shards']:,} shards: open_cache refused: {r['refused']}")
    print("\nA rank's start-up to its first batch (rank 0; seconds in a plain process; files at W = "
          f"{max(worlds)} under strace):\n")
    print("| shards | format | " + " | ".join(f"W = {w}: open / check / plan / first batch s" for w in worlds)
          + " | total s, W = " + " / ".join(map(str, worlds))
          + " | shard files opened | folders listed | index files (bytes) |")
    print("|---:|---:|" + "---|" * len(worlds) + "---:|---:|---:|---:|")
    for r in rows:
        if "first" not in r:
            continue
        cells = [" / ".join(f"{r['first'][w][k]:.2f}" for k in ("open_s", "check_s", "plan_s", "first_s"))
                 if "error" not in r["first"][w] else r["first"][w]["error"] for w in worlds]
        totals = " / ".join(f"{r['first'][w].get('total_s', float('nan')):.2f}" for w in worlds)
        t = r["first_traced"]
        print(f"| {r['shards']:,} | v{r['version']} | " + " | ".join(cells) + f" | {totals} | "
              f"{t.get('shard_files', '-')} | {t.get('listed', '-')} | {t.get('index_files', '-')} "
              f"({t.get('index_bytes', 0):,}) |")
    planned = [r for r in rows if "first" in r and "plan_per_shard_s" in r["first"][worlds[0]]]
    if planned:
        print(f"\nThe epoch plan (rank 0, W = {worlds[0]}, in the same process after its first batch): EpochPlan "
              "from the index's columns against the baseline that walks the shards (a Shard, its ids and lengths "
              "each), the same plan\n")
        print("| shards | format | EpochPlan s | per-shard baseline s | baseline / EpochPlan |")
        print("|---:|---:|---:|---:|---:|")
        for r in planned:
            f = r["first"][worlds[0]]
            print(f"| {r['shards']:,} | v{r['version']} | {f['plan_again_s']:.2e} | {f['plan_per_shard_s']:.2e} | "
                  f"{f['plan_per_shard_s'] / max(f['plan_again_s'], 1e-9):.2g} |")  # a ratio below 0.05 printed as 0.0 failed the > 0 check
    epoch = [r for r in rows if r.get("epoch")]
    if epoch:
        print("\nOne epoch a rank (every rank of W, strace): worst rank, as multiples of 1/W\n")
        print("| shards | format | W | shard bytes read (each open) | shard bytes touched (distinct files) | sequences "
              "| ranks' sequences sum to the split | shard files opened | index bytes read a rank | folders listed a rank |")
        print("|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
        for r in epoch:
            for w, e in r["epoch"].items():
                if "error" in e:
                    print(f"| {r['shards']:,} | v{r['version']} | {w} | {e['error']} | | | | | | |")
                    continue
                print(f"| {r['shards']:,} | v{r['version']} | {w} | {e['bytes_ratio']:.3f} | {e['distinct_ratio']:.3f} | "
                      f"{e['sequences_ratio']:.3f} | {'yes' if e['all_sequences'] else 'NO'} | {e['files']:,} | "
                      f"{e['index_bytes']:,} | {e['listed']:,} |")
    if len(sizes) > 1:
        small, large = min(sizes), max(sizes)
        print(f"\nGrowth {large:,} / {small:,} shards (x{large / small:g} shards), the largest size measured per format:\n")
        print("| format | shards | index bytes | finalize | open_cache | files opened at open | start-up check "
              f"| first batch W = {max(worlds)} | shard files opened to it | verify |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for version in sorted({r["version"] for r in rows if r["shards"] == small and "first" in r}):
            a = next(r for r in rows if r["shards"] == small and r["version"] == version)
            b = max((r for r in rows if r["version"] == version and "first" in r), key=lambda r: r["shards"])

            def ratio(x, y) -> str:
                if x is None or y is None:
                    return "-"
                return f"{y / x:.1f}" if x else ("1.0" if x == y == 0 else "-")
            w = max(worlds)
            print(f"| v{version} | {b['shards']:,} / {a['shards']:,} | {ratio(a['index_bytes'], b['index_bytes'])} | "
                  f"{ratio(a['finalize_s'], b['finalize_s'])} | {ratio(a['open_s'], b['open_s'])} | "
                  f"{ratio(a['open_opened'], b['open_opened'])} | {ratio(a['check_s'], b['check_s'])} | "
                  f"{ratio(a['first'][w].get('total_s'), b['first'][w].get('total_s'))} | "
                  f"{ratio(a['first_traced'].get('shard_files'), b['first_traced'].get('shard_files'))} | "
                  f"{ratio(a['verify_s'], b['verify_s'])} |")
    if s3_rows:
        print("\nOn the S3 API (local moto server): one rank's start-up to its first batch, requests the server served\n")
        print("| shards | format | objects | upload s | W | requests | open / check / plan / first batch: requests "
              "| open / check / plan / first batch: s |")
        print("|---:|---:|---:|---:|---:|---:|---|---|")
        for r in s3_rows:
            times = (" / ".join(f"{r[k]:.2f}" for k in ("open_s", "check_s", "plan_s", "first_s"))
                     if "error" not in r else r["error"])
            print(f"| {r['shards']:,} | v{r['version']} | {r['objects']:,} | {r['upload_s']:.0f} | {r['world']} | "
                  f"{r['requests']:,} | {' / '.join(map(str, r['phases']))} | {times} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", default="1000,10000,100000", help="comma-separated shard counts")
    parser.add_argument("--written", type=int, default=100,
                        help="shards a rank written by the real writer; the rest of each rank's are replicas of them")
    parser.add_argument("--v1-max", type=int, default=10000, help="build format 1 only up to this many shards")
    parser.add_argument("--verify-max", type=int, default=10000, help="run verify only up to this many shards")
    parser.add_argument("--epoch-max", type=int, default=10000,
                        help="run every rank's epoch (W = 2 and 8) only up to this many shards (format 2)")
    parser.add_argument("--epoch-max-v1", type=int, default=1000, help="the same for format 1")
    parser.add_argument("--s3", type=int, default=0,
                        help="also upload the caches of this many shards (one of --shards) to the local moto S3 server "
                             "and count the requests of a rank's start-up")
    parser.add_argument("--first-worlds", default=",".join(map(str, FIRST_WORLDS)),
                        help="world sizes W of the simulated ranks' start-up to their first batch (rank 0)")
    parser.add_argument("--epoch-worlds", default=",".join(map(str, EPOCH_WORLDS)),
                        help="world sizes W whose every rank reads one epoch")
    parser.add_argument("--s3-formats", default="1,2", help="which formats to upload for --s3")
    parser.add_argument("--tmp", default=None, help="scratch folder (deleted after)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.shards.split(",")]
    args.first_worlds = [int(w) for w in args.first_worlds.split(",")]
    args.epoch_worlds = [int(w) for w in args.epoch_worlds.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.tmp))
    rows, s3_rows = [], []
    warm = []
    for version in (1, 2):  # tiny caches a rank runs on once before any measured rank
        warm.append(str(tmp / f"warm-v{version}"))
        write_cache(warm[-1], 8, version, 8)
        finalize_cache(warm[-1])
    ranks = RankServer(warm)
    try:
        for shards in sizes:
            for version in (1, 2):
                if version == 1 and shards > args.v1_max:
                    continue
                started = time.perf_counter()
                rows.append(measure(tmp, shards, version, args, ranks))
                print(f"# measured v{version} at {shards} shards: write {rows[-1]['write_s']:.1f}s, all "
                      f"{time.perf_counter() - started:.0f}s", flush=True)
            if shards == args.s3:
                try:
                    s3_rows = s3_requests(rows, shards, tuple(int(v) for v in args.s3_formats.split(",")),
                                          args.first_worlds)
                except Exception as err:  # the local measurements still print
                    print(f"# S3 failed: {type(err).__name__}: {err}", flush=True)
                print(f"# measured S3 at {shards} shards", flush=True)
            for row in rows:
                if row["shards"] == shards:
                    shutil.rmtree(row["root"], ignore_errors=True)
    finally:
        ranks.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print_tables(rows, s3_rows, sizes, args.first_worlds)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "s3": s3_rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
