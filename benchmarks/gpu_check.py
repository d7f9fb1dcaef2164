"""The parts of benchmarks/gpu_check.sh: every CUDA path of the toolkit, one part per process.

    python benchmarks/gpu_check.py PART --out DIR     # one part; writes DIR/PART.json
    python benchmarks/gpu_check.py table --out DIR    # the table of every part's result

GPU_CHECK_DEVICE=cpu runs the same parts on the CPU at tiny sizes (the test suite's dry run), so the
script cannot rot on machines without a GPU. A part that raises records its error and the others
still run; the shell script gives each part its own time limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing
sys.path.insert(0, str(HERE))

from bench_gpu import PRODUCTION, TINY, drafter_config, peak_memory, sync  # noqa: E402
from bench_packed import plan_lengths, sharegpt_lengths  # noqa: E402
from bench_trainer import synthetic_batch, synthetic_sequences  # noqa: E402

from dflash_train.settings.loss_config import LossConfig  # noqa: E402
from dflash_train.settings.noise_config import NoiseConfig  # noqa: E402
from dflash_train.settings.train_config import TrainConfig  # noqa: E402
from dflash_train.training.distributed import DistInfo  # noqa: E402
from dflash_train.training.model import DFlashDrafter  # noqa: E402
from dflash_train.training.noise import add_noise_  # noqa: E402
from dflash_train.training.objectives import set_head_matmul  # noqa: E402
from dflash_train.training.train_step import micro_step  # noqa: E402

PARTS = ("env", "noise", "step", "flex", "packed", "build", "loader", "train", "dspark", "dflash2", "lilicorr", "ddp", "eval", "bench",
         "drafter", "loader_width", "teacher_layers")
CHECK = ("env", "drafter", "loader_width", "build", "loader", "ddp", "eval", "teacher_layers", "dflash2", "lilicorr")
"""The parts gpu_check.sh runs, re-cut for the first 10 minutes on one H200 (issue 34): (1) the
drafter step at production shape, (3) the loader at production width, (4) the smoke parts; the
others stay callable one by one (python benchmarks/gpu_check.py PART --out DIR)."""
TEACHER = ROOT / "examples" / "teacher"
CORPUS = ROOT / "examples" / "data" / "chat.jsonl"
PROMPTS = ROOT / "examples" / "data" / "heldout_prompts.jsonl"


def device() -> torch.device:
    return torch.device(os.environ.get("GPU_CHECK_DEVICE") or "cuda")


def on_cpu() -> bool:
    return device().type == "cpu"


def sizes():
    return TINY if on_cpu() else PRODUCTION


def cli(*args: str, env: dict | None = None, torchrun: int = 0) -> str:
    """A dflash command from this checkout (no install needed), under torchrun with `torchrun`
    processes when given; its output, or an error with its tail."""
    module = "cli.cache" if args[0] == "cache" else "cli.train"
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(torchrun), "-m"]
                if torchrun else [sys.executable, "-m"])
    full_env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
                "PYTHONPATH": str(ROOT), **(env or {})}
    done = subprocess.run([*launcher, module, *args[1:]], cwd=ROOT, env=full_env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args[:2])} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return done.stdout


# --- parts: each returns (summary, details) and raises on failure -------------------------------------------


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
    return f"{name}, torch {torch.__version__}, transformers {transformers.__version__}", {}


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


def _drafter(s, dev, backend="sdpa"):
    cfg = drafter_config(s)
    torch.manual_seed(0)
    with torch.device(dev):
        embed = (torch.randn(s.vocab, s.hidden) * 0.02).bfloat16()
        head = torch.randn(s.vocab, s.hidden) * 0.02
    return DFlashDrafter.build(cfg, embed, head, dev, backend)


def part_step(out: Path):
    """A production-size bf16 training step: finite, the loss falls on a repeated batch, its peak
    memory and tokens/s; then the TF32 LM head against fp32 on the same batch."""
    s, dev = sizes(), device()
    t0 = time.perf_counter()
    model = _drafter(s, dev)
    build_s = time.perf_counter() - t0
    train_cfg = TrainConfig(cache="", out="")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=dev.type == "cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    batch = synthetic_batch(s.batch_tokens // s.seq_len, s.seq_len, s.vocab, len(s.tapped), s.hidden, s.top_k,
                            s.num_anchors).to(dev)
    losses, times = [], []
    for _ in range(8):
        t = time.perf_counter()
        result = micro_step(model, model, batch, train_cfg, DistInfo(), dev, autocast)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(dev)
        times.append(time.perf_counter() - t)
        losses.append(float(result.loss))
    if not all(map(lambda v: v == v and abs(v) < float("inf"), losses)) or not losses[-1] < losses[0]:
        raise RuntimeError(f"losses {losses} are not finite or do not fall")
    step_s = min(times[2:])
    peak = peak_memory(dev)
    model.eval()
    head = {}
    for mode in ("fp32", "tf32"):
        set_head_matmul(mode, dev)
        with torch.no_grad(), autocast:
            t = time.perf_counter()
            from dflash_train.training.batch_objective import batch_loss
            value = batch_loss(model, batch, LossConfig(), model)
            sync(dev)
            head[mode] = (float(value.loss), time.perf_counter() - t)
    set_head_matmul("fp32", dev)
    tf32_error = abs(head["tf32"][0] - head["fp32"][0]) / abs(head["fp32"][0])
    details = {"losses": losses, "step_s": step_s, "build_s": build_s, "peak": peak,
               "tokens_per_s": batch.num_tokens / step_s, "tf32_relative_loss_error": tf32_error,
               "tf32_eval_speedup": head["fp32"][1] / head["tf32"][1]}
    return (f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, {step_s:.3f} s/step, {batch.num_tokens / step_s:,.0f} tok/s, "
            f"peak {peak}, built in {build_s:.1f} s; tf32 head loss rel. err {tf32_error:.1e}"), details


def part_flex(out: Path):
    """flex_attention against SDPA, forward and backward, at head_dim 256 and GQA 24/4 (CPU: forward only)."""
    s, dev = sizes(), device()
    s = s.__class__(**{**s.__dict__, "drafter_layers": 1, "vocab": min(s.vocab, 4096)})
    results = {}
    hidden = torch.randn(2, 512 if dev.type == "cuda" else 64, len(s.tapped), s.hidden, device=dev)
    ids = torch.randint(0, s.vocab - 1, hidden.shape[:2], device=dev)
    anchors = torch.tensor([[3, 40, 17, 60], [9, 25, -1, 50]], device=dev)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    for backend in ("sdpa", "flex"):
        model = _drafter(s, dev, backend)
        grad = dev.type == "cuda"
        with torch.set_grad_enabled(grad), autocast:
            states = model(hidden, ids, anchors)
        grads = None
        if grad:
            states.float().square().mean().backward()
            grads = torch.cat([p.grad.flatten().float() for p in model.parameters()])
        results[backend] = (states.detach().float(), grads)
    forward = float((results["flex"][0] - results["sdpa"][0]).abs().max())
    scale = float(results["sdpa"][0].abs().max())
    backward = None
    if results["sdpa"][1] is not None:
        backward = float((results["flex"][1] - results["sdpa"][1]).norm() / results["sdpa"][1].norm())
    if forward > 0.05 * scale or (backward is not None and backward > 0.05):
        raise RuntimeError(f"flex differs from sdpa: forward max {forward:.3e} of {scale:.3e}, backward rel {backward}")
    return f"forward max diff {forward:.1e} (of {scale:.1e}), backward rel diff {backward if backward is None else f'{backward:.1e}'}", {
        "forward": forward, "backward": backward}


def part_packed(out: Path):
    """data.layout packed against padded at production width (issue 27): a default-size batch of the
    ShareGPT-like length spread (bench_packed.py) in both layouts, the same bf16 loss, and the
    step's tokens/s and peak memory in each (CPU dry run: tiny sizes, the loss only checked)."""
    s, dev = sizes(), device()
    lengths = plan_lengths(sharegpt_lengths(4000, seed=1), s.batch_tokens)
    batch_lengths = max(lengths, key=len)  # the batch of most sequences: the most padding to skip
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    train_cfg, results = TrainConfig(cache="", out=""), {}
    for layout in ("padded", "packed"):
        model = _drafter(s, dev, "flex" if dev.type == "cuda" else "sdpa")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=dev.type == "cuda")
        batch = synthetic_sequences(batch_lengths, s.vocab, len(s.tapped), s.hidden, s.top_k, s.num_anchors,
                                    layout=layout).to(dev)
        losses, times = [], []
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        for _ in range(5):
            t = time.perf_counter()
            result = micro_step(model, model, batch, train_cfg, DistInfo(), dev, autocast)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync(dev)
            times.append(time.perf_counter() - t)
            losses.append(float(result.loss.detach()))
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


