"""The GPU check's production-size training parts (benchmarks/gpu_check.py): `drafter` (the step
with compiled flex and sliding layers, flex against SDPA, the held-out path, the head's precision)
and `checkpoint` (a 22 GB save and resume). Each returns (summary, details) and raises on failure."""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch
from bench_gpu import write_synthetic_cache
from bench_packed import plan_lengths, sharegpt_lengths
from bench_trainer import synthetic_batch, synthetic_sequences
from gpu_check_common import autocast, build_drafter, device, markdown, mixed_config, on_cpu, peak_memory, sizes, sync, timed_step

from dflash_train.settings.loss_config import LossConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.batch_objective import batch_loss
from dflash_train.training.distributed import DistInfo
from dflash_train.training.objectives import head_dtype, set_head_matmul
from dflash_train.training.train_step import micro_step


def graphs() -> int:
    """The graphs dynamo compiled in this process so far."""
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def part_drafter(out: Path):
    """The production-shape drafter with sliding layers through compiled flex (docs/gpu.md)."""
    import torch._dynamo

    s, dev = sizes(), device()
    # past the recompile limit dynamo runs the function eagerly without a word (flex then
    # materialises whole masks): here that is an error naming the function instead
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    model = build_drafter(s, dev, "flex" if dev.type == "cuda" else "sdpa", mixed_config(s))
    steps, last = train_steps(model, s, dev)
    against = flex_against_sdpa(model, s, dev)
    heldout = heldout_path(model, s, dev, out)
    heads = head_precisions(model, last, dev)
    details = {"steps": steps, "flex_vs_sdpa": against, "heldout": heldout, "heads": heads}
    details["table"] = (
        markdown(["batch tokens", "batches", "first step", "steady tok/s", "graphs compiled", "peak"],
                 [[f"{steps['budget']:,}", steps["batches"], f"{steps['first_step_s']:.1f} s", f"{steps['tokens_per_s']:,.0f}",
                   steps["graphs"], steps["peak"]]]) + "\n\n"
        + markdown(["LM head", "loss (eval, one batch)", "rel. diff vs fp32", "seconds", "head GB"],
                   [[m, f"{h['loss']:.5f}", f"{h['relative_loss_difference']:.1e}", f"{h['seconds']:.3f}",
                     f"{h['head_gb']:.2f}"] for m, h in heads.items()]))
    print(details["table"])
    return (f"{steps['tokens_per_s']:,.0f} tok/s, first step {steps['first_step_s']:.1f} s, {steps['graphs']} graph(s); "
            f"flex vs sdpa loss {against['loss_relative']:.1e}, grads {against['grad_relative']}; held-out tau "
            f"{heldout['tau']:.2f}, {heldout['graphs_added']} graph(s) more ({heldout['graphs']} in all); bf16 head "
            f"{heads['bf16']['relative_loss_difference']:.1e}"), details


