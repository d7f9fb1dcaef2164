"""The GPU check's other in-process parts (benchmarks/gpu_check.py): `env`, `teacher_layers`,
`loader_width`, and the extras `noise` and `packed`. Each returns (summary, details) and raises on
failure."""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch
from bench_gpu import write_synthetic_cache
from bench_packed import plan_lengths, sharegpt_lengths
from bench_trainer import synthetic_sequences
from gpu_check_common import build_drafter, device, markdown, on_cpu, peak_memory, sizes, sync, timed_step

from dflash_train.settings.noise_config import NoiseConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.noise import add_noise_


def part_env(out: Path):
    missing = []
    for module in ("zarr", "numcodecs", "pyarrow", "safetensors", "xxhash", "ml_dtypes", "typer", "fsspec",
                   "transformers", "httpx", "matplotlib"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise RuntimeError(f"missing modules {missing}: run `make gpu-bundle` and carry .whl")
    dev = device()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    import transformers
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if dev.type == "cuda" else "-"
    free = shutil.disk_usage(out).free / 1e9  # the checkpoint part writes ~22 GB
    details = {"device": name, "torch": torch.__version__, "transformers": transformers.__version__, "nccl": nccl,
               "gpus": torch.cuda.device_count() if dev.type == "cuda" else 0, "free_disk_gb": round(free, 1)}
    return (f"{name} x{details['gpus']}, torch {torch.__version__}, transformers {transformers.__version__}, NCCL {nccl}, "
            f"{free:.0f} GB free disk"), details


def part_noise(out: Path):
    """The noise drawn on the device equals the CPU's: uniform bit for bit, gaussian to rounding."""
    s = sizes()
    worst = {}
    for distribution in ("uniform", "gaussian"):
        cfg = NoiseConfig(schedule="constant", start=0.05, distribution=distribution)
        base = torch.zeros(2, s.seq_len, len(s.tapped), s.hidden)
        on_host, on_dev = base.clone(), base.clone().to(device())
        add_noise_(on_host, ["a", "b"], [s.seq_len, s.seq_len // 2], cfg, 7, 100)
        add_noise_(on_dev, ["a", "b"], [s.seq_len, s.seq_len // 2], cfg, 7, 100)
        worst[distribution] = float((on_dev.cpu() - on_host).abs().max())
    if worst["uniform"] != 0.0 or worst["gaussian"] > 1e-6:
        raise RuntimeError(f"device noise differs from CPU noise: {worst}")
    return f"uniform identical, gaussian max diff {worst['gaussian']:.1e}", worst


def part_packed(out: Path):
    """data.layout packed against padded at production width (issue 27): a default-size batch of the
    ShareGPT-like length spread (bench_packed.py) in both layouts, the same bf16 loss, and the
    step's tokens/s and peak memory in each (CPU dry run: tiny sizes, the loss only checked)."""
    s, dev = sizes(), device()
    lengths = plan_lengths(sharegpt_lengths(4000, seed=1), s.batch_tokens)
    batch_lengths = max(lengths, key=len)  # the batch of most sequences: the most padding to skip
    train_cfg, results = TrainConfig(cache="", out=""), {}
    for layout in ("padded", "packed"):
        model = build_drafter(s, dev, "flex" if dev.type == "cuda" else "sdpa")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=dev.type == "cuda")
        batch = synthetic_sequences(batch_lengths, s.vocab, len(s.tapped), s.hidden, s.top_k, s.num_anchors,
                                    layout=layout).to(dev)
        losses, times = [], []
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        for _ in range(5):
            seconds, loss = timed_step(model, batch, train_cfg, optimizer, dev)
            times.append(seconds)
            losses.append(loss)
        results[layout] = {"first_loss": losses[0], "tokens_per_s": batch.num_tokens / min(times[2:]),
                           "peak": peak_memory(dev), "row_positions": int(batch.input_ids.numel())}
        del model, optimizer, batch
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    padded, packed = results["padded"], results["packed"]
    if abs(packed["first_loss"] - padded["first_loss"]) > 2e-2 * abs(padded["first_loss"]):
        raise RuntimeError(f"packed loss {packed['first_loss']} differs from padded {padded['first_loss']}")
    ratio = packed["tokens_per_s"] / padded["tokens_per_s"]
    return (f"{len(batch_lengths)} sequences, {sum(batch_lengths):,} tokens in {padded['row_positions']:,} padded positions; "
            f"packed {ratio:.2f}x padded tok/s ({packed['tokens_per_s']:,.0f} vs {padded['tokens_per_s']:,.0f}), "
            f"peak {packed['peak']} vs {padded['peak']}"), results


def part_loader_width(out: Path):
    """The loader at production width (5 tapped layers x 5,120, bf16) on a 32k-token synthetic cache:
    the shards' integrity check (checksums of every file) timed alone, against the loader
    streaming batches to the device with its check on (train_loader always checks: each shard is
    hashed on the reading threads before its first sequence is handed out). The loader's rate
    without the check is bounded by the two: checking costs at most loader bytes / checksum rate. On
    CUDA the batches must land in pinned memory."""
    from dflash_cache import open_cache
    from dflash_train.settings.data_config import DataConfig
    from dflash_train.training.data import LoaderState, train_loader

    s, dev = sizes(), device()
    root = out / "width-cache"
    shutil.rmtree(root, ignore_errors=True)
    try:
        url, gigabytes = write_synthetic_cache(s if on_cpu() else replace(s, loader_tokens=32_768), root)
        cache = open_cache(url)
        t = time.perf_counter()
        problems = [p for shard in cache.shards for p in shard.checksum_problems()]
        hash_s = time.perf_counter() - t
        if problems:
            raise RuntimeError(f"a fresh synthetic cache fails its checksums: {problems[:2]}")
        details = {"cache_gb": gigabytes, "hash_gb_per_s": gigabytes / hash_s}
        data = DataConfig(batch_tokens=s.batch_tokens, anchors="random", num_anchors=s.num_anchors, heldout_fraction=0.0)
        stream = iter(train_loader(url, None, data, LoaderState(manifest_fingerprint=cache.fingerprint),
                                   pin_memory=dev.type == "cuda"))
        t, tokens, batches, pinned = time.perf_counter(), 0, 0, None
        for batch in stream:  # one epoch: every shard read, so every shard hashed
            pinned = batch.hidden.is_pinned() if pinned is None and dev.type == "cuda" else pinned
            batch.to(dev)
            tokens, batches = tokens + batch.num_tokens, batches + 1
            if batch.state_after["epoch"] > 0:
                break
        sync(dev)
        stream = None
        if pinned is False:
            raise RuntimeError("the loader's hidden states are not in pinned memory")
        seconds = time.perf_counter() - t
        rate = tokens / seconds
        details.update(loader_tokens_per_s=rate, loader_gb_per_s=gigabytes / seconds, pinned=pinned)
        rows = [["checksums alone", "-", "-", f"{gigabytes / hash_s:.2f}"],
                ["loader, check on (one epoch)", batches, f"{rate:,.0f}", f"{gigabytes / seconds:.2f}"]]
        table = (f"cache {gigabytes:.2f} GB, {len(cache.shards)} shard(s)\n\n"
                 + markdown(["what", "batches", f"tokens/s to {dev.type}", "GB/s"], rows))
        details["table"] = table
        print(table)
        return (f"checksums {gigabytes / hash_s:.2f} GB/s alone; loader {rate:,.0f} tok/s "
                f"({gigabytes / seconds:.2f} GB/s) with the check on, pinned {pinned}"), details
    finally:
        shutil.rmtree(root, ignore_errors=True)


def part_teacher_layers(out: Path):
    """A few full-width qwen3_5 layers (random bf16 weights, the production teacher's widths:
    hidden 5120, three Gated DeltaNet layers then one attention layer) timed over one 8k-token
    sequence, and which Gated DeltaNet implementation ran: the kernel packages or transformers'
    torch fallback (CPU dry run: hidden 64, 64 tokens)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    from dflash_teacher.deltanet_kernels import gated_deltanet_kernels, gated_deltanet_note

    dev, cpu = device(), on_cpu()
    width = (dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  mrope=[2, 1, 1]) if cpu else
             dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48,
                  mrope=[11, 11, 10]))
    mrope = width.pop("mrope")
    config = Qwen3_5TextConfig(
        **width, vocab_size=256, num_hidden_layers=4, linear_conv_kernel_dim=4, max_position_embeddings=16384,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": mrope, "mrope_interleaved": True})
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3_5TextModel(config).to(torch.float32 if cpu else torch.bfloat16).eval()
        tokens = 64 if cpu else 8192
        x = torch.randn(1, tokens, config.hidden_size, dtype=next(model.parameters()).dtype) * 0.5
    kernels = gated_deltanet_kernels(model)
    times = []
    with torch.inference_mode():
        for _ in range(1 if cpu else 2):  # the first is warm-up (kernel compilation, allocator)
            sync(dev)
            start = time.perf_counter()
            last = model(inputs_embeds=x, use_cache=False).last_hidden_state
            sync(dev)
            times.append(time.perf_counter() - start)
    if not torch.isfinite(last).all():
        raise RuntimeError("full-width qwen3_5 layers gave non-finite states")
    seconds = min(times[1:] or times)
    implementation = ("kernels" if all(kernels.values()) else
                      "torch fallback" if not any(kernels.values()) else "mixed")
    details = {"implementation": implementation, "kernels": kernels, "tokens": tokens, "layers": 4,
               "seconds": round(seconds, 4), "ms_per_layer": round(seconds * 1000 / 4, 2),
               "tokens_per_s": round(tokens / seconds), "note": gated_deltanet_note(model, dev)}
    return (f"Gated DeltaNet: {implementation} ({', '.join(f'{k} {v}' for k, v in kernels.items())}); 4 layers at "
            f"hidden {config.hidden_size}, {tokens} tokens: {details['ms_per_layer']} ms/layer, "
            f"{details['tokens_per_s']:,} tok/s"), details


# --- driver ---------------------------------------------------------------------------------------------------