def _corpus(out: Path, rows: int) -> Path:
    path = out / "corpus.jsonl"
    with open(CORPUS) as f, open(path, "w") as g:
        for _, line in zip(range(rows), f):
            g.write(line)
    return path


def part_build(out: Path):
    """A cache built on the device (bf16 and fp32) equals the CPU build within rounding."""
    import numpy as np

    from dflash_cache import open_cache

    data = _corpus(out, 32 if on_cpu() else 256)
    dev = str(device())
    urls = {}
    for name, where, dtype in (("cpu-fp32", "cpu", "float32"), ("dev-fp32", dev, "float32"), ("dev-bf16", dev, "bfloat16")):
        urls[name] = out / f"cache-{name}"
        cli("cache", "build", "--teacher", str(TEACHER), "--data", str(data), "--out", str(urls[name]), "--layers", "0,1",
            "--top-k", "16", "--dtype", dtype, "--device", where, "--overwrite")
    reference = {r.id: r for r in open_cache(str(urls["cpu-fp32"])).sequences()}
    worst = {}
    for name in ("dev-fp32", "dev-bf16"):
        hidden = logprob = 0.0
        for record in open_cache(str(urls[name])).sequences():
            ref = reference[record.id]
            scale = np.abs(np.asarray(ref.hidden, np.float32)).max()
            hidden = max(hidden, float(np.abs(np.asarray(record.hidden, np.float32) - np.asarray(ref.hidden, np.float32)).max() / scale))
            same = record.topk_ids[:, 0] == ref.topk_ids[:, 0]
            logprob = max(logprob, float(np.abs(record.topk_logprobs[same, 0] - ref.topk_logprobs[same, 0]).max()))
        worst[name] = {"hidden_rel": hidden, "top1_logprob": logprob}
    if worst["dev-fp32"]["hidden_rel"] > 1e-3 or worst["dev-bf16"]["hidden_rel"] > 2 ** -5 or worst["dev-bf16"]["top1_logprob"] > 0.1:
        raise RuntimeError(f"device caches differ from the CPU cache: {worst}")
    return (f"fp32 hidden rel {worst['dev-fp32']['hidden_rel']:.1e}, bf16 hidden rel {worst['dev-bf16']['hidden_rel']:.1e}, "
            f"bf16 top-1 log-prob {worst['dev-bf16']['top1_logprob']:.1e}"), worst