def train_steps(model, s, dev: torch.device) -> tuple[dict, object]:
    """Packed batches of ShareGPT-like lengths at the recipe's 8,192-token budget, anchored as the
    recipe anchors (`cover`: blocks tiling every loss position, ~1.07 block tokens a token), so the
    peak is the recipe's (CPU: 3 at the tiny budget): the first step (compile) time, steady
    tokens/s, graphs, peak memory; the last batch."""
    budget, count = (s.batch_tokens, 3) if on_cpu() else (8192, 12)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=dev.type == "cuda")
    plans = [b for b in plan_lengths(sharegpt_lengths(4000, seed=2), budget) if sum(b) > budget // 2][:count]
    train_cfg = TrainConfig(cache="", out="")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times, tokens, losses = [], [], []
    for index, lengths in enumerate(plans):
        batch = synthetic_sequences(lengths, s.vocab, len(s.tapped), s.hidden, s.top_k, s.num_anchors, seed=index,
                                    layout="packed", cover=model.cfg.num_draft_positions).to(dev)
        seconds, loss = timed_step(model, batch, train_cfg, optimizer, dev)
        times.append(seconds)
        tokens.append(batch.num_tokens)
        losses.append(loss)
    if not all(v == v and abs(v) < float("inf") for v in losses):
        raise RuntimeError(f"non-finite losses at {budget} tokens: {losses}")
    warm = 3 if len(times) > 3 else 1  # steady: after the compiles of the first shapes
    return {"budget": budget, "batches": len(plans), "first_step_s": times[0], "graphs": graphs(), "peak": peak_memory(dev),
            "tokens_per_s": sum(tokens[warm:]) / sum(times[warm:])}, batch


def flex_against_sdpa(model, s, dev: torch.device) -> dict:
    """One packed batch's loss and every attention projection's gradient under compiled flex and
    under SDPA's dense masks, same weights (CPU: the loss only, eager flex has no backward there).
    Its longest sequence is past the sliding window, so the sliding layers' masks cut into it; 4.7k
    tokens keep SDPA's dense masks (and its math kernel's scores, if it takes that) small."""
    lengths = [3000, 1200, 500] if dev.type == "cuda" else [120, 60, 40]
    batch = synthetic_sequences(lengths, s.vocab, len(s.tapped), s.hidden, s.top_k, s.num_anchors, seed=99,
                                layout="packed", cover=model.cfg.num_draft_positions).to(dev)
    grad = dev.type == "cuda"
    keep = [p for name, p in model.named_parameters() if ".self_attn." in name]  # dq, dk, dv reach these
    losses, grads = {}, {}
    for backend in ("flex", "sdpa"):
        model.attention_backend = backend
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad), autocast(dev):
            value = batch_loss(model, batch, TrainConfig(cache="", out="").loss, model).loss
        if grad:
            value.backward()
            grads[backend] = [p.grad.detach().float().clone() for p in keep]
        losses[backend] = float(value.detach())
    model.attention_backend = "flex" if dev.type == "cuda" else "sdpa"
    model.zero_grad(set_to_none=True)
    loss_relative = abs(losses["flex"] - losses["sdpa"]) / abs(losses["sdpa"])
    grad_relative = (max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(grads["flex"], grads["sdpa"]))
                     if grads else None)
    del grads
    if loss_relative > 1e-2 or (grad_relative is not None and grad_relative > 0.05):
        raise RuntimeError(f"compiled flex differs from sdpa on a packed sliding/full batch: loss {losses}, "
                           f"largest gradient rel. diff {grad_relative}")
    return {"loss_relative": loss_relative, "grad_relative": grad_relative if grad_relative is None else round(grad_relative, 5),
            "losses": losses}


def heldout_path(model, s, dev: torch.device, out: Path) -> dict:
    """The trainer's held-out evaluation (evaluate_heldout, as trainer.held_out calls it) on a
    production-width synthetic cache, after training compiled the drafter's graphs."""
    from dflash_cache import open_cache
    from dflash_train.settings.data_config import DataConfig
    from dflash_train.training.heldout import evaluate_heldout

    root = out / "heldout-cache"
    shutil.rmtree(root, ignore_errors=True)
    try:
        url, _ = write_synthetic_cache(replace(s, loader_tokens=16 * s.seq_len), root, seed=3)
        data = DataConfig(batch_tokens=s.batch_tokens if on_cpu() else 8192, heldout_fraction=0.5)
        before, t = graphs(), time.perf_counter()
        try:
            result = evaluate_heldout(model, open_cache(url), data, LossConfig(), 8, dev)
        except Exception as err:
            if "RecompileLimit" in type(err).__name__:
                raise RuntimeError(f"the held-out evaluation took a compiled function past dynamo's recompile limit "
                                   f"({before} graphs after training): {str(err).splitlines()[0][:160]}") from err
            raise
        sync(dev)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not result:
        raise RuntimeError("the held-out evaluation saw no held-out sequence")
    return {"tau": result["tau"], "loss": result["loss"], "seconds": round(time.perf_counter() - t, 2),
            "graphs": graphs(), "graphs_added": graphs() - before}


def head_precisions(model, batch, dev: torch.device) -> dict:
    """The loss's LM head in fp32, tf32 and bf16 on one batch: time, loss, the head's GB."""
    heads = {}
    model.eval()
    for mode in ("fp32", "tf32", "bf16"):
        set_head_matmul(mode, dev)
        model.lm_head_weight = model.lm_head_weight.to(head_dtype(mode, dev))
        with torch.no_grad(), autocast(dev):
            batch_loss(model, batch, LossConfig(head_matmul=mode), model)  # warm
            sync(dev)
            t = time.perf_counter()
            value = float(batch_loss(model, batch, LossConfig(head_matmul=mode), model).loss)
            sync(dev)
            heads[mode] = {"loss": value, "seconds": time.perf_counter() - t,
                           "head_gb": model.lm_head_weight.numel() * model.lm_head_weight.element_size() / 1e9}
    set_head_matmul("fp32", dev)
    for mode in heads:
        heads[mode]["relative_loss_difference"] = abs(heads[mode]["loss"] - heads["fp32"]["loss"]) / abs(heads["fp32"]["loss"])
    return heads


