"""The command: plan, resume, regenerate this rank's parts, merge when all are committed."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable
from itertools import groupby

from dflash_common.errors import ConfigError
from dflash_common.files import foreign_entries, holds, one_writer, refuse_links, remove_file, write_file_atomic
from dflash_common.progress import Progress
from dflash_corpus import (
    CorpusConfig,
    corpus_fingerprint,
    iter_rows,
    list_corpus_files,
    require_rows,
)
from dflash_regenerate.generation import ServerGenerator, TeacherGenerator, load_generator, load_server_generator, regenerate_rows
from dflash_regenerate.outputs import (
    LOCK_ENTRY,
    PART_TEMPORARY,
    PARTS_ENTRY,
    RESUME_KEYS,
    SETTINGS,
    SETTINGS_FORMAT,
    SETTINGS_VERSION,
    RegenerateResult,
    lock_name,
)
from dflash_regenerate.part_plan import part_rows, rank_parts, settings_mismatch
from dflash_regenerate.parts import (
    commit_part,
    committed_parts,
    complete_result,
    file_checksum,
    merge_parts,
    read_json,
    sum_records,
)
from dflash_regenerate.settings.regenerate_config import RegenerateConfig, output_root, parts_dir
from dflash_teacher.teacher import tokenizer_hashes


def _check_paths(cfg: RegenerateConfig, files: list[str]) -> None:
    out, folder = os.path.abspath(cfg.out), os.path.abspath(parts_dir(cfg.out))
    data = os.path.abspath(os.path.expanduser(cfg.data))
    inside = os.path.isdir(data) and os.path.commonpath([data, out]) == data
    listed = any(os.path.abspath(f) == out or os.path.abspath(f).startswith(folder + os.sep) for f in files)
    if inside or listed:
        raise ConfigError(f"--out {cfg.out} lies inside --data {cfg.data}, so the output would be read back as input; "
                          f"write it outside the corpus folder")


def _plain_settings(cfg: RegenerateConfig, files: list[str], total_rows: int) -> dict:
    """The settings known without loading the teacher."""
    # Greedy decoding ignores seed and top-p, so changing them does not change the output.
    sampling = ({"temperature": 0.0} if cfg.greedy else
                {"temperature": float(cfg.temperature), "top_p": float(cfg.top_p), "seed": cfg.seed})
    server = cfg.server
    return {
        "format": SETTINGS_FORMAT,
        "version": SETTINGS_VERSION,
        "backend": "server" if server else "transformers",
        # the endpoints may move (other hosts, ports); the served model and the settings define the output
        "teacher_name": server.served_model if server else cfg.teacher.name_or_path,
        "dtype": None if server else cfg.teacher.dtype,
        "corpus": {"fingerprint": corpus_fingerprint(files), "rows": total_rows},
        "rows_per_part": cfg.rows_per_part,
        "max_new_tokens": cfg.max_new_tokens,
        "keep_turns": cfg.keep_turns,
        "sampling": sampling,
        "on_truncated": cfg.on_truncated,
        "reasoning": cfg.reasoning,
        "chat_template_kwargs": cfg.chat_template_kwargs,
    }


def _teacher_settings(gen: "TeacherGenerator | ServerGenerator") -> dict:
    if isinstance(gen, ServerGenerator):
        return {"teacher": gen.identity, "tokenizer": None}
    identity = {k: v for k, v in gen.identity.items() if k not in ("name", "revision")}  # hashes name it; paths move
    return {"teacher": identity, "tokenizer": tokenizer_hashes(gen.tokenizer)}


def _refuse_mismatch(cfg: RegenerateConfig, existing: dict, settings: dict, keys: Iterable[str]) -> None:
    settings_path = os.path.join(parts_dir(cfg.out), SETTINGS)
    if existing.get("format") != SETTINGS_FORMAT or existing.get("version") != SETTINGS_VERSION:
        raise ConfigError(f"{settings_path} was written by another tool or version; pass --overwrite to start over")
    problem = settings_mismatch(existing, settings, keys)
    if problem:
        raise ConfigError(f"{cfg.out} was regenerated with other settings: {problem}; rerun with the earlier settings "
                          f"to resume, or pass --overwrite to start over")


def _written_here(entry: os.DirEntry) -> bool:
    """Whether an entry of OUT.parts is one regenerate writes (PARTS_ENTRY names files only)."""
    return bool(PARTS_ENTRY.match(entry.name)) and not entry.is_dir(follow_symlinks=False)


def _ours(entry: os.DirEntry) -> bool:
    """Whether an entry of OUT.parts is regenerate's: what it writes, or a writer's lock."""
    return _written_here(entry) or (bool(LOCK_ENTRY.match(entry.name)) and entry.is_file(follow_symlinks=False))


def _overwritten_files(cfg: RegenerateConfig) -> list[str]:
    """What --overwrite deletes in OUT.parts: the parts, records, settings and temporaries
    regenerate wrote. Anything else there is a user's: refused before a file is deleted, as
    `build --overwrite` does."""
    folder = parts_dir(cfg.out)
    foreign = foreign_entries(folder, _ours)
    if foreign:
        raise ConfigError(f"{folder} holds {holds(foreign)}, which regenerate did not write; --overwrite deletes only "
                          f"the parts and settings it wrote, so nothing was deleted: move them out of {folder} and rerun")
    # listed by the same test, so a file that came after the check is deleted only if it is ours
    return [os.path.join(folder, name) for name in foreign_entries(folder, lambda entry: not _written_here(entry))]


def _prepare(cfg: RegenerateConfig, settings: dict) -> dict | None:
    """Check or start OUT.parts; returns the merged summary when the output is already complete."""
    folder, root = parts_dir(cfg.out), output_root(cfg.out)
    settings_path = os.path.join(folder, SETTINGS)
    if cfg.overwrite:
        for path in _overwritten_files(cfg):  # checked again: files may have come since regenerate() looked
            remove_file(path, root)
        if os.path.lexists(cfg.out):
            remove_file(cfg.out, root)
    existing = read_json(settings_path)
    if existing is None:
        if os.path.exists(cfg.out):
            raise ConfigError(f"{cfg.out} already exists and {folder} does not say how it was made; choose another "
                              f"--out, or pass --overwrite to replace it")
        # Temporaries may be another rank writing the settings right now.
        if os.path.isdir(folder) and any(".tmp-" not in name and not LOCK_ENTRY.match(name) for name in os.listdir(folder)):
            raise ConfigError(f"{folder} is not empty but has no {SETTINGS}; delete it or pass --overwrite")
        os.makedirs(folder, exist_ok=True)
        write_file_atomic(settings_path, (json.dumps(settings, indent=1) + "\n").encode(), root)
        return None
    _refuse_mismatch(cfg, existing, settings, RESUME_KEYS)
    merged = existing.get("merged")
    if merged is not None:
        if not os.path.exists(cfg.out):
            # Deleted after the merge, and its parts went with the merge: generate it again.
            write_file_atomic(settings_path, (json.dumps(settings, indent=1) + "\n").encode(), root)
            return None
        if file_checksum(cfg.out) != merged.get("checksum"):
            raise ConfigError(f"{cfg.out} changed since this command finished it; keep it, or pass --overwrite to "
                              f"regenerate it")
    return merged


def _remove_stale_temporaries(cfg: RegenerateConfig) -> None:
    """Delete temporaries a killed run left (never committed, so never read). With several
    ranks, only those of this rank's parts: another rank may be writing its own right now."""
    folder = parts_dir(cfg.out)
    stale = []
    for name in os.listdir(folder):
        match = PART_TEMPORARY.match(name)
        if match and int(match.group(1)) % cfg.world_size == cfg.rank:
            stale.append(os.path.join(folder, name))
        elif ".tmp-" in name and cfg.world_size == 1:
            stale.append(os.path.join(folder, name))
    if cfg.world_size == 1:  # an interrupted merge
        out_dir, base = os.path.split(os.path.abspath(cfg.out))
        stale.extend(os.path.join(out_dir, n) for n in os.listdir(out_dir) if n.startswith(f".{base}.tmp-"))
    for path in stale:
        remove_file(path, output_root(cfg.out), missing_ok=True)


