"""The GPU check's parts that run the dflash commands (benchmarks/gpu_check.py): `capture`, `ddp`,
`eval`, `walks`, and the extras `dspark` and `bench`. Each returns (summary, details) and raises on
failure; capture's bf16 cache is what the others train and evaluate on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from gpu_check_common import BF16_CACHE, HERE, PROMPTS, ROOT, RUN, TEACHER, cli, corpus, device, on_cpu, vllm_python

LAYERS = (0, 1)
CAPTURE_BOUNDS = {"bf16": (0.03, 0.1), "fp32": (2e-3, 2e-3)}
"""Per build dtype: the largest tapped layer's relative norm (bf16 rounding is ~0.003 a layer) and
top-1 log-prob difference allowed against the direct fp32 forward."""


def part_capture(out: Path):
    """The transformers engine's device builds against a direct transformers forward (docs/gpu.md)."""
    from dflash_cache import open_cache

    data, dev = corpus(out, 32 if on_cpu() else 128), str(device())
    records, checks = {}, {}
    for name, dtype in (("bf16", "bfloat16"), ("fp32", "float32")):
        url = str(out / ("cache-dev-" + name))
        cli("cache", "build", "--teacher", str(TEACHER), "--data", str(data), "--out", url, "--layers",
            ",".join(map(str, LAYERS)), "--top-k", "16", "--dtype", dtype, "--device", dev, "--overwrite",
            "--cross-check", "2")
        cache = open_cache(url)
        checks[name] = cache.manifest["last_run"].get("cross_check", {})
        records[name] = list(cache.sequences())[:8]
    reference = direct_forward([r.input_ids for r in records["fp32"]], device(), 16)
    worst = {name: compare(records[name], reference) for name in records}
    for name, (hidden_bound, logprob_bound) in CAPTURE_BOUNDS.items():
        if worst[name]["hidden"] > hidden_bound or worst[name]["top1_logprob"] > logprob_bound:
            raise RuntimeError(f"the {name} device build differs from the direct fp32 forward: {worst}")
    return (f"vs a direct fp32 forward: bf16 build layer rel. norm {worst['bf16']['hidden']:.1e}, top-1 log-prob "
            f"{worst['bf16']['top1_logprob']:.1e}; fp32 build {worst['fp32']['hidden']:.1e}, "
            f"{worst['fp32']['top1_logprob']:.1e}; --cross-check (bf16) "
            f"{max(checks['bf16'].get('hidden_relative', {'-': 0}).values()):.1e}"), {"direct": worst, "cross_check": checks}


def direct_forward(sequences: list[np.ndarray], dev: torch.device, top_k: int) -> list[dict]:
    """The shipped teacher in fp32, one unpadded sequence at a time, read from transformers'
    `hidden_states` (index i + 1 is decoder layer i's output) instead of the build's hooks."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(TEACHER), dtype=torch.float32).to(dev).eval()
    found = []
    with torch.inference_mode():
        for ids in sequences:
            result = model(torch.as_tensor(ids, dtype=torch.long, device=dev)[None], output_hidden_states=True)
            hidden = torch.stack([result.hidden_states[i + 1][0] for i in LAYERS], dim=1)
            top = torch.log_softmax(result.logits[0].float(), dim=-1).topk(top_k)
            found.append({"hidden": hidden.cpu().numpy(), "ids": top.indices.cpu().numpy(),
                          "logprobs": top.values.cpu().numpy()})
    return found


def compare(records, reference: list[dict]) -> dict:
    """The largest per-layer relative norm of the built states and the largest top-1 log-prob
    difference where both name the same top-1 token."""
    from dflash_build.cross_check import sequence_differences

    hidden = logprob = 0.0
    agree = total = 0
    for record, ref in zip(records, reference):
        layers, _ = sequence_differences(record.hidden, record.topk_logprobs, ref["hidden"], ref["logprobs"])
        hidden = max(hidden, *layers)
        same = record.topk_ids[:, 0] == ref["ids"][:, 0]
        agree, total = agree + int(same.sum()), total + len(same)
        logprob = max(logprob, float(np.abs(record.topk_logprobs[same, 0] - ref["logprobs"][same, 0]).max()))
    return {"hidden": hidden, "top1_logprob": logprob, "top1_agreement": agree / total}


def part_ddp(out: Path):
    """DDP (its bf16 communication hook) and FSDP2 (bf16 reduce) under torchrun in a real process
    group (NCCL on CUDA) against the unwrapped run: two ranks when two GPUs are visible, else one
    rank made a group of one (--wrap-single-rank; one process otherwise trains unwrapped and would
    test nothing distributed). Held-out evaluation under the wrapper, checkpoint and export (the
    state-dict gathers) included. The weights must differ from the unwrapped run's by bf16
    rounding: more than 0 (the wrapper and its bf16 reduction ran) and less than 1e-2."""
    import safetensors.torch

    cache, dev = str(out / BF16_CACHE), str(device())
    ranks = 2 if not on_cpu() and torch.cuda.device_count() >= 2 else 1
    args = ["--steps", "2", "--save-every", "2", "--device", dev, "--seed", "1", "--eval-sequences", "4",
            "--data-partitions", str(ranks), *RUN]
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


def evaluate(out: Path, checkpoint: Path, report: Path, title: str, env: dict | None = None) -> tuple[dict, str]:
    """`dflash-train eval` of a drafter on the device, the teacher in fp32 so that decoding must
    equal it token for token (bf16 verify and decode forwards round apart at near ties); with a
    vLLM python, `--engine both`. The report, and why vLLM did not serve ("" when it did)."""
    served = vllm_python()
    cli("train", "eval", "--checkpoint", str(checkpoint), "--cache", str(out / BF16_CACHE), "--teacher", str(TEACHER),
        "--prompts", str(PROMPTS), "--max-prompts", "1" if on_cpu() else "4", "--max-new-tokens", "16" if on_cpu() else "64",
        "--max-sequences", "8" if on_cpu() else "32", "--device", str(device()), "--teacher-dtype", "float32",
        "--heldout-fraction", "0.05", "--out", str(report), "--quiet", *(["--engine", "both"] if served else []), env=env)
    values = json.loads(report.read_text())
    if not values["decoding"]["matched_teacher"]:
        raise RuntimeError(f"greedy {title} decoding in fp32 did not reproduce the teacher's output: "
                           f"{json.dumps(values.get('exactness', {}))[:200]}")
    if values.get("vllm") and not values["vllm"].get("matched_teacher"):
        raise RuntimeError(f"vLLM with the {title} drafter did not reproduce vLLM's teacher alone")
    why_not = "" if served else ("a CPU dry run" if on_cpu() else "no DFLASH_VLLM_PYTHON")
    return values, why_not


def part_eval(out: Path):
    """dflash-train eval on the device of the ddp part's unwrapped run (trained here if absent)."""
    run = out / "plain"
    if not (run / "drafter" / "model.safetensors").exists():
        cli("train", "run", "--cache", str(out / BF16_CACHE), "--out", str(run), "--steps", "2", "--save-every", "2",
            "--device", str(device()), "--eval-sequences", "0", *RUN)
    values, why_not = evaluate(out, run / "drafter", out / "eval-plain.json", "DFlash")
    served = values.get("vllm", {})
    return (f"offline tau {values['offline']['tau']:.2f}, replay {values['greedy_replay']['accepted_length']:.2f}, fp32 "
            f"greedy decode = teacher, accepted {values['decoding']['accepted_length']:.2f}"
            + (f", vLLM accepted {served['accepted_length']:.2f}" if served else f", vLLM not run ({why_not})")), \
        {"tau": values["offline"]["tau"], "accepted_length": values["decoding"]["accepted_length"], "vllm": served}