def part_loader(out: Path):
    """The pinned loader on the built cache: batches straight into page-locked memory, GB/s."""
    from dflash_cache import open_cache
    from dflash_train.settings.data_config import DataConfig
    from dflash_train.training.data import LoaderState, train_loader

    url = str(out / "cache-dev-bf16")
    state = LoaderState(manifest_fingerprint=open_cache(url).fingerprint)
    dev = device()
    batches = iter(train_loader(url, None, DataConfig(batch_tokens=4096, anchors="random", heldout_fraction=0.05), state,
                                pin_memory=dev.type == "cuda"))
    first = next(batches)
    pinned = first.hidden.is_pinned() if dev.type == "cuda" else None
    t, moved, count = time.perf_counter(), 0, 0
    while count < 20:
        batch = next(batches)
        batch.to(dev)
        moved += batch.hidden.numel() * batch.hidden.element_size()
        count += 1
    sync(dev)
    rate = moved / (time.perf_counter() - t) / 1e9
    if dev.type == "cuda" and not pinned:
        raise RuntimeError("the loader's hidden states are not in pinned memory")
    return f"{rate:.2f} GB/s of hidden states to {dev.type}, pinned {pinned}", {"gb_per_s": rate, "pinned": pinned}


RUN = ["--num-layers", "1", "--block-size", "8", "--batch-tokens", "2048", "--heldout-fraction", "0.05",
       "--log-every", "5", "--eval-sequences", "16", "--quiet"]


