"""Offline against online: a training step fed from the cache against the same step with the
teacher computed on the fly (issue #6, item 5).

Same tiny teacher (examples/teacher), same drafter (the quickstart's: 3 layers, B = 8), same
batches. Setup (untimed): the first --rows rows of the corpus go through `dflash-cache build`'s
`build_cache` into a scratch cache; both paths then walk the same epoch plan (EpochPlan) batch by
batch.

- offline: `train_loader` (the cache reader, anchors, collate: what `dflash-train run` uses)
  yields the batch, then `trainer.on_device` (float32 and the step's noise), `trainer.micro_step`,
  gradient clip and AdamW step.
- online: the batch's token ids (kept in memory beforehand, as a pre-tokenized corpus would be) go
  through `dflash_teacher.teacher.Teacher.forward` (the build's extraction: tapped-layer hooks and
  chunked top-k log-probs), then the same anchors and collate as `data.load_batch`, then the same
  step.

Both paths are timed step by step in interleaved rounds (alternating which goes first) in one
process, with one torch thread by default. The first batch of each path is compared (hidden states,
top-k) to show they train on the same data.

    .venv/bin/python benchmarks/bench_online.py          # 200 rows, 3 rounds x 8 steps per path (~1-2 min)
    .venv/bin/python benchmarks/bench_online.py --tiny   # a smoke test (seconds)
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from dflash_build import BuildConfig, build_cache  # noqa: E402
from dflash_cache import format as fmt  # noqa: E402
from dflash_cache import open_cache  # noqa: E402
from dflash_cache.reader import SequenceRecord  # noqa: E402
from dflash_cache.settings.storage_config import StorageConfig  # noqa: E402
from dflash_common.devices import resolve_device  # noqa: E402
from dflash_corpus import CorpusConfig  # noqa: E402
from dflash_teacher.teacher import TeacherConfig, load_teacher  # noqa: E402
from dflash_train.settings.data_config import DataConfig  # noqa: E402
from dflash_train.settings.model_config import ModelConfig  # noqa: E402
from dflash_train.settings.train_config import TrainConfig  # noqa: E402
from dflash_train.training.batch import make_batch  # noqa: E402
from dflash_train.training.data import LoaderState, train_loader  # noqa: E402
from dflash_train.training.distributed import DistInfo  # noqa: E402
from dflash_train.training.epoch_plan import EpochPlan  # noqa: E402
from dflash_train.training.session import build_drafter  # noqa: E402
from dflash_train.training.train_step import micro_step, on_device  # noqa: E402


def build_scratch_cache(args, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    with open(args.data) as f:
        rows = [json.loads(line) for line in itertools.islice(f, args.rows)]
    data = out / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    url = str(out / "cache")
    # quickstart's build options: 3 tapped layers, top-32, small shards
    build_cache(BuildConfig(out=url, corpus=CorpusConfig(data=str(data)),
                            teacher=TeacherConfig(name_or_path=args.teacher, dtype=args.dtype, device=args.device,
                                                  num_tapped_layers=args.tapped, top_k=args.top_k),
                            storage=StorageConfig(shard_bytes=32 * 10**6, chunk_bytes=512 * 2**10)))
    return url


class Trainer:
    """One path's drafter, optimizer and step (what trainer.train does per step, minus logging)."""

    def __init__(self, cfg: TrainConfig, cache, device):
        self.cfg, self.device, self.steps_done = cfg, device, 0
        self.model = build_drafter(cfg, cache, device)  # same seed: both paths start from the same weights
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                         else torch.autocast("cpu", enabled=False))

    def step(self, batch) -> None:
        batch = on_device(batch, self.device, self.cfg, self.steps_done, self.cfg.steps)
        micro_step(self.model, self.model, batch, self.cfg, DistInfo(), self.device, self.autocast)
        self.steps_done += 1
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()


class OnlineBatches:
    """The plan's batches with the teacher run now instead of read from the cache."""

    def __init__(self, cache, cfg: TrainConfig, teacher):
        self.cfg, self.teacher = cfg, teacher
        self.plan = EpochPlan(cache, cfg.data)
        # token ids and loss masks only (what a tokenized corpus holds); copies, so no cache file stays open
        self.tokens = {r.id: (np.array(r.input_ids), np.array(r.loss_mask)) for r in cache.sequences()}
        self.ids = [shard.ids for shard in cache.shards]

    def batch(self, index: int):
        batches = self.plan.batches(0)
        epoch, b = divmod(index, len(batches))
        if epoch:
            batches = self.plan.batches(epoch)
        ids = [self.ids[s][i] for s, i in batches[b]]
        out = self.teacher.forward([self.tokens[i][0] for i in ids])
        hidden = fmt.from_storage(out.hidden, self.teacher.cfg.dtype)
        records, offset = [], 0
        for seq_id in ids:
            input_ids, loss_mask = self.tokens[seq_id]
            n = len(input_ids)
            records.append(SequenceRecord(id=seq_id, input_ids=input_ids, loss_mask=loss_mask,
                                          hidden=hidden[offset:offset + n], topk_ids=out.topk_ids[offset:offset + n],
                                          topk_logprobs=out.topk_logprobs[offset:offset + n]))
            offset += n
        # as data.load_batch does for cached records (anchors, and the layout of cfg.data)
        return make_batch(records, self.cfg.data, epoch)


