"""Trainer memory and speed as the vocabulary and the anchors per sequence grow (issue #6, item 4).

Each configuration runs a few real training steps: dflash_train's drafter, batches made by
dflash_train.training.epoch_plan's sample_anchors, batch's collate, and `train_step.micro_step` (model forward,
block_targets, the chunked loss, backward) followed by the trainer's clip and AdamW step. The
baseline, in the same grid and on the same data, is a NAIVE loss written here (`naive_block_loss`):
the same KL-with-tail objective, but full-vocabulary fp32 logits for every block position of the
whole batch at once, kept for backward, no chunking and no recompute. Both report the same loss
value (checked), so the comparison is like for like.

Memory: every (configuration, variant, round) runs in a fresh subprocess. After a warm-up step on
one anchor per sequence (it allocates gradients and AdamW state) the process resets its peak RSS (Linux
/proc/self/clear_refs "5"), runs the timed steps and reads the peak back: `step peak` is that peak
minus the RSS before the timed steps, i.e. what a training step adds on top of the model, the
optimizer and the batch. glibc is told to mmap every allocation of 1 MiB or more
(MALLOC_MMAP_THRESHOLD_) so freed blocks go back to the OS and each step's peak is seen whole. On
CUDA the same is read from torch.cuda.max_memory_allocated.

    .venv/bin/python benchmarks/bench_trainer.py          # the default grid, 2 rounds (~12-15 min on 2 cores)
    .venv/bin/python benchmarks/bench_trainer.py --tiny   # a smoke test (seconds)

See benchmarks/README.md for the columns.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from dflash_cache.reader import SequenceRecord  # noqa: E402
from dflash_train.settings.drafter_config import DrafterConfig  # noqa: E402
from dflash_train.settings.loss_config import LossConfig  # noqa: E402
from dflash_train.settings.train_config import TrainConfig  # noqa: E402
from dflash_train.training.batch import collate  # noqa: E402
from dflash_train.training.batch_objective import block_states  # noqa: E402
from dflash_train.training.distributed import DistInfo  # noqa: E402
from dflash_train.training.epoch_plan import cover_anchors, sample_anchors  # noqa: E402
from dflash_train.training.loss import LossOutput  # noqa: E402
from dflash_train.training.model import DFlashDrafter  # noqa: E402
from dflash_train.training.objectives import bucket_kl  # noqa: E402
from dflash_train.training.train_step import micro_step  # noqa: E402
from dflash_train.training.weighting import position_weights  # noqa: E402

PROMPT_TOKENS = 16  # leading tokens outside the loss mask, like a chat prompt
NAIVE = "naive"
RESULT_TAG = "RESULT "


# --- data and model ------------------------------------------------------------------------------


def synthetic_batch(num_seqs: int, seq_len: int, vocab: int, layers: int, hidden: int, top_k: int,
                    anchors: int, seed: int = 0):
    """A real collated Batch of random sequences (same seed -> same batch in every variant)."""
    return synthetic_sequences([seq_len] * num_seqs, vocab, layers, hidden, top_k, anchors, seed)


def synthetic_sequences(lengths: list[int], vocab: int, layers: int, hidden: int, top_k: int, anchors: int,
                        seed: int = 0, layout: str = "padded", cover: int | None = None):
    """A real collated Batch (in `layout`) of random sequences of these lengths, each with `anchors`
    random anchors or, with `cover` (the drafter's draft positions), the blocks covering it."""
    rng = np.random.default_rng(seed)
    records, hiddens, anchor_lists = [], [], []
    for i, seq_len in enumerate(lengths):
        seq_id = f"bench-{i:05d}"
        loss_mask = np.ones(seq_len, dtype=np.uint8)
        loss_mask[:PROMPT_TOKENS] = 0
        # distinct top-k ids: a random start, then k evenly spaced ids around the vocabulary
        starts = rng.integers(0, vocab, (seq_len, 1))
        topk_ids = ((starts + np.arange(top_k) * (vocab // top_k)) % vocab).astype(np.int32)
        # a proper distribution over k + 1 buckets (top-k sorted descending, then the tail)
        weights = rng.exponential(1.0, (seq_len, top_k + 1)) ** 3
        probs = weights / weights.sum(1, keepdims=True)
        topk = -np.sort(-probs[:, :top_k], axis=1)
        records.append(SequenceRecord(
            id=seq_id, input_ids=rng.integers(0, vocab, seq_len, dtype=np.int32), loss_mask=loss_mask,
            hidden=np.empty((0,)), topk_ids=topk_ids, topk_logprobs=np.log(topk).astype(np.float32)))
        hiddens.append(rng.standard_normal((seq_len, layers, hidden), dtype=np.float32))
        anchor_lists.append(sample_anchors(loss_mask, anchors, seed, 0, seq_id) if cover is None
                            else cover_anchors(loss_mask, cover, seed, 0, seq_id))
    return collate(records, anchor_lists, hiddens, layout)


def drafter(vocab: int, hidden: int, num_layers: int, tapped: int, block_size: int, device) -> DFlashDrafter:
    heads = max(1, hidden // 32)
    cfg = DrafterConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                        head_dim=hidden // heads, intermediate_size=3 * hidden, vocab_size=vocab,
                        mask_token_id=vocab - 1, target_layer_ids=tuple(range(tapped)),
                        num_target_layers=tapped + 1, num_hidden_layers=num_layers, block_size=block_size)
    torch.manual_seed(0)
    embed = torch.randn(vocab, hidden) * 0.02
    head = torch.randn(vocab, hidden) * 0.02
    return DFlashDrafter(cfg, embed, head).to(device)


# --- the baseline ----------------------------------------------------------------------------------


def naive_block_loss(states, lm_head_weight, targets, topk_ids, topk_logprobs, valid, cfg: LossConfig,
                     block_size: int) -> LossOutput:
    """BASELINE, NOT THE PACKAGE'S LOSS: dflash_train.training.loss.block_loss's kl objective computed the
    obvious way, with full-vocabulary fp32 logits [M, P, V] for every block position of the batch,
    all alive for backward. Same value as block_loss (the benchmark checks it)."""
    logits = states.float() @ lm_head_weight.float().T  # [M, P, V]
    log_norm = torch.logsumexp(logits, dim=-1)
    log_q = logits.gather(-1, topk_ids.long()) - log_norm[..., None]
    teacher_p = topk_logprobs.float().exp()
    teacher_tail = (1.0 - teacher_p.sum(-1)).clamp(min=0.0)
    log_q_tail = torch.logsumexp(logits.scatter(-1, topk_ids.long(), float("-inf")), dim=-1) - log_norm
    per_position = bucket_kl(teacher_p, log_q, teacher_tail, log_q_tail)
    with torch.no_grad():
        alpha = torch.minimum(teacher_p, log_q.exp()).sum(-1) + torch.minimum(teacher_tail, log_q_tail.exp())
    valid = valid.bool()
    weights = position_weights(alpha, valid, cfg, block_size)
    num_valid = int(valid.sum())
    loss = (weights * per_position)[valid].sum() / max(num_valid, 1)
    count = valid.sum(0)
    zeros = torch.zeros(valid.shape[1])
    return LossOutput(loss=loss, alpha_sum=zeros, greedy_sum=zeros, count=count, loss_sum=zeros)


def naive_micro_step(model: DFlashDrafter, batch, cfg: TrainConfig, autocast) -> LossOutput:
    """micro_step with the naive loss in place of block_loss (one process, no accumulation)."""
    with autocast:
        states, targets, _ = block_states(model, batch)
        out = naive_block_loss(states, model.lm_head_weight, targets["targets"], targets["topk_ids"],
                               targets["topk_logprobs"], targets["valid"], cfg.loss, model.cfg.block_size)
    out.loss.backward()
    return out


# --- one configuration, in its own process -------------------------------------------------------------


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> bool:
    """Reset the process's peak RSS (VmHWM); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_worker(args) -> dict:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = TrainConfig(cache="", out="", loss=LossConfig(chunk_positions=(args.chunk if args.variant != NAIVE else 0) or None))
    chunk = cfg.loss.positions_per_chunk(args.vocab)
    model = drafter(args.vocab, args.hidden, args.layers, args.tapped, args.block_size, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas)
    batch = synthetic_batch(args.sequences, args.seq_len, args.vocab, args.tapped, args.hidden, args.top_k,
                            args.anchors).to(device)
    # the warm-up step only has to allocate gradients and AdamW state: one anchor per sequence is enough
    warmup = synthetic_batch(args.sequences, args.seq_len, args.vocab, args.tapped, args.hidden, args.top_k,
                             1).to(device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))

    def step(batch) -> LossOutput:
        if args.variant == NAIVE:
            out = naive_micro_step(model, batch, cfg, autocast)
        else:
            out = micro_step(model, model, batch, cfg, DistInfo(), device, autocast)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out

    step(warmup)
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = _status_bytes("VmRSS")
        reset = _reset_peak_rss()
    times, losses = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        out = step(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(out.loss.detach()))
    if device.type == "cuda":
        peak, how = torch.cuda.max_memory_allocated(), "cuda"
    elif reset:
        peak, how = _status_bytes("VmHWM"), "hwm"
    else:  # whole-process peak: includes setup, so an upper bound of the step's
        peak, how = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "maxrss"
    model_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return {"variant": args.variant, "vocab": args.vocab, "anchors": args.anchors, "chunk": chunk,
            "positions": int(out.count.sum()), "grid_positions": int(batch.anchors.numel() * (args.block_size - 1)),
            "tokens": batch.num_tokens, "times": times, "step_peak": peak - before, "rss_before": before,
            "model_bytes": model_bytes, "loss": losses[0], "how": how}


# --- the grid --------------------------------------------------------------------------------------------


def spawn(args, variant: str, vocab: int, anchors: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--vocab", str(vocab),
           "--anchors", str(anchors)]
    for name in ("hidden", "layers", "tapped", "block_size", "sequences", "seq_len", "top_k", "steps",
                 "threads", "device", "chunk"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(2**20), OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"variant": variant, "vocab": vocab, "anchors": anchors, "error": f"exit {proc.returncode}: {tail}"}


def naive_bytes_estimate(args, vocab: int, anchors: int) -> float:
    """The naive loss holds about 5 fp32 [positions, vocab] tensors at its peak (measured: 5.1 at 248k x 1,920)."""
    return 5.5 * args.sequences * anchors * (args.block_size - 1) * vocab * 4


def variants(args) -> list[str]:
    return [NAIVE] + [f"chunk{c}" for c in args.chunks]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocabs", default="2048,32768,151936,248320", help="vocabulary sizes, comma-separated")
    parser.add_argument("--anchor-counts", default="4,16,64", help="anchors per sequence, comma-separated")
    parser.add_argument("--chunks", default="auto,256",
                        help="loss.chunk_positions of the chunked variants; auto = the trainer's default (chunks of "
                             "loss.chunk_bytes of logits)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2, help="drafter layers")
    parser.add_argument("--tapped", type=int, default=5, help="tapped teacher layers")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sequences", type=int, default=1, help="sequences per batch")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1, help="timed steps per process (after a one-anchor warm-up step)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the whole grid")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-naive-gb", type=float, default=6.0,
                        help="skip the naive baseline where it would need more memory than this")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke test")
    # worker mode (one configuration, run by the grid in a subprocess)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--anchors", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)  # 0 = auto
    args = parser.parse_args(argv)

    if args.worker:
        print(RESULT_TAG + json.dumps(run_worker(args)), flush=True)
        return
    if args.tiny:
        args.vocabs, args.anchor_counts, args.chunks = "16384", "8", "32"
        args.hidden, args.layers, args.seq_len, args.top_k, args.steps, args.rounds = 32, 1, 128, 8, 1, 1
    args.vocabs = [int(v) for v in args.vocabs.split(",")]
    args.anchor_counts = [int(a) for a in args.anchor_counts.split(",")]
    args.chunks = [c.strip() if c.strip() == "auto" else int(c) for c in args.chunks.split(",")]

    started = time.perf_counter()
    print(f"# grid: vocab {args.vocabs} x anchors {args.anchor_counts}; {args.sequences} x {args.seq_len} tokens, "
          f"hidden {args.hidden}, {args.layers} drafter layer(s), {args.tapped} tapped, B={args.block_size}, "
          f"k={args.top_k}; {args.steps} timed step(s) per process, {args.rounds} round(s), {args.threads} thread(s), "
          f"device {args.device}", flush=True)
    results: dict[tuple, list[dict]] = {}
    configs = [(v, a) for v in args.vocabs for a in args.anchor_counts]
    for rnd in range(args.rounds):
        for vocab, anchors in configs:
            # alternate the order so neither variant always runs right after the other's teardown
            order = variants(args) if rnd % 2 == 0 else variants(args)[::-1]
            for variant in order:
                if variant == NAIVE and naive_bytes_estimate(args, vocab, anchors) > args.max_naive_gb * 2**30:
                    res = {"variant": variant, "vocab": vocab, "anchors": anchors,
                           "error": f"skipped (about {naive_bytes_estimate(args, vocab, anchors) / 2**30:.1f} GiB "
                                    f"> --max-naive-gb {args.max_naive_gb})"}
                else:
                    # the naive loss ignores the chunk; it is passed only to keep one command line
                    size = variant.removeprefix("chunk")
                    args.chunk = 0 if variant == NAIVE or size == "auto" else int(size)
                    res = spawn(args, variant, vocab, anchors)
                results.setdefault((vocab, anchors, variant), []).append(res)
                print(f"# round {rnd + 1}: {variant:>9} vocab {vocab:>7,} anchors {anchors:>3}: "
                      + (res.get("error") or f"{min(res['times']):.3f} s/step, step peak {res['step_peak'] / 2**20:,.0f} MiB"),
                      flush=True)
    print_table(args, results, configs)
    print(f"total wall time {time.perf_counter() - started:.1f} s")


def print_table(args, results, configs) -> None:
    header = (f"{'variant':>9} {'vocab':>7} {'anchors':>7} {'positions':>9} {'model MiB':>9} {'step peak MiB':>13} "
              f"{'x naive':>7} {'fp32 logits copies':>18} {'tok/s':>8} {'(med)':>8} {'x naive':>7} {'loss':>9}")
    print(header)
    print("-" * len(header))
    for vocab, anchors in configs:
        base = _summary(results[(vocab, anchors, NAIVE)])
        for variant in variants(args):
            s = _summary(results[(vocab, anchors, variant)])
            if s is None:
                err = next(r["error"] for r in results[(vocab, anchors, variant)] if "error" in r)
                print(f"{variant:>9} {vocab:>7} {anchors:>7} {'':>9} {'':>9} {err}")
                continue
            logits_rows = s["grid_positions"] if variant == NAIVE else min(s["positions"], s["chunk"])
            copies = s["peak"] / (logits_rows * vocab * 4)
            mem_ratio = f"{s['peak'] / base['peak']:.2f}" if base else "-"
            speed_ratio = f"{s['best'] / base['best']:.2f}" if base else "-"
            print(f"{variant:>9} {vocab:>7} {anchors:>7} {s['positions']:>9} {s['model'] / 2**20:>9.1f} "
                  f"{s['peak'] / 2**20:>13.1f} {mem_ratio:>7} {copies:>18.2f} {s['best']:>8.0f} {s['median']:>8.0f} "
                  f"{speed_ratio:>7} {s['loss']:>9.5f}")
        chunked = _summary(results[(vocab, anchors, variants(args)[1])])
        if base and chunked and not np.isclose(base["loss"], chunked["loss"], rtol=1e-4, atol=1e-6):
            print(f"WARNING: naive loss {base['loss']} != chunked loss {chunked['loss']} (vocab {vocab}, anchors {anchors})")
    print("step peak = peak memory during the timed steps minus memory before them (model, optimizer state and "
          "batch excluded); fp32 logits copies = step peak / (rows x vocab x 4 B), rows = the naive loss's grid "
          "positions, or the chunked loss's min(valid positions, chunk); tok/s = batch tokens / step time, best "
          "round and (median)")


def _summary(runs: list[dict]) -> dict | None:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return None
    rates = [r["tokens"] / t for r in ok for t in r["times"]]
    return {"best": max(rates), "median": statistics.median(rates), "peak": max(r["step_peak"] for r in ok),
            "model": ok[0]["model_bytes"], "positions": ok[0]["positions"], "grid_positions": ok[0]["grid_positions"],
            "chunk": ok[0]["chunk"], "loss": ok[0]["loss"]}


if __name__ == "__main__":
    main()