def part_train(out: Path):
    """run, resume, export with the GPU hidden, eval and greedy speculative decoding on the device."""
    cache, run = str(out / "cache-dev-bf16"), out / "run"
    dev, steps = str(device()), 4 if on_cpu() else 20
    half = str(steps // 2)
    cli("train", "run", "--cache", cache, "--out", str(run), "--steps", half, "--save-every", half, "--device", dev, *RUN)
    cli("train", "run", "--cache", cache, "--out", str(run), "--steps", str(steps), "--save-every", half, "--device", dev,
        "--resume", *RUN)
    cli("train", "export", str(run / "checkpoints" / f"step-{steps:06d}"), str(out / "exported"),
        env={"CUDA_VISIBLE_DEVICES": ""})
    report = out / "eval.json"
    cli("train", "eval", "--checkpoint", str(run / "drafter"), "--cache", cache, "--teacher", str(TEACHER),
        "--prompts", str(PROMPTS), "--max-prompts", "2" if on_cpu() else "8", "--max-new-tokens", "32" if on_cpu() else "96", "--device", dev,
        "--heldout-fraction", "0.05", "--out", str(report), "--quiet")
    values = json.loads(report.read_text())
    decoding = values["decoding"]
    if not decoding["matched_teacher"]:
        raise RuntimeError("greedy speculative decoding did not reproduce the teacher's output")
    accepted = decoding["accepted_length"]
    return (f"{steps} steps with a resume at {steps // 2}, exported on CPU, greedy spec decode = teacher, accepted "
            f"{accepted:.2f}, x{decoding['speedup']:.2f} tokens/s"), {"accepted_length": accepted}


def part_dspark(out: Path):
    """DSpark on the device: train with a resume (flex attention, bf16 autocast, the heads inside
    the forward), greedy semi-autoregressive decoding = teacher, and vLLM's dspark method (GPU
    runner only) on the export when a vLLM python is given (DFLASH_VLLM_PYTHON)."""
    cache, run = str(out / "cache-dev-bf16"), out / "dspark"
    dev, steps = str(device()), 4 if on_cpu() else 20
    half = str(steps // 2)
    kind = ["--model-kind", "dspark", "--markov-rank", "64"]
    cli("train", "run", "--cache", cache, "--out", str(run), "--steps", half, "--save-every", half, "--device", dev,
        *kind, *RUN)
    cli("train", "run", "--cache", cache, "--out", str(run), "--steps", str(steps), "--save-every", half, "--device", dev,
        "--resume", *kind, *RUN)
    report = out / "dspark-eval.json"
    engine = ["--engine", "both"] if os.environ.get("DFLASH_VLLM_PYTHON") and not on_cpu() else []
    cli("train", "eval", "--checkpoint", str(run / "drafter"), "--cache", cache, "--teacher", str(TEACHER),
        "--prompts", str(PROMPTS), "--max-prompts", "2" if on_cpu() else "8", "--max-new-tokens", "32" if on_cpu() else "96",
        "--device", dev, "--heldout-fraction", "0.05", "--out", str(report), "--quiet", *engine)
    values = json.loads(report.read_text())
    if not values["decoding"]["matched_teacher"]:
        raise RuntimeError("greedy DSpark decoding did not reproduce the teacher's output")
    served = values.get("vllm", {})
    if served and not served.get("matched_teacher"):
        raise RuntimeError("vLLM's dspark method did not reproduce the teacher's output")
    accepted = values["decoding"]["accepted_length"]
    return (f"{steps} steps with a resume, DSpark greedy decode = teacher, accepted {accepted:.2f}"
            + (f", vLLM dspark accepted {served.get('accepted_length', 0):.2f}" if served else "")), \
        {"accepted_length": accepted, "vllm": served}


def part_dflash2(out: Path):
    """DFlash2 on the device: train with a resume (the convolutions and the selector's loss under
    bf16 autocast), greedy decoding with the selector's walk = teacher, and the export served by
    vLLM's DFlash2 speculator, which only its V2 model runner has (VLLM_USE_V2_MODEL_RUNNER=1, GPU),
    when a vLLM python is given (DFLASH_VLLM_PYTHON); otherwise the summary says why it was not."""
    return _candidate_walk(out, "dflash2", "DFlash2", ["--model-kind", "dflash2", "--selector-rank", "64"])


def part_lilicorr(out: Path):
    """LiLiCorr + conv on the device, as part_dflash2 checks DFlash2: the correlator's lattice under
    bf16 autocast, its walk in greedy decoding = teacher, and vLLM's LiLiCorr speculator (V2 only)."""
    return _candidate_walk(out, "lilicorr", "LiLiCorr", ["--model-kind", "lilicorr", "--lilicorr-conv"])


def _candidate_walk(out: Path, name: str, title: str, kind: list[str]):
    """A candidate-walk drafter (DFlash2, LiLiCorr) trained with a resume, decoded by us and by vLLM's V2 runner."""
    cache, run = str(out / "cache-dev-bf16"), out / name
    dev, steps = str(device()), 4 if on_cpu() else 20
    half = str(steps // 2)
    cli("train", "run", "--cache", cache, "--out", str(run), "--steps", half, "--save-every", half, "--device", dev,
        *kind, *RUN)
    cli("train", "run", "--cache", cache, "--out", str(run), "--steps", str(steps), "--save-every", half, "--device", dev,
        "--resume", *kind, *RUN)
    if on_cpu():
        why_not = "not served: a CPU dry run (vLLM's V1 runner, the CPU one, refuses candidate-head drafts)"
    elif not os.environ.get("DFLASH_VLLM_PYTHON"):
        why_not = "not served: no vLLM here (set DFLASH_VLLM_PYTHON)"
    else:
        why_not = ""
    report = out / f"{name}-eval.json"
    cli("train", "eval", "--checkpoint", str(run / "drafter"), "--cache", cache, "--teacher", str(TEACHER),
        "--prompts", str(PROMPTS), "--max-prompts", "2" if on_cpu() else "8", "--max-new-tokens", "32" if on_cpu() else "96",
        "--device", dev, "--heldout-fraction", "0.05", "--out", str(report), "--quiet",
        *([] if why_not else ["--engine", "both"]), env={"VLLM_USE_V2_MODEL_RUNNER": "1"})
    values = json.loads(report.read_text())
    if not values["decoding"]["matched_teacher"]:
        raise RuntimeError(f"greedy {title} decoding did not reproduce the teacher's output")
    served = values.get("vllm", {})
    if served and not served.get("matched_teacher"):
        raise RuntimeError(f"vLLM's {title} speculator (V2 runner) did not reproduce the teacher's output")
    accepted = values["decoding"]["accepted_length"]
    return (f"{steps} steps with a resume, {title} greedy decode = teacher, accepted {accepted:.2f}, vLLM V2 "
            + (f"accepted {served.get('accepted_length', 0):.2f}" if served else why_not)), \
        {"accepted_length": accepted, "vllm": served, "vllm_not_served": why_not}


def part_ddp(out: Path):
    """DDP (its bf16 communication hook) and FSDP2 (bf16 reduce) under torchrun in a real process
    group (NCCL on CUDA) against the unwrapped run: two ranks when two GPUs are visible, else one
    rank made a group of one (--wrap-single-rank; one process otherwise trains unwrapped and would
    test nothing distributed). Held-out evaluation under the wrapper, checkpoint and export (the
    state-dict gathers) included. The weights must differ from the unwrapped run's by bf16
    rounding: more than 0 (the wrapper and its bf16 reduction ran) and less than 1e-2."""
    import safetensors.torch

    cache, dev = str(out / "cache-dev-bf16"), str(device())
    ranks = 2 if not on_cpu() and torch.cuda.device_count() >= 2 else 1
    args = ["--steps", "2", "--save-every", "2", "--device", dev, "--seed", "1", "--eval-sequences", "4",
            "--data-partitions", str(ranks), *[a for a in RUN if a not in ("--eval-sequences", "16")]]
    cli("train", "run", "--cache", cache, "--out", str(out / "plain"), *args)
    weights = {"plain": safetensors.torch.load_file(str(out / "plain" / "drafter" / "model.safetensors"))}
    wrapped = ["--grad-reduce-dtype", "bf16", *(["--wrap-single-rank"] if ranks == 1 else [])]
    for strategy in ("ddp", "fsdp"):
        cli("train", "run", "--cache", cache, "--out", str(out / strategy), "--strategy", strategy, *wrapped, *args,
            torchrun=ranks)
        weights[strategy] = safetensors.torch.load_file(str(out / strategy / "drafter" / "model.safetensors"))
    diffs = {s: max(float((weights[s][k].float() - v.float()).abs().max()) for k, v in weights["plain"].items())
             for s in ("ddp", "fsdp")}
    if max(diffs.values()) > 1e-2:
        raise RuntimeError(f"wrapped training differs from unwrapped: {diffs}")
    # FSDP2 keeps fp32 gradients and rounds them to bf16 only in its reduce-scatter, which a group of
    # one skips (it equals the unwrapped run then); DDP's bf16 hook rounds even alone
    rounding = ("ddp", "fsdp") if ranks > 1 else ("ddp",)
    if min(diffs[s] for s in rounding) == 0:
        raise RuntimeError(f"a wrapped run equals the unwrapped one bit for bit, so its bf16 reduction never ran: {diffs}")
    backend = "NCCL" if dev.startswith("cuda") else "gloo"
    return (f"{ranks} rank(s) in a {backend} group: max weight diff vs unwrapped (bf16 reduction) ddp {diffs['ddp']:.1e}, "
            f"fsdp {diffs['fsdp']:.1e}"), {"ranks": ranks, **diffs}


def part_eval(out: Path):
    """dflash-train eval on the device: the offline estimate and the greedy replay from the cache,
    then real greedy speculative decoding of held-out prompts, which must equal the teacher's output;
    with a vLLM python (DFLASH_VLLM_PYTHON, GPU) `--engine both`: vLLM starts after the built-in
    decoder released the teacher and drafter, on the memory that is actually free."""
    cache, run, dev = str(out / "cache-dev-bf16"), out / "plain", str(device())
    if not (run / "drafter" / "model.safetensors").exists():  # the ddp part did not leave its unwrapped run
        cli("train", "run", "--cache", cache, "--out", str(run), "--steps", "2", "--save-every", "2", "--device", dev,
            *[a for a in RUN if a not in ("--eval-sequences", "16")], "--eval-sequences", "0")
    engine = ["--engine", "both"] if os.environ.get("DFLASH_VLLM_PYTHON") and not on_cpu() else []
    report = out / "eval-plain.json"
    cli("train", "eval", "--checkpoint", str(run / "drafter"), "--cache", cache, "--teacher", str(TEACHER),
        "--prompts", str(PROMPTS), "--max-prompts", "1" if on_cpu() else "8", "--max-new-tokens", "16" if on_cpu() else "96",
        "--max-sequences", "8" if on_cpu() else "64", "--device", dev, "--heldout-fraction", "0.05", "--out", str(report),
        "--quiet", *engine)
    values = json.loads(report.read_text())
    if not values["decoding"]["matched_teacher"]:
        raise RuntimeError("greedy speculative decoding did not reproduce the teacher's output")
    served = values.get("vllm", {})
    if served and not served.get("matched_teacher"):
        raise RuntimeError("vLLM with the drafter did not reproduce vLLM's teacher alone")
    tau = values["offline"]["tau"]
    return (f"offline tau {tau:.2f}, replay {values['greedy_replay']['accepted_length']:.2f}, greedy decode = teacher, "
            f"accepted {values['decoding']['accepted_length']:.2f}"
            + (f", vLLM accepted {served['accepted_length']:.2f}" if served else ", vLLM not run (no DFLASH_VLLM_PYTHON)")), \
        {"tau": tau, "accepted_length": values["decoding"]["accepted_length"], "vllm": served}


def part_bench(out: Path):
    limit = float(os.environ.get("GPU_CHECK_BENCH_S", "120"))
    args = ["--tiny", "--device", "cpu"] if on_cpu() else ["--limit-s", str(max(30.0, limit - 30))]
    done = subprocess.run([sys.executable, str(HERE / "bench_gpu.py"), *args, "--tmp", str(out / "bench-tmp")],
                          capture_output=True, text=True, cwd=ROOT)
    (out / "bench_gpu.txt").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise RuntimeError(f"bench_gpu.py failed: {done.stderr.strip().splitlines()[-1:]}")
    return f"bench_gpu.py: see {out / 'bench_gpu.txt'}", {}


def _markdown(header: list[str], rows: list[list]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *["| " + " | ".join(str(v) for v in row) + " |" for row in rows]])


def part_drafter(out: Path):
    """(1) The drafter step at production shape on ~40 packed batches of ShareGPT-like lengths at
    8k and 16k tokens (flex on CUDA): the first step (compile) time, steady tokens/s, dynamo's
    compiled graphs (recompiles), peak memory; then the loss's LM head fp32 / tf32 / bf16 on one
    batch: time and loss difference (CPU dry run: tiny sizes, sdpa, 3 batches of one budget)."""
    import torch._dynamo.utils

    from dflash_train.training.batch_objective import batch_loss
    from dflash_train.training.objectives import head_dtype

    s, dev = sizes(), device()
    count = 3 if on_cpu() else 40
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    train_cfg, rows, details = TrainConfig(cache="", out=""), [], {}
    for budget in ((s.batch_tokens,) if on_cpu() else (8192, 16384)):
        model = _drafter(s, dev, "flex" if dev.type == "cuda" else "sdpa")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=dev.type == "cuda")
        plans = [b for b in plan_lengths(sharegpt_lengths(4000, seed=2), budget) if sum(b) > budget // 2][:count]
        torch._dynamo.utils.counters.clear()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        times, tokens, losses = [], [], []
        for index, lengths in enumerate(plans):
            batch = synthetic_sequences(lengths, s.vocab, len(s.tapped), s.hidden, s.top_k, s.num_anchors, seed=index,
                                        layout="packed").to(dev)
            t = time.perf_counter()
            result = micro_step(model, model, batch, train_cfg, DistInfo(), dev, autocast)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync(dev)
            times.append(time.perf_counter() - t)
            tokens.append(batch.num_tokens)
            losses.append(float(result.loss.detach()))
        if not all(v == v and abs(v) < float("inf") for v in losses):
            raise RuntimeError(f"non-finite losses at {budget} tokens: {losses}")
        warm = 3 if len(times) > 3 else 1  # steady: after the compiles of the first batches
        steady = sum(tokens[warm:]) / sum(times[warm:])
        graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        peak = peak_memory(dev)
        rows.append([f"{budget:,}", len(plans), f"{times[0]:.1f} s", f"{steady:,.0f}", graphs, peak])
        details[str(budget)] = {"first_step_s": times[0], "tokens_per_s": steady, "graphs": graphs, "peak": peak}
        last = batch
        del optimizer
    heads = {}
    model.eval()
    for mode in ("fp32", "tf32", "bf16"):
        set_head_matmul(mode, dev)
        model.lm_head_weight = model.lm_head_weight.to(head_dtype(mode, dev))
        with torch.no_grad(), autocast:
            batch_loss(model, last, LossConfig(head_matmul=mode), model)  # warm
            sync(dev)
            t = time.perf_counter()
            value = float(batch_loss(model, last, LossConfig(head_matmul=mode), model).loss)
            sync(dev)
            heads[mode] = {"loss": value, "seconds": time.perf_counter() - t,
                           "head_gb": model.lm_head_weight.numel() * model.lm_head_weight.element_size() / 1e9}
    set_head_matmul("fp32", dev)
    for mode in heads:
        heads[mode]["relative_loss_difference"] = abs(heads[mode]["loss"] - heads["fp32"]["loss"]) / abs(heads["fp32"]["loss"])
    details["heads"] = heads
    table = (_markdown(["batch tokens", "batches", "first step", "steady tok/s", "graphs compiled", "peak"], rows) + "\n\n"
             + _markdown(["LM head", "loss (eval, one batch)", "rel. diff vs fp32", "seconds", "head GB"],
                         [[m, f"{h['loss']:.5f}", f"{h['relative_loss_difference']:.1e}", f"{h['seconds']:.3f}",
                           f"{h['head_gb']:.2f}"] for m, h in heads.items()]))
    details["table"] = table
    print(table)
    first = details[str((s.batch_tokens if on_cpu() else 8192))]
    return (f"{first['tokens_per_s']:,.0f} tok/s at the smaller budget, first step {first['first_step_s']:.1f} s, "
            f"{first['graphs']} graph(s); bf16 head loss rel. diff {heads['bf16']['relative_loss_difference']:.1e}"), details


def part_loader_width(out: Path):
    """(3) The loader at production width (5 tapped layers x 5,120, bf16) on a synthetic cache:
    the shards' integrity check (checksums of every file) timed alone, against the loader
    streaming batches to the device with its check on (train_loader always checks: each shard is
    hashed on the reading threads before its first sequence is handed out). The loader's rate
    without the check is bounded by the two: checking costs at most loader bytes / checksum rate."""
    import shutil

    from bench_gpu import write_synthetic_cache

    from dflash_cache import open_cache
    from dflash_train.settings.data_config import DataConfig
    from dflash_train.training.data import LoaderState, train_loader

    s, dev = sizes(), device()
    root = out / "width-cache"
    shutil.rmtree(root, ignore_errors=True)
    try:
        url, gigabytes = write_synthetic_cache(s, root)
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
        t, tokens, batches = time.perf_counter(), 0, 0
        for batch in stream:  # one epoch: every shard read, so every shard hashed
            batch.to(dev)
            tokens, batches = tokens + batch.num_tokens, batches + 1
            if batch.state_after["epoch"] > 0:
                break
        sync(dev)
        stream = None
        seconds = time.perf_counter() - t
        rate = tokens / seconds
        details.update(loader_tokens_per_s=rate, loader_gb_per_s=gigabytes / seconds)
        rows = [["checksums alone", "-", "-", f"{gigabytes / hash_s:.2f}"],
                ["loader, check on (one epoch)", batches, f"{rate:,.0f}", f"{gigabytes / seconds:.2f}"]]
        table = (f"cache {gigabytes:.2f} GB, {len(cache.shards)} shard(s)\n\n"
                 + _markdown(["what", "batches", f"tokens/s to {dev.type}", "GB/s"], rows))
        details["table"] = table
        print(table)
        return (f"checksums {gigabytes / hash_s:.2f} GB/s alone; loader {rate:,.0f} tok/s "
                f"({gigabytes / seconds:.2f} GB/s) with the check on"), details
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
        for _ in range(1 if cpu else 4):  # the first is warm-up (kernel compilation, allocator)
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


def run_part(name: str, out: Path) -> dict:
    start = time.perf_counter()
    try:
        summary, details = globals()[f"part_{name}"](out)
        record = {"part": name, "status": "ok", "summary": summary, "details": details}
    except Exception as err:  # a part's failure is its row; the next part still runs
        record = {"part": name, "status": "FAIL", "summary": f"{type(err).__name__}: {err}"[:400],
                  "traceback": traceback.format_exc()[-3000:]}
    record["seconds"] = round(time.perf_counter() - start, 1)
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def table(out: Path) -> str:
    lines = ["| part | status | seconds | result |", "|---|---|---|---|"]
    for name in CHECK:
        path = out / f"{name}.json"
        if not path.exists():
            status = (out / f"{name}.status").read_text().strip() if (out / f"{name}.status").exists() else "not run"
            lines.append(f"| {name} | {status} | - | - |")
            continue
        record = json.loads(path.read_text())
        lines.append(f"| {name} | {record['status']} | {record['seconds']} | {record['summary'].replace('|', '/')} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] != "--out" or argv[0] not in (*PARTS, "table"):
        print(f"usage: gpu_check.py {{{'|'.join(PARTS)}|table}} --out DIR", file=sys.stderr)
        return 2
    out = Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if argv[0] == "table":
        print(table(out))
        return 0
    return 0 if run_part(argv[0], out)["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
