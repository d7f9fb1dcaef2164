"""The GPU check (benchmarks/gpu_check.sh): the CUDA paths a CPU cannot show, in about 6 minutes of
the 15 a lent machine gives a task (start-up and the wheel install take some of the rest; what is
left is a rerun of the parts that failed).

    python benchmarks/gpu_check.py check --out DIR        # every part of CHECK, each in its own process
    python benchmarks/gpu_check.py PART --out DIR         # one part (of CHECK or EXTRA); writes DIR/PART.json
    python benchmarks/gpu_check.py table --out DIR        # the table of the parts' results
    python benchmarks/gpu_check.py parts [--doc FILE]     # CHECK as a table (written into FILE between its markers)

The parts and their budgets are declared once, in CHECK: the driver, docs/gpu.md's table (`make
docs` writes it) and tests/test_gpu_check.py read them. This module imports no torch, so the
driver and `parts` start at once; the parts live in gpu_check_step.py, gpu_check_device.py and
gpu_check_cli.py.

The driver runs each part in its own process group under its own budget (a failure or a hang does
not hide the rest), prints a line per part (status, wall time against budget, the verdict),
rewrites DIR/table.md after each, and stops, recording every part not started, when what is left
of the total is less than the next part's budget: a part cut off by the machine's end records
nothing. Environment:

    GPU_CHECK_DEVICE=cpu      the same parts on the CPU at tiny sizes (the dry run, so the check cannot rot)
    GPU_CHECK_TOTAL_S         the whole check's seconds (default: the selected parts' budgets summed)
    GPU_CHECK_PARTS           a subset of CHECK, e.g. the failed ones to rerun ("capture eval")
    GPU_CHECK_TIME_SCALE      budgets multiplied by this (default 1 on CUDA, 6 on the CPU: 2 shared
                              cores are no GPU)
    DFLASH_VLLM_PYTHON        a vLLM environment's python: eval and walks serve with it too, each
                              with its `vllm_s` more budget (none of the lent machines has vLLM)
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Part:
    name: str
    budget_s: int
    """Its process's limit in seconds on one GPU, start-up included."""
    proves: str
    cannot: str
    """What it does not show, and where that is shown, if anywhere."""
    needs: tuple[str, ...] = ()
    """Parts whose outputs it reads: it is skipped when one of them ran and did not pass."""
    vllm_s: int = 0
    """Budget added when DFLASH_VLLM_PYTHON is set (a vLLM engine starts in it)."""