def regenerate(cfg: RegenerateConfig, progress: Progress | None = None) -> RegenerateResult:
    """Regenerate this rank's parts (skipping committed ones) and merge when all are done."""
    progress = progress or Progress()
    files = list_corpus_files(cfg.data)
    _check_paths(cfg, files)
    total_rows = require_rows(files, cfg.data)
    settings = _plain_settings(cfg, files, total_rows)
    # before the teacher loads (and again where each file is written or deleted)
    refuse_links(parts_dir(cfg.out), output_root(cfg.out))
    refuse_links(cfg.out, output_root(cfg.out))
    if cfg.overwrite:
        _overwritten_files(cfg)  # refuse a user's file in OUT.parts before loading the teacher, not after
    existing = None if cfg.overwrite else read_json(os.path.join(parts_dir(cfg.out), SETTINGS))
    if existing is not None:  # refuse what can be refused before spending minutes loading a large teacher
        _refuse_mismatch(cfg, existing, settings, [k for k in RESUME_KEYS if k in settings])
    # one process per rank writes OUT.parts; taken before the teacher loads, so a second one
    # stops at once, and held until the merge is written
    lock = one_writer(parts_dir(cfg.out), "dflash-cache regenerate" + (f" of rank {cfg.rank}" if cfg.world_size > 1 else ""),
                      f"wait for it to end (or stop it), or choose another --out than {cfg.out}",
                      lock_name(cfg.rank, cfg.world_size))
    with lock:
        return _regenerate_from(cfg, settings, files, total_rows, progress)


