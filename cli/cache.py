"""`dflash-cache`: build, inspect and verify teacher caches."""

from __future__ import annotations

import json
from typing import Optional

import typer

from cli.common import BarProgress, json_option, run, split_ints
from dflash_common.errors import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Stage 1: run a teacher over a corpus once and cache what drafter training needs.")


def _build_config(**o):
    import os

    from dflash_cache.build import BuildConfig
    from dflash_cache.corpus import CorpusConfig
    from dflash_cache.settings.engines import parse_vllm_args
    from dflash_cache.teacher import TeacherConfig
    from dflash_cache.writer import StorageConfig, parse_size

    return BuildConfig(
        out=o["out"],
        corpus=CorpusConfig(data=o["data"], max_length=o["max_length"], overlong=o["overlong"],
                            min_length=o["min_length"], on_bad_row=o["on_bad_row"],
                            chat_template_kwargs=json_option(o["chat_template_kwargs"], "--chat-template-kwargs")),
        teacher=TeacherConfig(name_or_path=o["teacher"], revision=o["revision"], dtype=o["dtype"], device=o["device"], device_map=o["device_map"],
                              layers=split_ints(o["layers"], "--layers"), num_tapped_layers=o["tapped_layers"],
                              top_k=o["top_k"], batch_tokens=o["batch_tokens"], logits_chunk=o["logits_chunk"],
                              trust_remote_code=o["trust_remote_code"]),
        storage=StorageConfig(shard_bytes=parse_size(o["shard_size"]), chunk_bytes=parse_size(o["chunk_size"]),
                              compression=o["compression"], hidden_format=o["hidden_format"]),
        overwrite=o["overwrite"],
        storage_options=json_option(o["storage_options"], "--storage-options"),
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        engine=o["engine"],
        vllm=parse_vllm_args(o["vllm_args"]),
        vllm_python=o["vllm_python"],
    )


@app.command()
def build(
    teacher: str = typer.Option(..., help="Teacher: a local folder or hub name of a transformers causal LM."),
    data: str = typer.Option(..., help="Corpus: JSONL/Parquet/Arrow file, folder or glob, or a datasets save_to_disk folder."),
    out: str = typer.Option(..., help="Cache URL: local folder, s3://bucket/path, gs://..."),
    layers: Optional[str] = typer.Option(None, help="Teacher decoder layers to tap, 0-based, e.g. 1,16,31,46,61. Default: spread for --tapped-layers."),
    tapped_layers: int = typer.Option(5, "--tapped-layers", "--drafter-layers", help="Number of tapped layers for the default --layers (--drafter-layers: its old name)."),
    top_k: int = typer.Option(64, help="How many top next-token log-probs to keep per position."),
    max_length: int = typer.Option(4096, help="Longest sequence in tokens."),
    overlong: str = typer.Option("truncate", help="Sequences over --max-length: truncate or drop."),
    min_length: int = typer.Option(2, help="Drop sequences shorter than this many tokens."),
    dtype: str = typer.Option("bfloat16", help="Teacher compute and hidden-state storage dtype: bfloat16 or float32."),
    device: str = typer.Option("auto", help="auto or cuda (each torchrun rank its LOCAL_RANK GPU), cpu, or cuda:N."),
    device_map: Optional[str] = typer.Option(None, help="Spread a teacher too large for one GPU over the node's GPUs (transformers device_map, e.g. auto); one process per node."),
    revision: Optional[str] = typer.Option(None, help="Hub revision of the teacher."),
    trust_remote_code: bool = typer.Option(False, help="Run modeling/tokenizer code shipped in the teacher's folder (only for code you trust)."),
    batch_tokens: int = typer.Option(8192, help="Padded tokens per teacher forward (sequences are bucketed by length)."),
    logits_chunk: int = typer.Option(2048, help="Positions per LM-head chunk (bounds fp32 logits memory)."),
    shard_size: str = typer.Option("512MB", help="Hidden-state bytes per shard, e.g. 512MB, 2GiB."),
    chunk_size: str = typer.Option("4MiB", help="Bytes per Zarr chunk of hidden states."),
    compression: str = typer.Option("none", help="Hidden-state compression: none or zstd."),
    hidden_format: str = typer.Option("lossless", help="Hidden-state storage: lossless (the --dtype's exact bits) or fp8_e4m3 (half of bf16's bytes, ~2.7% relative error, read back as --dtype)."),
    on_bad_row: str = typer.Option("fail", help="Bad corpus rows: fail (one line naming file and row) or skip (counted)."),
    chat_template_kwargs: Optional[str] = typer.Option(None, help="Chat-template variables as JSON, e.g. '{\"enable_thinking\": false}'; build, regenerate, eval and serving must agree."),
    storage_options: Optional[str] = typer.Option(None, help="fsspec storage options as JSON, e.g. '{\"endpoint_url\": ...}'."),
    engine: str = typer.Option("transformers", help="What runs the teacher: transformers (here) or vllm (vLLM's engine in its own environment; the same cache, at serving-engine speed)."),
    vllm_python: Optional[str] = typer.Option(None, help="With --engine vllm: python of an environment with vLLM (default: $DFLASH_VLLM_PYTHON, else .venv-vllm/bin/python)."),
    vllm_args: Optional[str] = typer.Option(None, help="With --engine vllm: engine options as JSON, e.g. '{\"tensor_parallel_size\": 2, \"gpu_memory_utilization\": 0.85}' (also data_parallel_size, max_model_len, enable_prefix_caching, enforce_eager, max_num_batched_tokens)."),
    overwrite: bool = typer.Option(False, help="Delete an existing cache at --out and build from scratch (default: resume it)."),
    dry_run: bool = typer.Option(False, help="Tokenize only and estimate sequences, tokens, bytes and shards."),
    quiet: bool = typer.Option(False, help="No progress bar."),
    debug: bool = typer.Option(False, help="Show tracebacks."),
):
    """Run the teacher over the corpus and write (or resume) a sharded cache."""
    options = dict(locals())
    progress = BarProgress(enabled=not quiet)

    def action():
        from dflash_cache.build import build_cache, estimate

        cfg = _build_config(**options)
        if dry_run:
            e = estimate(cfg, progress)
            typer.echo(
                f"rows {e.rows:,}  sequences {e.sequences:,}  tokens {e.tokens:,} ({e.loss_tokens:,} in the loss mask)\n"
                f"bytes {e.bytes / 1e9:,.3f} GB ({e.bytes_per_token:,} B/token)  shards {e.shards:,}"
                + (f"\nskipped {e.skipped}" if e.skipped else "")
            )
            return
        build_cache(cfg, progress)
        typer.echo(f"cache ready at {cfg.out}")

    run(action, debug)


