"""Greedy decoding in vLLM, run by the python of a vLLM environment: `python vllm_worker.py REQUEST RESULT`.

vLLM pins its own torch and transformers, so it lives in its own virtual environment and this
script imports nothing from dflash: it reads a JSON request (teacher, optional drafter, prompt
token ids, sampling settings, and a list of runs: the teacher alone or with a drafter), runs
vLLM's offline engine over all prompts once per run, one engine at a time, and writes a JSON
result (per run: output token ids, wall time, vLLM's spec-decode counters). `dflash_train.measuring.serving` writes
the request and reads the result.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time


def _counters(llm) -> dict:
    """vLLM's spec-decode counters (prometheus names without the vllm: prefix) so far in this process."""
    out: dict = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:")
        if not name.startswith("spec_decode_"):
            continue
        if hasattr(metric, "values"):  # per-position vector
            out[name] = [int(v) for v in metric.values]
        else:
            out[name] = int(metric.value)
    return out


def _delta(after: dict, before: dict) -> dict:
    """Counters of one run: the registry is per process, so later engines add to earlier ones."""
    out: dict = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            old = old or [0] * len(value)
            out[name] = [a - b for a, b in zip(value, old)] + value[len(old):]
        else:
            out[name] = value - (old or 0)
    return out


def _per_request_metrics() -> bool:
    """Whether this vLLM reports per-request spec-decode metrics (--per-request-spec-decode-metrics)."""
    from vllm.engine.arg_utils import EngineArgs

    return "per_request_spec_decode_metrics" in getattr(EngineArgs, "__dataclass_fields__", {})


def _request_metrics(completion) -> dict | None:
    """One request's draft steps and accepted drafts, from vLLM's per-request histogram (index j:
    the steps that accepted j drafts); None where vLLM gave none."""
    metrics = getattr(completion, "spec_decode_metrics", None)
    if metrics is None:
        return None
    histogram = [int(n) for n in metrics.histogram]
    return {"steps": sum(histogram), "accepted": sum(j * n for j, n in enumerate(histogram)), "histogram": histogram}


def _run(request: dict, run: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine_args = dict(model=request["teacher"], tokenizer=request["teacher"], dtype=request["dtype"],
                       max_model_len=request["max_model_len"], seed=request.get("seed", 0),
                       disable_log_stats=False, enforce_eager=True)
    if request.get("gpu_memory_utilization"):  # what the measuring process found free on its GPU
        engine_args["gpu_memory_utilization"] = request["gpu_memory_utilization"]
    if run.get("drafter"):
        engine_args["speculative_config"] = {"method": run.get("method", "dflash"), "model": run["drafter"],
                                             "num_speculative_tokens": run["num_speculative_tokens"]}
        if _per_request_metrics():  # each request's accepted-draft histogram (vLLM >= 0.32), beside the counters
            engine_args["per_request_spec_decode_metrics"] = "summary"
    llm = LLM(**engine_args)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"],
                                stop_token_ids=request["stop_token_ids"], detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        # one generate per group of prompts (a benchmark category), so the counters say each group's own
        groups = request.get("groups") or [list(range(len(prompts)))]
        outputs, group_runs, first = [None] * len(prompts), [], _counters(llm)
        for group in groups:
            before = _counters(llm)
            start = time.perf_counter()
            done = llm.generate([prompts[i] for i in group], params, use_tqdm=False)
            group_runs.append({"seconds": time.perf_counter() - start, "spec_decode": _delta(_counters(llm), before)})
            for i, out in zip(group, done):
                outputs[i] = out
        seconds = sum(g["seconds"] for g in group_runs)
        counters = _delta(_counters(llm), first)
    finally:
        # one engine at a time: the next run starts its own
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {
        "name": run["name"],
        "drafter": run.get("drafter"),
        "outputs": [list(out.outputs[0].token_ids) for out in outputs],
        "finish_reasons": [out.outputs[0].finish_reason for out in outputs],
        "per_request": [_request_metrics(out.outputs[0]) for out in outputs] if run.get("drafter") else None,
        "seconds": seconds,
        "spec_decode": counters,
        "groups": group_runs,
    }


def main(request_path: str, result_path: str) -> None:
    with open(request_path) as f:
        request = json.load(f)
    import vllm

    result = {"vllm_version": vllm.__version__, "runs": [_run(request, run) for run in request["runs"]]}
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python vllm_worker.py REQUEST.json RESULT.json")
    main(sys.argv[1], sys.argv[2])