def compare(offline, online) -> str:
    """How far the two paths' first batches are apart (they must hold the same data)."""
    same_ids = offline.ids == online.ids and torch.equal(offline.anchors, online.anchors)
    hidden = float((offline.hidden - online.hidden).abs().max())
    top1 = float((offline.topk_ids[..., 0] == online.topk_ids[..., 0]).float().mean())
    logprobs = float((offline.topk_logprobs - online.topk_logprobs).abs().max())
    return (f"first batch: same sequences and anchors {'yes' if same_ids else 'NO'}; hidden max |diff| {hidden:.2e}; "
            f"top-1 ids equal {top1:.1%}; top-k log-prob max |diff| {logprobs:.2e}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", default=str(ROOT / "examples" / "teacher"))
    parser.add_argument("--data", default=str(ROOT / "examples" / "data" / "chat.jsonl"))
    parser.add_argument("--rows", type=int, default=200, help="corpus rows cached and trained on")
    parser.add_argument("--dtype", default="float32", help="teacher dtype, for the cache and the online path")
    parser.add_argument("--tapped", type=int, default=3, help="tapped teacher layers (build --tapped-layers)")
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--num-layers", type=int, default=3, help="drafter layers")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--batch-tokens", type=int, default=1600)
    parser.add_argument("--num-anchors", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="steps per path per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tmp", default=str(ROOT / ".bench-tmp"), help="scratch folder (deleted at the end)")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke test")
    args = parser.parse_args(argv)
    if args.tiny:
        args.rows, args.steps, args.rounds, args.num_layers, args.batch_tokens = 24, 2, 1, 1, 600
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    transformers.utils.logging.disable_progress_bar()

    started = time.perf_counter()
    scratch = Path(args.tmp) / f"online-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        url = build_scratch_cache(args, scratch)
        cache = open_cache(url)
        total = args.rounds * args.steps
        cfg = TrainConfig(cache=url, out=str(scratch / "unused"), steps=total,
                          model=ModelConfig(num_layers=args.num_layers, block_size=args.block_size),
                          data=DataConfig(batch_tokens=args.batch_tokens, anchors="random", num_anchors=args.num_anchors,
                                          heldout_fraction=0.0))
        teacher = load_teacher(TeacherConfig(name_or_path=args.teacher, dtype=args.dtype, device=str(device),
                                             layers=tuple(cache.layer_ids), top_k=cache.top_k))
        state = LoaderState(manifest_fingerprint=cache.fingerprint)
        offline_batches = iter(train_loader(url, None, cfg.data, state))
        online = OnlineBatches(cache, cfg, teacher)
        paths = {"offline": Trainer(cfg, cache, device), "online": Trainer(cfg, cache, device)}
        sources = {"offline": lambda i: next(offline_batches), "online": online.batch}
        print(f"# {len(cache)} sequences, {cache.num_tokens:,} tokens cached; teacher {args.teacher} "
              f"({teacher.identity['num_hidden_layers']} layers, hidden {teacher.hidden_size}), tapped {cache.layer_ids}, "
              f"top-{cache.top_k}; drafter {args.num_layers} layer(s), B={args.block_size}, {args.batch_tokens} tokens "
              f"and {args.num_anchors} anchors per sequence per batch; {args.threads} thread(s), device {device}",
              flush=True)

        times = {name: {"data": [], "step": [], "tokens": []} for name in paths}
        next_index = {name: 0 for name in paths}
        first = {}
        for rnd in range(args.rounds):
            order = ["offline", "online"] if rnd % 2 == 0 else ["online", "offline"]
            for name in order:
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    batch = sources[name](next_index[name])
                    t1 = time.perf_counter()
                    paths[name].step(batch)
                    t2 = time.perf_counter()
                    first.setdefault(name, batch)
                    next_index[name] += 1
                    times[name]["data"].append(t1 - t0)
                    times[name]["step"].append(t2 - t0)
                    times[name]["tokens"].append(batch.num_tokens)
            print(f"# round {rnd + 1} done", flush=True)
        print(compare(first["offline"], first["online"]))
        print_table(times)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"total wall time {time.perf_counter() - started:.1f} s")


def print_table(times: dict) -> None:
    rates = {name: [n / s for n, s in zip(t["tokens"], t["step"])] for name, t in times.items()}
    base_best, base_med = max(rates["offline"]), statistics.median(rates["offline"])
    header = (f"{'path':<32} {'steps':>5} {'tok/s':>8} {'(med)':>8} {'x offline':>9} {'(med)':>6} "
              f"{'data s/step':>11} {'train s/step':>12}")
    print(header)
    print("-" * len(header))
    labels = {"offline": "offline (cache reader + loader)", "online": "online (teacher forward)"}
    for name, t in times.items():
        best, med = max(rates[name]), statistics.median(rates[name])
        data = statistics.median(t["data"])
        train = statistics.median([s - d for s, d in zip(t["step"], t["data"])])
        print(f"{labels[name]:<32} {len(t['step']):>5} {best:>8.0f} {med:>8.0f} {best / base_best:>9.2f} "
              f"{med / base_med:>6.2f} {data:>11.4f} {train:>12.4f}")
    print("tok/s = batch tokens / (data + train step) seconds, best step and (median); x offline = this path's "
          "rate / the offline path's; data and train s/step are medians")


if __name__ == "__main__":
    main()