def _regenerate_from(cfg: RegenerateConfig, settings: dict, files: list[str], total_rows: int,
                     progress: Progress) -> RegenerateResult:
    if cfg.server is not None:
        gen = load_server_generator(cfg.server, on_retry=lambda url, error: progress.message(
            f"retrying a request to {url} ({error[:160]})"))
        try:
            return _regenerate_with(cfg, gen, settings, files, total_rows, progress)
        finally:
            gen.servers.close()
    return _regenerate_with(cfg, load_generator(cfg.teacher), settings, files, total_rows, progress)


def _regenerate_with(cfg: RegenerateConfig, gen: "TeacherGenerator | ServerGenerator", settings: dict,
                     files: list[str], total_rows: int, progress: Progress) -> RegenerateResult:
    merged = _prepare(cfg, {**settings, **_teacher_settings(gen)})
    if merged is not None:
        result = complete_result(cfg.out, merged)
        progress.message(f"{cfg.out} is already complete ({result.rows:,} rows); nothing to do")
        return result

    folder = parts_dir(cfg.out)
    _remove_stale_temporaries(cfg)
    num_parts = math.ceil(total_rows / cfg.rows_per_part)
    mine = rank_parts(num_parts, cfg.rank, cfg.world_size)
    done = committed_parts(folder, num_parts)
    todo = [i for i in mine if i not in done]
    if len(todo) < len(mine):
        progress.message(f"resuming: {len(mine) - len(todo)} of {len(mine)} part(s) of rank {cfg.rank} "
                         f"already written, {len(todo)} to go")

    written = _write_parts(cfg, gen, todo, total_rows, progress)

    done = committed_parts(folder, num_parts)
    missing = num_parts - len(done)
    if missing:
        progress.message(f"rank {cfg.rank} finished its parts; {missing} part(s) of other ranks are still missing. "
                         f"The last rank to finish merges them, or rerun with --merge-only once all are done")
        rows, skipped, tokens, truncated, empty = sum_records(done[i] for i in mine if i in done)
        return RegenerateResult(out=cfg.out, complete=False, rows=rows, skipped=dict(skipped), tokens=tokens,
                                truncated=truncated, empty=empty, parts_written=written, parts_missing=missing)
    result = merge_parts(cfg.out, progress)
    result.parts_written = written
    return result


def _write_parts(cfg: RegenerateConfig, gen: "TeacherGenerator | ServerGenerator", todo: list[int], total_rows: int,
                 progress: Progress) -> int:
    """Regenerate and commit the parts `todo` (ascending) in one pass over the corpus, reporting
    rows and tokens a second; returns how many were written."""
    corpus = CorpusConfig(data=cfg.data, on_bad_row=cfg.on_bad_row)
    todo_set = set(todo)
    started = time.perf_counter()
    stats = {"rows": 0, "tokens": 0}

    def on_batch(rows_done: int, tokens: int) -> None:
        stats["rows"] += rows_done
        stats["tokens"] += tokens
        elapsed = max(time.perf_counter() - started, 1e-9)
        rates = {"rows/s": f"{stats['rows'] / elapsed:,.2f}", "tok/s": f"{stats['tokens'] / elapsed:,.0f}"}
        if isinstance(gen, ServerGenerator):
            rates["retries"] = str(gen.servers.retries)
        progress.advance(rows_done, **rates)

    written = 0
    folder = parts_dir(cfg.out)
    spans = [part_rows(i, cfg.rows_per_part, total_rows) for i in todo]
    progress.start(sum(end - start for start, end in spans), "regenerating", "rows")
    try:
        if todo:
            last = todo[-1]
            source = iter_rows(corpus, start_row=todo[0] * cfg.rows_per_part)
            # One pass over the corpus (rows of other ranks' parts are read and passed over):
            # restarting the reader per part would rescan JSON Lines files from the top.
            for index, group in groupby(source, key=lambda r: r.index // cfg.rows_per_part):
                if index > last:
                    break
                if index not in todo_set:
                    continue
                outcome = regenerate_rows(list(group), cfg, gen, on_batch)
                commit_part(folder, index, part_rows(index, cfg.rows_per_part, total_rows), outcome)
                written += 1
    finally:
        progress.close()
    return written