CHECK = (
    Part("env", 15, "torch, CUDA, NCCL and the carried wheels import; the card, versions and free disk are recorded",
         "nothing about speed or numbers"),
    Part("drafter", 90,
         "the production-shape drafter (5 layers at 5,120, 24/4 heads of 256, vocab 248,320) with sliding layers 0 and 2 "
         "(window 2,048) among full ones trains with compiled flex_attention on 12 packed 8k-token batches anchored as the "
         "recipe anchors (`cover`): first step "
         "(compile), steady tokens/s, graphs compiled, peak memory; one batch's loss and attention gradients under "
         "compiled flex equal SDPA's (the sliding and full block masks through compiled create_block_mask, flex's "
         "backward); the trainer's held-out evaluation (`evaluate_heldout`, the fp32 path) on a production-width cache "
         "after training, with dynamo's recompile limit made an error, so a silent fall-back to eager fails it; the "
         "loss's LM head in fp32, tf32 and bf16 on one batch (time, loss difference)",
         "acceptance (random weights and features); 16k-token budgets and a long run's recompiles; compile under a "
         "DDP or FSDP2 wrapper at this size (the ddp part wraps a tiny drafter)"),
    Part("checkpoint", 50,
         "a production-size checkpoint (the recipe's 1.84B-parameter drafter and its AdamW state, ~22 GB) saved by the "
         "trainer's CheckpointManager (model.safetensors, trainer.pt, fsync, rename) and loaded back (`weights_only`, "
         "`mmap`) into a drafter of other weights: every weight and AdamW moment restored bit for bit and the next "
         "step's loss equal to the uninterrupted run's; save and load seconds and GB/s",
         "8 ranks sharing trainer.pt's pages and FSDP's sharded load (a multi-GPU node); a network filesystem's speed"),
    Part("capture", 35,
         "the shipped teacher's tiny cache built on CUDA by the transformers engine in bf16 (with `--cross-check 2`: "
         "sequences recomputed one at a time, unpadded) and in fp32, against a direct transformers forward of the same "
         "token ids (`output_hidden_states`, no hooks, no batching, no padding): each tapped layer's relative norm and "
         "the top-1 log-prob (the fp32 head's `out_dtype` logits)",
         "vLLM's capture (the connector, the extraction step, the Gated DeltaNet state under the V2 runner, CUDA graphs): "
         "no vLLM on these machines; a hybrid qwen3_5 teacher's capture (the shipped teacher is qwen3); a 27B "
         "teacher's memory"),
    Part("ddp", 55,
         "`dflash-train run --strategy ddp --grad-reduce-dtype bf16` and `--strategy fsdp` under torchrun in an NCCL "
         "group on the rank's GPU (2 ranks when 2 GPUs are visible, else a group of one, `--wrap-single-rank`): DDP's "
         "bf16 hook, `fully_shard` with a bf16 reduce dtype, held-out evaluation under the wrapper, the state-dict "
         "gathers of checkpoint and export; weights within bf16 rounding of the unwrapped run's",
         "with one GPU, NCCL's bf16 reduce-scatter under FSDP2 (torch copies in a group of one) and any collective "
         "between GPUs: 2+ GPUs", needs=("capture",)),
    Part("eval", 25,
         "`dflash-train eval --device cuda --teacher-dtype float32` on the unwrapped run: the offline estimate and greedy "
         "replay on the device, real greedy speculative decoding equal to the teacher's output token for token in fp32 "
         "(in bf16 a near-tie flip is no fault; the report's `exactness` names one)",
         "how often bf16 flips at near ties; eval's memory beside a 27B teacher; vLLM beside the released teacher "
         "(only with DFLASH_VLLM_PYTHON)", needs=("capture",), vllm_s=120),
    Part("walks", 40,
         "DFlash2 (its convolutions and selector) and LiLiCorr + conv (the correlator's lattice) train 4 steps each under "
         "bf16 autocast with compiled flex, and their greedy walks decode in fp32 equal to the teacher",
         "serving them: vLLM's DFlash2 and LiLiCorr speculators exist only in its V2 model runner (GPU, vLLM 0.32); "
         "resume (the checkpoint part, and the CPU tests' bit-exact resume of every kind)", needs=("capture",), vllm_s=180),
    Part("teacher_layers", 25,
         "four full-width qwen3_5 layers (three Gated DeltaNet, one attention; random bf16 weights) on one 8k-token "
         "sequence: ms per layer, tokens/s, and whether flash-linear-attention and causal-conv1d ran or transformers' "
         "torch fallback (the carried wheels hold neither: a fallback is what a bare install gets)",
         "the 64-layer teacher's speed and memory; the kernels' numbers against the fallback's"),
    Part("loader_width", 20,
         "the loader at production width (5 tapped layers x 5,120, bf16) on a 1.7 GB synthetic cache: the shards' "
         "checksums alone against the loader streaming into pinned memory and on to the GPU with its check on",
         "a network store's or a cold page cache's rate; several loader ranks a node"),
)
"""The parts gpu_check.sh runs, in order: the production-size ones first (nothing else shows them)."""
EXTRA = ("noise", "packed", "dspark", "bench")
"""Parts outside the check, run one by one (python benchmarks/gpu_check.py PART --out DIR)."""
MODULES = ("gpu_check_step", "gpu_check_device", "gpu_check_cli")
FAILED = ("FAIL", "TIMEOUT", "CRASH", "not run", "skipped")
DOC_BEGIN, DOC_END = "<!-- gpu_check parts: begin (python benchmarks/gpu_check.py parts --doc docs/gpu.md) -->", \
    "<!-- gpu_check parts: end -->"


