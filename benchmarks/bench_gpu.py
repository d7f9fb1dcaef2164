"""Production-size throughput on one GPU (issue #6, item 6): drafter training, loader, teacher extraction.

NOT YET RUN ON AN H200: written and smoke-tested (`--tiny`, CPU) on a machine without a GPU. The
sizes are the production ones of docs/design.md: hidden 5120, 5 tapped layers (1,16,31,46,61 of 64),
vocab 248,320, B = 16, 5 drafter layers, top-64, and Qwen3.6-27B's attention/MLP shape (24 query
heads, 4 key/value heads, head dim 256, MLP 17,408).

Parts, each with a time budget for its timed loop so the whole run stays under 8 minutes:

1. drafter training: the package's DFlashDrafter (shape as `DrafterConfig.from_teacher` derives it)
   and `trainer.micro_step` (bf16 autocast on CUDA, the chunked KL loss), gradient clip, AdamW, on
   batches of `--batch-tokens` (8 x 1,024 tokens, 8 anchors per sequence: the trainer's defaults)
   already on the GPU. tokens/s = batch tokens / step time.
2. loader: a synthetic cache at production width written with dflash_cache's `write_shard` on
   local disk (`--tmp`), streamed through `dflash_train.training.data.train_loader` with `--loader-workers`
   workers (default 0, the README's recommendation) and pinned memory on CUDA, each batch then taken to the device with the
   step's noise drawn there (`trainer.on_device`), as the trainer does, until the budget. The page
   cache is warm (just written). A third row checks the device's noise against the CPU's (uniform
   must be bit-identical) and times the noise alone.
3. teacher extraction: a random-weight Qwen3 model with the production width, attention, MLP and
   vocabulary but only `--teacher-layers` decoder layers, run through the build's extraction
   (`dflash_teacher.teacher.Teacher.forward`: hooks on the tapped layers, chunked LM head and top-k,
   hidden states copied to the host) on 8 x 1,024-token batches (the build's --batch-tokens). A
   second row estimates the 64-layer teacher: the LM head + top-k time measured alone, plus the
   decoder layers' time scaled to 64 layers (the real teacher is hybrid Gated-DeltaNet/attention,
   so this is a rough guide, not a measurement).

The `x drafter` column divides each row's tokens/s by the drafter's: the loader must stay above 1
to keep one GPU fed; the teacher's tells how many GPU-hours of extraction one GPU-hour of training
needs.

    python benchmarks/bench_gpu.py           # on a GPU machine, production sizes (< 8 min)
    python benchmarks/bench_gpu.py --tiny    # tiny sizes, CPU, well under a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import resource
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

from bench_trainer import synthetic_batch  # noqa: E402

from dflash_cache import format as fmt  # noqa: E402
from dflash_cache import open_cache  # noqa: E402
from dflash_cache.settings.storage_config import StorageConfig  # noqa: E402
from dflash_cache.writer import ShardData, write_shard  # noqa: E402
from dflash_common.devices import resolve_device  # noqa: E402
from dflash_teacher.tapped_layers import resolve_layers  # noqa: E402
from dflash_teacher.teacher import Teacher, TeacherConfig  # noqa: E402
from dflash_train.settings.data_config import DataConfig  # noqa: E402
from dflash_train.settings.drafter_config import DrafterConfig  # noqa: E402
from dflash_train.settings.noise_config import NoiseConfig  # noqa: E402
from dflash_train.settings.train_config import TrainConfig  # noqa: E402
from dflash_train.training.data import LoaderState, train_loader  # noqa: E402
from dflash_train.training.distributed import DistInfo  # noqa: E402
from dflash_train.training.epoch_plan import EpochPlan  # noqa: E402
from dflash_train.training.model import DFlashDrafter  # noqa: E402
from dflash_train.training.noise import add_noise_, noise_for  # noqa: E402
from dflash_train.training.train_step import micro_step, on_device  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    """Model and batch shapes of one run."""

    hidden: int
    """Teacher and drafter width."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads."""
    head_dim: int
    """Width of one attention head."""
    intermediate: int
    """SwiGLU MLP width."""
    vocab: int
    """Vocabulary (embedding and LM head rows)."""
    teacher_layers: int
    """Decoder layers of the full teacher (the drafter's num_target_layers; the 64-layer estimate)."""
    tapped: tuple[int, ...]
    """Tapped teacher layers (the drafter's context inputs)."""
    drafter_layers: int
    """Drafter decoder layers."""
    block_size: int
    """Tokens per drafted block."""
    top_k: int
    """Teacher log-probs kept per position."""
    seq_len: int
    """Tokens per sequence in the synthetic batches."""
    batch_tokens: int
    """Tokens per training batch and per teacher forward."""
    num_anchors: int
    """Anchors per sequence."""
    loader_tokens: int
    """Tokens in the synthetic cache the loader streams."""
    cut_layers: int
    """Decoder layers of the random teacher actually built."""