# --- checkpoint ---------------------------------------------------------------------------------------------


def fingerprint(tensor: torch.Tensor) -> tuple[int, int]:
    """Two sums of a tensor's bits (the second weighted by position): equal for a bit-exact copy,
    different for nearly any change, and cheap on the device next to a 22 GB comparison on the host."""
    flat = tensor.detach().contiguous().view(-1)
    bits = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[flat.element_size()]).long()
    weights = torch.arange(1, bits.numel() + 1, device=bits.device) % 1_000_003
    return int(bits.sum()), int((bits * weights).sum())


def state_fingerprints(model, optimizer) -> dict:
    found = {f"w:{name}": fingerprint(p) for name, p in model.named_parameters()}
    for index, p in enumerate(model.parameters()):
        for key, value in optimizer.state[p].items():
            found[f"o:{index}:{key}"] = fingerprint(value.float() if value.dim() == 0 else value)
    return found


def part_checkpoint(out: Path):
    """A production-size checkpoint saved and resumed bit for bit (docs/gpu.md)."""
    s, dev = sizes(), device()
    root = out / "checkpoint-run"
    shutil.rmtree(root, ignore_errors=True)
    try:
        model = build_drafter(s, dev)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=dev.type == "cuda")
        params = sum(p.numel() for p in model.parameters())
        free = shutil.disk_usage(out).free
        if free < 1.3 * 12 * params:  # fp32 weights and two AdamW moments
            raise RuntimeError(f"{free / 1e9:.1f} GB free at {out}, a {12 * params / 1e9:.1f} GB checkpoint needs more")
        batches = [synthetic_batch(s.batch_tokens // s.seq_len, s.seq_len, s.vocab, len(s.tapped), s.hidden, s.top_k,
                                   s.num_anchors, seed=seed).to(dev) for seed in (0, 1)]
        one_step(model, optimizer, batches[0], dev)
        saved = state_fingerprints(model, optimizer)
        t = time.perf_counter()
        path = save(root, model, optimizer)
        save_s = time.perf_counter() - t
        uninterrupted = one_step(model, optimizer, batches[1], dev)
        del model, optimizer
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        fresh = build_drafter(s, dev, seed=1)  # other weights: a load that changed nothing is caught
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=3e-4, fused=dev.type == "cuda")
        t = time.perf_counter()
        load(path, fresh, fresh_optimizer, dev)
        load_s = time.perf_counter() - t
        restored = state_fingerprints(fresh, fresh_optimizer)
        resumed = one_step(fresh, fresh_optimizer, batches[1], dev)
        gigabytes = sum(f.stat().st_size for f in path.iterdir()) / 1e9
    finally:
        shutil.rmtree(root, ignore_errors=True)
    differ = [k for k in saved if restored.get(k) != saved[k]]
    if differ or len(restored) != len(saved):
        raise RuntimeError(f"{len(differ)} of {len(saved)} tensors not restored bit for bit (first {differ[:3]}), "
                           f"{len(restored)} restored")
    if resumed != uninterrupted:
        raise RuntimeError(f"the resumed step's loss {resumed!r} differs from the uninterrupted one's {uninterrupted!r}")
    return (f"{params:,} parameters, {gigabytes:.1f} GB saved in {save_s:.1f} s ({gigabytes / save_s:.2f} GB/s), "
            f"loaded in {load_s:.1f} s; {len(saved)} tensors bit for bit, next loss equal"), \
        {"parameters": params, "gigabytes": gigabytes, "save_s": save_s, "load_s": load_s, "loss": resumed}


def one_step(model, optimizer, batch, dev: torch.device) -> float:
    result = micro_step(model, model, batch, TrainConfig(cache="", out=""), DistInfo(), dev, autocast(dev))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(dev)
    return float(result.loss.detach())


def save(root: Path, model, optimizer) -> Path:
    """What trainer.save_checkpoint writes for one unwrapped process."""
    from dflash_train.training.checkpoint import CheckpointManager, full_model_state, full_optimizer_state, trainer_state

    state = trainer_state(1, full_optimizer_state(model, optimizer), {}, {}, model.cfg.to_hf_config())
    return CheckpointManager(root / "checkpoints").save(1, full_model_state(model), state, {})


def load(path: Path, model, optimizer, dev: torch.device) -> None:
    """What a resume does with the weights and the optimizer (resuming.restore_checkpoint)."""
    from dflash_train.training.checkpoint import CheckpointManager, load_full_state

    state = CheckpointManager.load(path)
    load_full_state(model, optimizer, state["model"], state["trainer"]["optimizer"])
    sync(dev)