def budget_of(part: Part, scale: float, vllm: bool) -> float:
    return (part.budget_s + (part.vllm_s if vllm else 0)) * scale


def time_scale() -> float:
    default = "6" if os.environ.get("GPU_CHECK_DEVICE") == "cpu" else "1"
    return float(os.environ.get("GPU_CHECK_TIME_SCALE") or default)


def selected() -> list[Part]:
    """CHECK, or the subset GPU_CHECK_PARTS names (in CHECK's order); an unknown name is refused."""
    names = (os.environ.get("GPU_CHECK_PARTS") or "").split()
    unknown = [n for n in names if n not in {p.name for p in CHECK}]
    if unknown:
        raise SystemExit(f"GPU_CHECK_PARTS names {unknown}, not parts of the check: {[p.name for p in CHECK]}")
    return [p for p in CHECK if not names or p.name in names]


# --- one part, in this process -------------------------------------------------------------------------------


def part_function(name: str):
    for module in MODULES:
        function = getattr(importlib.import_module(module), f"part_{name}", None)
        if function is not None:
            return function
    raise KeyError(name)


def run_part(name: str, out: Path) -> dict:
    start = time.perf_counter()
    try:
        summary, details = part_function(name)(out)
        record = {"part": name, "status": "ok", "summary": summary, "details": details}
    except Exception as err:  # a part's failure is its row; the next part still runs
        record = {"part": name, "status": "FAIL", "summary": f"{type(err).__name__}: {err}"[:400],
                  "traceback": traceback.format_exc()[-3000:]}
    record["seconds"] = round(time.perf_counter() - start, 1)
    write_record(out, record)
    return record


def write_record(out: Path, record: dict) -> None:
    (out / f"{record['part']}.json").write_text(json.dumps(record, indent=1) + "\n")