PRODUCTION = Sizes(hidden=5120, heads=24, kv_heads=4, head_dim=256, intermediate=17408, vocab=248_320,
                   teacher_layers=64, tapped=(1, 16, 31, 46, 61), drafter_layers=5, block_size=16, top_k=64,
                   seq_len=1024, batch_tokens=8192, num_anchors=8, loader_tokens=65_536, cut_layers=6)
TINY = dataclasses.replace(PRODUCTION, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=2048,
                           top_k=8, seq_len=128, batch_tokens=512, loader_tokens=6000)


@dataclass
class Row:
    part: str
    rates: list[float]
    setup_s: float
    peak: str = "-"
    note: str = ""
    error: str = ""


class Clock:
    """The whole run's deadline; each part's timed loop gets min(its budget, what is left)."""

    def __init__(self, limit_s: float):
        self.start, self.limit = time.perf_counter(), limit_s

    def left(self) -> float:
        return self.limit - (time.perf_counter() - self.start)

    def budget(self, wanted: float) -> float:
        return max(0.0, min(wanted, self.left()))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GPU"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} RSS"


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# --- 1. drafter training -----------------------------------------------------------------------------


def drafter_config(s: Sizes) -> DrafterConfig:
    """The drafter of these sizes (MASK: the last vocabulary row)."""
    return DrafterConfig(hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         head_dim=s.head_dim, intermediate_size=s.intermediate, vocab_size=s.vocab,
                         mask_token_id=s.vocab - 1, target_layer_ids=s.tapped, num_target_layers=s.teacher_layers,
                         num_hidden_layers=s.drafter_layers, block_size=s.block_size)


def bench_drafter(s: Sizes, device: torch.device, budget: float, max_steps: int) -> Row:
    t0 = time.perf_counter()
    cfg = drafter_config(s)
    torch.manual_seed(0)
    # built on the device directly: initialising 1.7B parameters on the host first takes minutes
    with torch.device(device):
        embed = torch.randn(s.vocab, s.hidden) * 0.02
        head = torch.randn(s.vocab, s.hidden) * 0.02
        model = DFlashDrafter.build(cfg, embed, head, device)
    train_cfg = TrainConfig(cache="", out="")
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_cfg.optim.lr, betas=train_cfg.optim.betas)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    batch = synthetic_batch(s.batch_tokens // s.seq_len, s.seq_len, s.vocab, len(s.tapped), s.hidden, s.top_k,
                            s.num_anchors).to(device)

    def step() -> None:
        micro_step(model, model, batch, train_cfg, DistInfo(), device, autocast)
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)

    for _ in range(2):  # allocations, cuBLAS heuristics, AdamW state
        step()
    setup = time.perf_counter() - t0
    rates, start = [], time.perf_counter()
    while len(rates) < max_steps and (not rates or time.perf_counter() - start < budget):
        t = time.perf_counter()
        step()
        rates.append(batch.num_tokens / (time.perf_counter() - t))
    params = sum(p.numel() for p in model.parameters())
    row = Row(f"drafter training ({s.drafter_layers} layers)", rates, setup, peak_memory(device),
              f"{params / 1e6:,.1f}M trainable; {batch.input_ids.shape[0]} x {s.seq_len} tokens, "
              f"{s.num_anchors} anchors/seq, B={s.block_size}")
    model = optimizer = batch = embed = head = None  # the step closure holds them: free them before the next part
    release(device)
    return row


# --- 2. loader --------------------------------------------------------------------------------------