WALKS = {"dflash2": ("DFlash2", ["--model-kind", "dflash2", "--selector-rank", "64"]),
         "lilicorr": ("LiLiCorr", ["--model-kind", "lilicorr", "--lilicorr-conv"])}


def part_walks(out: Path):
    """DFlash2 and LiLiCorr + conv trained on the device and decoded in fp32; served by vLLM's V2
    runner (VLLM_USE_V2_MODEL_RUNNER=1) only with a vLLM python, which these machines lack."""
    steps, results, notes = "4", {}, []
    for name, (title, kind) in WALKS.items():
        run = out / name
        cli("train", "run", "--cache", str(out / BF16_CACHE), "--out", str(run), "--steps", steps, "--save-every", steps,
            "--device", str(device()), "--eval-sequences", "0", *kind, *RUN)
        values, why_not = evaluate(out, run / "drafter", out / f"{name}-eval.json", title,
                                   env={"VLLM_USE_V2_MODEL_RUNNER": "1"})
        served = values.get("vllm", {})
        results[name] = {"accepted_length": values["decoding"]["accepted_length"], "vllm": served}
        notes.append(f"{title} accepted {values['decoding']['accepted_length']:.2f}"
                     + (f" (vLLM V2 {served.get('accepted_length', 0):.2f})" if served else ""))
    why_not = "" if vllm_python() else f"; vLLM V2 not run ({'a CPU dry run' if on_cpu() else 'no DFLASH_VLLM_PYTHON'})"
    return f"{steps} steps each, fp32 greedy walks = teacher: {', '.join(notes)}{why_not}", results


def part_dspark(out: Path):
    """DSpark on the device: train with a resume (flex attention, bf16 autocast, the heads inside
    the forward), greedy semi-autoregressive decoding = teacher in fp32, and vLLM's dspark method
    (GPU runner only) on the export when a vLLM python is given (DFLASH_VLLM_PYTHON)."""
    cache, run = str(out / BF16_CACHE), out / "dspark"
    dev, steps = str(device()), 4 if on_cpu() else 20
    half = str(steps // 2)
    kind = ["--model-kind", "dspark", "--markov-rank", "64", "--eval-sequences", "16"]
    cli("train", "run", "--cache", cache, "--out", str(run), "--steps", half, "--save-every", half, "--device", dev,
        *kind, *RUN)
    cli("train", "run", "--cache", cache, "--out", str(run), "--steps", str(steps), "--save-every", half, "--device", dev,
        "--resume", *kind, *RUN)
    values, why_not = evaluate(out, run / "drafter", out / "dspark-eval.json", "DSpark")
    accepted, served = values["decoding"]["accepted_length"], values.get("vllm", {})
    return (f"{steps} steps with a resume, DSpark greedy decode = teacher, accepted {accepted:.2f}"
            + (f", vLLM dspark accepted {served.get('accepted_length', 0):.2f}" if served else f", vLLM not run ({why_not})")), \
        {"accepted_length": accepted, "vllm": served}


def part_bench(out: Path):
    """bench_gpu.py (production sizes, its own budget) with its output kept beside the check's."""
    import os

    limit = float(os.environ.get("GPU_CHECK_BENCH_S", "120"))
    args = ["--tiny", "--device", "cpu"] if on_cpu() else ["--limit-s", str(max(30.0, limit - 30))]
    done = subprocess.run([sys.executable, str(HERE / "bench_gpu.py"), *args, "--tmp", str(out / "bench-tmp")],
                          capture_output=True, text=True, cwd=ROOT)
    (out / "bench_gpu.txt").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise RuntimeError(f"bench_gpu.py failed: {done.stderr.strip().splitlines()[-1:]}")
    return f"bench_gpu.py: see {out / 'bench_gpu.txt'}", {}