def read_record(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


# --- the driver ----------------------------------------------------------------------------------------------


def run_limited(part: Part, out: Path, limit_s: float) -> dict:
    """The part in its own process group, killed with its children (torchrun's ranks) past
    `limit_s`; its record, with the driver's wall time and the budget added."""
    (out / f"{part.name}.json").unlink(missing_ok=True)
    start = time.monotonic()
    with open(out / f"{part.name}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), part.name, "--out", str(out)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            rc = None
    record = read_record(out, part.name)
    if record is None or rc is None:  # a part killed after writing its record still ran past its budget
        record = {"part": part.name, "status": "TIMEOUT" if rc is None else "CRASH", "seconds": None,
                  "summary": f"killed at its budget of {limit_s:.0f} s" if rc is None else f"exit code {rc}, no record"}
    record.update(wall_s=round(time.monotonic() - start, 1), budget_s=round(limit_s))
    write_record(out, record)
    return record


def stop_group(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=grace)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def not_run(out: Path, part: Part, status: str, why: str) -> dict:
    record = {"part": part.name, "status": status, "summary": why, "seconds": None, "wall_s": 0}
    write_record(out, record)
    return record


def check(out: Path, parts: list[Part], total_s: float, scale: float, vllm: bool) -> int:
    """Every part under its budget while the total lasts; the table; 0 when every part passed."""
    start = time.monotonic()
    print(f"gpu check: {len(parts)} part(s), {total_s:.0f} s in all (budgets x{scale:g})", flush=True)
    status: dict[str, str] = {}
    for index, part in enumerate(parts):
        failed = [n for n in part.needs if status.get(n, "ok") != "ok"]
        if failed:  # it would only fail on the missing input: costs nothing, the check goes on
            status[part.name] = not_run(out, part, "skipped", f"needs {failed[0]} ({status[failed[0]]})")["status"]
            print(f"{part.name:<15} skipped  needs {failed[0]} ({status[failed[0]]})", flush=True)
            continue
        limit, left = budget_of(part, scale, vllm), total_s - (time.monotonic() - start)
        if left < limit:  # started, it would be cut off with nothing recorded: stop here instead
            for later in parts[index:]:
                not_run(out, later, "not run", f"the check stopped with {left:.0f} s of {total_s:.0f} left, "
                                               f"{part.name} needs {limit:.0f} s")
            print(f"stopped: {left:.0f} s left, {part.name} needs {limit:.0f} s; not run: "
                  f"{', '.join(p.name for p in parts[index:])}", flush=True)
            break
        record = run_limited(part, out, limit)
        status[part.name] = record["status"]
        print(verdict_line(record), flush=True)
        (out / "table.md").write_text(table(out, parts) + "\n")
    text = table(out, parts)
    (out / "table.md").write_text(text + "\n")
    print("\n" + text)
    for part in parts:  # the production-scale parts' own tables
        record = read_record(out, part.name) or {}
        if (record.get("details") or {}).get("table"):
            print(f"\n## {part.name}\n\n{record['details']['table']}")
    return 1 if any(s in FAILED for s in status.values()) or len(status) < len(parts) else 0


def verdict_line(record: dict) -> str:
    wall = f"{record.get('wall_s', 0):6.1f} s of {record.get('budget_s', '-')} s"
    return f"{record['part']:<15} {record['status']:<8} {wall:<16} {record['summary'][:200]}"


def table(out: Path, parts=CHECK) -> str:
    lines = ["| part | status | wall s | budget s | result |", "|---|---|---|---|---|"]
    for part in parts:
        record = read_record(out, part.name)
        if record is None:
            lines.append(f"| {part.name} | not run | - | - | - |")
            continue
        lines.append(f"| {part.name} | {record['status']} | {record.get('wall_s', record.get('seconds'))} | "
                     f"{record.get('budget_s', '-')} | {record['summary'].replace('|', '/')} |")
    return "\n".join(lines)


def parts_markdown() -> str:
    """CHECK as docs/gpu.md shows it."""
    rows = [f"| `{p.name}` | {p.budget_s}{f' (+{p.vllm_s} with vLLM)' if p.vllm_s else ''} | {p.proves} | {p.cannot} |"
            for p in CHECK]
    total = sum(p.budget_s for p in CHECK)
    return "\n".join(["| part | budget s | proves | cannot prove |", "|---|---|---|---|", *rows,
                      f"| all | {total} ({total / 60:.1f} min) | | |"])


def write_doc(path: Path) -> None:
    text = path.read_text()
    head, rest = text.split(DOC_BEGIN, 1)
    tail = rest.split(DOC_END, 1)[1]
    path.write_text(f"{head}{DOC_BEGIN}\n{parts_markdown()}\n{DOC_END}{tail}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["parts"]:
        if argv[1:2] == ["--doc"]:
            write_doc(Path(argv[2]))
        else:
            print(parts_markdown())
        return 0
    names = {p.name for p in CHECK} | set(EXTRA)
    if len(argv) != 3 or argv[1] != "--out" or argv[0] not in (*names, "table", "check"):
        print(f"usage: gpu_check.py {{check|table|{'|'.join(sorted(names))}}} --out DIR | parts [--doc FILE]",
              file=sys.stderr)
        return 2
    out = Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if argv[0] == "table":
        print(table(out))
        return 0
    if argv[0] == "check":
        parts, scale = selected(), time_scale()
        vllm = bool(os.environ.get("DFLASH_VLLM_PYTHON")) and os.environ.get("GPU_CHECK_DEVICE") != "cpu"
        total = float(os.environ.get("GPU_CHECK_TOTAL_S") or sum(budget_of(p, scale, vllm) for p in parts))
        return check(out, parts, total, scale, vllm)
    sys.path.insert(0, str(HERE))
    return 0 if run_part(argv[0], out)["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