def write_synthetic_cache(s: Sizes, root: Path, seed: int = 0) -> tuple[str, float]:
    """Shards of s.seq_len-token sequences cut like the build (StorageConfig's 512 MiB), written
    with write_shard, plus the minimal manifest open_cache needs. Returns (url, GB of payload)."""
    rng = np.random.default_rng(seed)
    storage = StorageConfig()
    per_token = fmt.hidden_bytes_per_token(len(s.tapped), s.hidden, "bfloat16")
    per_shard = max(1, storage.shard_bytes // per_token // s.seq_len)  # sequences per shard
    num_seqs = max(1, s.loader_tokens // s.seq_len)
    # Gaussian bf16 patterns from a small pool (values do not matter to the loader; generating
    # gigabytes of normals would take longer than the benchmark)
    pool = rng.standard_normal((4 * s.seq_len, len(s.tapped), s.hidden), dtype=np.float32)
    pool = pool.astype(ml_dtypes.bfloat16).view(np.uint16)
    store = fmt.CacheStore.open(str(root))
    records, payload = [], 0
    for index, first in enumerate(range(0, num_seqs, per_shard)):
        count = min(per_shard, num_seqs - first)
        n = count * s.seq_len
        offsets = rng.integers(0, len(pool) - s.seq_len, count)
        hidden = np.concatenate([pool[o:o + s.seq_len] for o in offsets])
        loss_mask = np.ones(n, dtype=np.uint8)
        loss_mask[:: s.seq_len] = 0
        topk_ids = (rng.integers(0, s.vocab, (n, 1)) + np.arange(s.top_k) * (s.vocab // s.top_k)) % s.vocab
        shard = ShardData(
            rank=0, index=index, row_start=first, row_end=first + count,
            ids=[f"seq-{first + i:08d}" for i in range(count)], rows=np.arange(first, first + count, dtype=np.int64),
            lengths=np.full(count, s.seq_len, dtype=np.int32), truncated=np.zeros(count, dtype=bool),
            input_ids=rng.integers(0, s.vocab, n, dtype=np.int32), loss_mask=loss_mask, hidden=hidden,
            topk_ids=topk_ids.astype(np.int32),
            topk_logprobs=-np.cumsum(rng.exponential(0.3, (n, s.top_k)), axis=1).astype(np.float32) - 0.1)
        records.append(write_shard(store, shard, storage, "bfloat16"))
        payload += hidden.nbytes + n * fmt.token_bytes_per_token(s.top_k)
    fmt.write_manifest(store, fmt.manifest_header(s.tapped, s.hidden, "bfloat16", s.top_k), records, complete=True)
    return str(root), payload / 1e9


def bench_loader(s: Sizes, device: torch.device, tmp: Path, workers: int, budget: float, max_batches: int) -> Row:
    t0 = time.perf_counter()
    root = tmp / f"gpu-bench-cache-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        url, gigabytes = write_synthetic_cache(s, root)
        written = time.perf_counter() - t0
        cache = open_cache(url)
        data = DataConfig(batch_tokens=s.batch_tokens, anchors="random", num_anchors=s.num_anchors, heldout_fraction=0.0,
                          num_workers=workers)
        epoch_batches = len(EpochPlan(cache, data).batches(0))
        train_cfg = TrainConfig(cache=url, out="", data=data, noise=NoiseConfig(schedule="cosine"))  # noise on: its cost is measured
        state = LoaderState(manifest_fingerprint=cache.fingerprint)
        stream = iter(train_loader(url, None, data, state, pin_memory=device.type == "cuda"))

        def take(step: int) -> int:
            batch = on_device(next(stream), device, train_cfg, step, 1000)
            sync(device)
            return batch.num_tokens

        take(0)  # worker start-up and the first batch: not counted
        setup = time.perf_counter() - t0
        # with workers, batches arrive in bursts: rates are taken over windows of several batches
        window = 2 * max(1, workers)
        rates, tokens, batches = [], 0, 0
        start = last = time.perf_counter()
        # past the first epoch the stream rereads the same shards: the page cache is warm either way
        while batches < max_batches and time.perf_counter() - start < budget:
            batches += 1
            tokens += take(batches)
            if batches % window == 0:
                now = time.perf_counter()
                rates.append(tokens / (now - last))
                tokens, last = 0, now
        elapsed = time.perf_counter() - start
        stream = None  # stops the loader's threads before the next part
        if not rates and batches:
            rates = [tokens / elapsed]
        note = (f"{workers} worker(s), to {device.type} + noise there; {gigabytes:.2f} GB cache made and written in {written:.0f} s, warm page "
                f"cache; {batches} batches ({epoch_batches} per epoch), rates over windows of {window}")
        return Row(f"loader ({workers} workers)", rates, setup, "-", note)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def bench_noise(s: Sizes, device: torch.device, budget: float, max_steps: int) -> Row:
    """The trainer's noise alone on `device` (a float32 batch of the drafter's size), and whether the
    device draws what the CPU draws: uniform bit for bit, Gaussian up to float32 rounding."""
    t0 = time.perf_counter()
    uniform, gaussian = NoiseConfig(schedule="cosine"), NoiseConfig(schedule="cosine", distribution="gaussian")
    shape = (min(s.seq_len, 4096), s.hidden)
    same_uniform = torch.equal(noise_for(uniform, 3, 1000, "seq-0", shape, 1, device).cpu(),
                               noise_for(uniform, 3, 1000, "seq-0", shape, 1))
    g_device = noise_for(gaussian, 3, 1000, "seq-0", shape, 1, device).cpu()
    g_cpu = noise_for(gaussian, 3, 1000, "seq-0", shape, 1)
    gaussian_diff = float((g_device - g_cpu).abs().max())
    rows = s.batch_tokens // s.seq_len
    hidden = torch.zeros(rows, s.seq_len, len(s.tapped), s.hidden, device=device)
    ids, lengths = [f"seq-{i}" for i in range(rows)], [s.seq_len] * rows
    add_noise_(hidden, ids, lengths, uniform, 0, 1000)
    sync(device)
    setup = time.perf_counter() - t0
    rates, start = [], time.perf_counter()
    while len(rates) < max_steps and (not rates or time.perf_counter() - start < budget):
        t = time.perf_counter()
        add_noise_(hidden, ids, lengths, uniform, len(rates) + 1, 1000)
        sync(device)
        rates.append(rows * s.seq_len / (time.perf_counter() - t))
    draws = (len(s.tapped) - 1) * s.hidden
    note = (f"uniform on {device.type} == CPU: {same_uniform}; gaussian max |diff| {gaussian_diff:.1e} at scale 0.1; "
            f"{draws:,} draws/token, best {max(rates) * draws / 1e9:.1f} G draws/s")
    del hidden
    release(device)
    return Row("noise alone (add_noise_)", rates, setup, peak_memory(device), note)


# --- 3. teacher extraction ------------------------------------------------------------------------------


def bench_teacher(s: Sizes, device: torch.device, budget: float, max_steps: int) -> list[Row]:
    from transformers import AutoModelForCausalLM, Qwen3Config

    t0 = time.perf_counter()
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    config = Qwen3Config(hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.cut_layers,
                         num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                         vocab_size=s.vocab, max_position_embeddings=4 * s.seq_len, tie_word_embeddings=False,
                         pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    tcfg = TeacherConfig(name_or_path="random-weight qwen3, production shape", dtype=dtype, device=str(device),
                         top_k=s.top_k, batch_tokens=s.batch_tokens)
    # Teacher.forward needs only the pad id from a tokenizer; there is no vocabulary to tokenize here
    teacher = Teacher(cfg=tcfg, model=model, tokenizer=SimpleNamespace(pad_token_id=0),
                      layer_ids=resolve_layers(tcfg, s.cut_layers), device=device)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, s.vocab, s.seq_len, dtype=np.int64) for _ in range(s.batch_tokens // s.seq_len)]
    tokens = sum(len(q) for q in sequences)
    teacher.forward(sequences)  # warm-up
    sync(device)
    last = torch.randn(tokens, s.hidden, device=device, dtype=getattr(torch, dtype))
    with torch.inference_mode():
        teacher._topk(last)
    sync(device)
    setup = time.perf_counter() - t0
    rates, heads, start = [], [], time.perf_counter()
    while len(rates) < max_steps and (not rates or time.perf_counter() - start < budget):
        t = time.perf_counter()
        teacher.forward(sequences)
        sync(device)
        rates.append(tokens / (time.perf_counter() - t))
        t = time.perf_counter()
        with torch.inference_mode():
            teacher._topk(last)  # the LM head + top-k alone, for the 64-layer estimate
        sync(device)
        heads.append(time.perf_counter() - t)
    params = sum(p.numel() for p in model.parameters())
    measured = Row(f"teacher extraction ({s.cut_layers} of {s.teacher_layers} layers)", rates, setup,
                   peak_memory(device), f"{params / 1e6:,.1f}M params, {dtype}, taps {teacher.layer_ids}, "
                   f"{len(sequences)} x {s.seq_len} tokens/forward")
    head_s = statistics.median(heads)
    estimate = []
    for rate in rates:
        layers_s = max(tokens / rate - head_s, 0.0)
        estimate.append(tokens / (head_s + layers_s * s.teacher_layers / s.cut_layers))
    scaled = Row(f"teacher extraction ({s.teacher_layers} layers, est.)", estimate, 0.0, "-",
                 f"LM head + top-k {head_s * 1e3:.0f} ms/forward measured; layers scaled x{s.teacher_layers / s.cut_layers:.1f}")
    del model, teacher, last
    release(device)
    return [measured, scaled]


# --- the run ------------------------------------------------------------------------------------------


def guarded(name: str, clock: Clock, needed_s: float, fn, *args) -> list[Row]:
    """Run one part; a failure or a spent time budget becomes a row saying so, not a crash."""
    if clock.left() < needed_s:
        return [Row(name, [], 0.0, error=f"skipped: {clock.left():.0f} s left of the run's budget")]
    try:
        out = fn(*args)
        return out if isinstance(out, list) else [out]
    except Exception as err:  # noqa: BLE001 - one part failing must not lose the others' numbers
        return [Row(name, [], 0.0, error=f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}")]


def print_table(rows: list[Row], total_s: float, device: torch.device) -> None:
    base = next((r for r in rows if r.part.startswith("drafter") and r.rates), None)
    header = (f"{'part':<40} {'tokens/s':>10} {'(med)':>10} {'x drafter':>9} {'n':>4} {'peak GiB':>10} "
              f"{'setup s':>7}  notes")
    print(header)
    print("-" * len(header))
    for r in rows:
        if not r.rates:
            print(f"{r.part:<40} {r.error or 'no measurement'}")
            continue
        best, med = max(r.rates), statistics.median(r.rates)
        ratio = f"{best / max(base.rates):.2f}" if base else "-"
        print(f"{r.part:<40} {best:>10,.0f} {med:>10,.0f} {ratio:>9} {len(r.rates):>4} {r.peak:>10} "
              f"{r.setup_s:>7.1f}  {r.note}")
    print(f"device {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print(f"total wall time {total_s:.1f} s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: runs on CPU in seconds")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cuda, cuda:N or cpu")
    parser.add_argument("--tmp", default=str(HERE.parent / ".bench-tmp"), help="local scratch folder for the loader's cache")
    parser.add_argument("--loader-workers", type=int, default=None, help="DataLoader workers (default 0, as the README recommends; --tiny 1)")
    parser.add_argument("--teacher-layers", type=int, default=None, help="decoder layers of the random teacher")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds for each part's timed loop")
    parser.add_argument("--limit-s", type=float, default=450.0, help="the whole run's deadline")
    parser.add_argument("--max-steps", type=int, default=50, help="most timed steps (loader: batches) per part")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    clock = Clock(args.limit_s)
    sizes = TINY if args.tiny else PRODUCTION
    if args.teacher_layers:
        sizes = dataclasses.replace(sizes, cut_layers=args.teacher_layers)
    budget = args.budget_s if args.budget_s is not None else (0.5 if args.tiny else 60.0)
    max_steps = min(args.max_steps, 6) if args.tiny else args.max_steps
    workers = args.loader_workers if args.loader_workers is not None else (1 if args.tiny else 0)
    device = resolve_device(args.device)
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"# sizes: {json.dumps(dataclasses.asdict(sizes))}", flush=True)

    rows: list[Row] = []
    # setup estimates (seconds) keep a part from starting when it cannot finish inside --limit-s
    rows += guarded("drafter training", clock, 60, lambda: bench_drafter(sizes, device, clock.budget(budget), max_steps))
    print(f"# drafter done at {time.perf_counter() - started:.0f} s", flush=True)
    rows += guarded("loader (train_loader)", clock, 60,
                    lambda: bench_loader(sizes, device, tmp, workers, clock.budget(budget), max_steps))
    rows += guarded("noise alone", clock, 10, lambda: bench_noise(sizes, device, clock.budget(budget / 4), max_steps))
    print(f"# loader done at {time.perf_counter() - started:.0f} s", flush=True)
    rows += guarded("teacher extraction", clock, 60, lambda: bench_teacher(sizes, device, clock.budget(budget), max_steps))
    print_table(rows, time.perf_counter() - started, device)


if __name__ == "__main__":
    main()