@app.command()
def finalize(
    url: str = typer.Argument(..., help="Cache URL built by several ranks."),
    storage_options: Optional[str] = typer.Option(None, help="fsspec storage options as JSON."),
    debug: bool = typer.Option(False, help="Show tracebacks."),
):
    """Merge the ranks' shard records into the final manifest (for ranks run as independent jobs)."""

    def action():
        from dflash_cache.build import finalize_cache

        m = finalize_cache(url, json_option(storage_options, "--storage-options"))
        typer.echo(f"finalized {url}: {m['totals']['shards']} shard(s), {m['totals']['sequences']:,} sequences")

    run(action, debug)


@app.command()
def info(
    url: str = typer.Argument(..., help="Cache URL."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole manifest as JSON."),
    storage_options: Optional[str] = typer.Option(None, help="fsspec storage options as JSON."),
    debug: bool = typer.Option(False, help="Show tracebacks."),
):
    """Describe a cache: teacher, layers, k, sizes, shards, skipped rows."""

    def action():
        from dflash_cache import open_cache

        cache = open_cache(url, json_option(storage_options, "--storage-options"))
        m = cache.manifest
        if as_json:
            typer.echo(json.dumps(m, indent=1))
            return
        from dflash_cache import format as fmt

        # totals are a sum the build writes last; an older or hand-made manifest may lack them
        t, teacher = m.get("totals") or fmt.totals(cache.manifest.get("shards", [])), m["teacher"]
        tokens = max(t.get("tokens", 0), 1)
        lines = [
            f"cache        {url} ({'complete' if cache.complete else 'INCOMPLETE: rerun the build to finish it'})",
            f"format       {m['format']} v{m['format_version']}",
            f"teacher      {teacher['name']} ({teacher['model_type']}, {teacher['num_hidden_layers']} layers, hidden {teacher['hidden_size']}, vocab {teacher['vocab_size']:,}; weights {teacher['weights_hash']})",
            f"layers       {','.join(map(str, cache.layer_ids))}   dtype {cache.hidden_dtype}   top-k {cache.top_k}",
            f"sequences    {t.get('sequences', 0):,}   tokens {t.get('tokens', 0):,} ({t.get('loss_tokens', 0):,} in the loss mask)",
            f"storage      {t.get('bytes', 0) / 1e6:,.1f} MB in {t.get('shards', 0)} shard(s), {t.get('bytes', 0) / tokens:,.0f} B/token",
        ]
        if cache.hidden_format != "lossless":
            lines.append(f"hidden       {cache.hidden_format} with a power-of-two scale per token and layer "
                         f"(lossy; read back as {cache.hidden_dtype})")
        if t.get("skipped"):
            lines.append(f"skipped      {', '.join(f'{k}: {v}' for k, v in sorted(t['skipped'].items()))}")
        typer.echo("\n".join(lines))

    run(action, debug)


@app.command()
def verify(
    url: str = typer.Argument(..., help="Cache URL."),
    deep: bool = typer.Option(False, help="Also re-run the teacher on a sample of sequences and compare hidden states and top-k with the stored values."),
    sample: int = typer.Option(64, help="Sequences re-run by --deep, spread over all shards."),
    teacher: Optional[str] = typer.Option(None, help="Teacher for --deep (default: the manifest's build.teacher.name_or_path)."),
    device: str = typer.Option("auto", help="Device for --deep: auto, cpu, cuda or cuda:N."),
    storage_options: Optional[str] = typer.Option(None, help="fsspec storage options as JSON."),
    quiet: bool = typer.Option(False, help="No progress bar."),
    debug: bool = typer.Option(False, help="Show tracebacks."),
):
    """Check every shard's checksums, shapes, dtypes and finiteness; exit 1 naming each bad shard."""

    def action():
        from dflash_cache import open_cache
        from dflash_cache.verify import verify_cache

        if deep and sample < 1:  # -1 re-ran nothing and said ok
            raise ConfigError(f"--sample {sample} must be at least 1: the number of sequences --deep re-runs, e.g. 64")
        cache = open_cache(url, json_option(storage_options, "--storage-options"))
        report = verify_cache(cache, BarProgress(enabled=not quiet))
        for name in report.uncommitted:
            typer.echo(f"note: {name} is not listed in the manifest (left by an interrupted build; rerun the build to finish it)", err=True)
        for name, problems in report.bad_shards.items():
            typer.echo(f"BAD {name}: {'; '.join(problems)}", err=True)
        if report.head_problem:
            typer.echo(f"BAD teacher head: {report.head_problem}", err=True)
        if report.head_note:
            typer.echo(f"note: {report.head_note}", err=True)
        deep_report = None
        if deep:
            from dflash_cache.verify import deep_verify

            deep_report = deep_verify(cache, sample, teacher, device, BarProgress(enabled=not quiet),
                                      skip=set(report.bad_shards))
            for seq, problem in deep_report.mismatches.items():
                typer.echo(f"MISMATCH {seq}: {problem}", err=True)
        if report.head_problem and not report.bad_shards:
            typer.echo("error: the teacher head is damaged; rebuild the cache with `dflash-cache build ... --overwrite`", err=True)
            raise typer.Exit(1)
        if not report.ok:
            typer.echo(f"error: {len(report.bad_shards)} of {report.shards_checked} shard(s) are damaged"
                       f"{' and so is the teacher head' if report.head_problem else ''}; rebuild the cache with "
                       "`dflash-cache build ... --overwrite`", err=True)
            raise typer.Exit(1)
        if deep_report is not None and not deep_report.ok:
            typer.echo(f"error: {len(deep_report.mismatches)} of {deep_report.checked} re-run sequences differ from what {deep_report.teacher} computes now; the cache does not hold this teacher's outputs, rebuild it with `dflash-cache build ... --overwrite`", err=True)
            raise typer.Exit(1)
        if deep_report is not None:
            typer.echo(f"deep: {deep_report.checked} sequences re-run with {deep_report.teacher} match the stored values")
        state = "complete" if cache.complete else "incomplete (build not finished)"
        typer.echo(f"ok: {report.shards_checked} shard(s), {len(cache):,} sequences verified; cache {state}")

    run(action, debug)


@app.command()
def regenerate(
    teacher: Optional[str] = typer.Option(None, help="Teacher that writes the answers: a local folder or hub name of a chat model (or use --endpoint)."),
    data: str = typer.Option(..., help="Source corpus (chat `messages` or ShareGPT `conversations`): file, folder or glob."),
    endpoint: list[str] = typer.Option([], "--endpoint", help="Base URL of an OpenAI-compatible server (vLLM, SGLang) serving the teacher, e.g. http://127.0.0.1:8000/v1; repeat to spread requests over several."),
    served_model: Optional[str] = typer.Option(None, help="With --endpoint: the model name the servers serve the teacher under."),
    concurrency: int = typer.Option(8, help="With --endpoint: requests in flight at once, over all endpoints."),
    api_key_env: Optional[str] = typer.Option(None, help="With --endpoint: environment variable holding the servers' API key."),
    request_timeout: float = typer.Option(600.0, help="With --endpoint: seconds one request may take before it is retried."),
    max_retries: int = typer.Option(5, help="With --endpoint: retries of a request after connection errors, timeouts, 429 or 5xx."),
    on_truncated: str = typer.Option("keep", help="Answers cut at --max-new-tokens: keep (written, counted) or drop (row left out, counted)."),
    reasoning: str = typer.Option("drop", help="Reasoning a server returns apart from the answer (reasoning_content): drop or keep."),
    chat_template_kwargs: Optional[str] = typer.Option(None, help="Chat-template variables as JSON, e.g. '{\"enable_thinking\": false}'; build, regenerate, eval and serving must agree."),
    out: str = typer.Option(..., help="Regenerated corpus, a .jsonl file; its parts go to OUT.parts/ until the merge."),
    max_new_tokens: int = typer.Option(2048, help="Longest answer per assistant turn, in tokens (longer ones are cut and counted)."),
    temperature: float = typer.Option(0.0, help="0 for greedy (the teacher's argmax), else the sampling temperature."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass (with --temperature > 0)."),
    batch_size: int = typer.Option(16, help="Prompts per generate call (left-padded)."),
    keep_turns: str = typer.Option("first", help="first: system + first user turn + one answer; all: every user turn, answered turn by turn."),
    on_bad_row: str = typer.Option("fail", help="Bad corpus rows: fail (one line naming file and row) or skip (counted)."),
    seed: int = typer.Option(0, help="Sampling seed; each (seed, row id, turn) draws its own random stream."),
    rows_per_part: int = typer.Option(256, help="Source rows per part file (the unit of resuming and of splitting across ranks)."),
    dtype: str = typer.Option("bfloat16", help="Teacher compute dtype: bfloat16 or float32."),
    device: str = typer.Option("auto", help="auto or cuda (each torchrun rank its LOCAL_RANK GPU), cpu, or cuda:N."),
    revision: Optional[str] = typer.Option(None, help="Hub revision of the teacher."),
    trust_remote_code: bool = typer.Option(False, help="Run modeling/tokenizer code shipped in the teacher's folder (only for code you trust)."),
    overwrite: bool = typer.Option(False, help="Delete an earlier OUT and what regenerate wrote in OUT.parts, and start over (default: resume); any other file there stops it."),
    merge_only: bool = typer.Option(False, help="Only concatenate the committed parts into OUT (after every rank finished)."),
    quiet: bool = typer.Option(False, help="No progress bar."),
    debug: bool = typer.Option(False, help="Show tracebacks."),
):
    """Keep the corpus prompts and replace the assistant turns with the teacher's own answers (resumable; torchrun splits rows)."""
    progress = BarProgress(enabled=not quiet)

    def action():
        from dflash_cache.teacher import TeacherConfig
        from dflash_regenerate import RegenerateConfig, merge_parts, ranks_from_env
        from dflash_regenerate import regenerate as regenerate_corpus
        from dflash_regenerate.chat_server import ServerConfig

        if merge_only:
            result = merge_parts(out, progress)
        else:
            if bool(teacher) == bool(endpoint):
                raise ConfigError("give --teacher (generate here with transformers) or --endpoint with --served-model "
                                  "(ask inference servers), not both or neither")
            if endpoint and not served_model:
                raise ConfigError("--endpoint needs --served-model, the name the server serves the teacher under "
                                  "(see its /v1/models)")
            rank, world_size = ranks_from_env()
            server = ServerConfig(endpoints=tuple(endpoint), served_model=served_model, concurrency=concurrency,
                                  api_key_env=api_key_env, request_timeout=request_timeout,
                                  max_retries=max_retries) if endpoint else None
            cfg = RegenerateConfig(
                data=data, out=out, server=server, on_truncated=on_truncated, reasoning=reasoning,
                chat_template_kwargs=json_option(chat_template_kwargs, "--chat-template-kwargs"),
                teacher=None if server else TeacherConfig(name_or_path=teacher, revision=revision, dtype=dtype,
                                                          device=device, trust_remote_code=trust_remote_code),
                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, batch_size=batch_size,
                keep_turns=keep_turns, on_bad_row=on_bad_row, seed=seed, rows_per_part=rows_per_part,
                overwrite=overwrite, rank=rank, world_size=world_size,
            )
            result = regenerate_corpus(cfg, progress)
        if result.complete:
            typer.echo(f"regenerated corpus ready at {out} ({result.rows:,} rows)")
        else:
            typer.echo(f"this rank is done; {result.parts_missing} part(s) of other ranks are missing")

    run(action, debug)


def main():
    app()


if __name__ == "__main__":
    main()
