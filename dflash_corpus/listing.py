"""Finding a corpus's files, and the fingerprint that identifies them.
"""

from __future__ import annotations

import glob
import hashlib
import os
import stat
from collections.abc import Sequence

import xxhash

from dflash_common.errors import ConfigError, DFlashError
from dflash_common.settings_files import load_settings_file
from dflash_corpus.settings.corpus_config import SUPPORTED_SUFFIXES

_MIB = 1 << 20
_FINGERPRINT_VERSION = b"dflash-corpus-fingerprint-v1"


def _is_saved_dataset(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "state.json")) and os.path.isfile(
        os.path.join(folder, "dataset_info.json")
    )


def _reject_dataset_dict(folder: str) -> None:
    marker = os.path.join(folder, "dataset_dict.json")
    if not os.path.exists(marker):  # a link to /dev/zero marks a DatasetDict too: not read as a corpus file
        return
    try:  # bounded: the marker is only read to name the splits in the refusal
        splits = load_settings_file(marker, kind="json").get("splits", [])
    except (OSError, DFlashError, AttributeError):
        splits = []
    if not isinstance(splits, list) or not all(isinstance(split, str) for split in splits):
        splits = []
    example = os.path.join(folder, splits[0]) if splits else os.path.join(folder, "<split>")
    raise ConfigError(
        f"corpus folder {folder} is a datasets DatasetDict with splits {', '.join(splits) or '?'}; "
        f"point the corpus at one split folder, e.g. {example}"
    )


def _reject_json_array(path: str) -> None:
    # A `.json` file holding one big array would otherwise surface as thousands of bad rows.
    if not path.endswith(".json"):
        return
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"["):
        raise ConfigError(
            f"corpus file {path} holds a JSON array, not one JSON object per line; "
            f"convert it to JSON Lines (e.g. jq -c '.[]' {path} > corpus.jsonl)"
        )


def _walk_folder(folder: str) -> list[str]:
    """Supported files and save_to_disk folders under `folder`, skipping hidden entries."""
    _reject_dataset_dict(folder)
    if _is_saved_dataset(folder):
        return [folder]
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        kept_dirs = []
        for d in dirs:
            sub = os.path.join(root, d)
            _reject_dataset_dict(sub)
            if _is_saved_dataset(sub):
                found.append(sub)
            else:
                kept_dirs.append(d)
        dirs[:] = kept_dirs
        found.extend(
            os.path.join(root, name)
            for name in files
            if not name.startswith(".") and name.endswith(SUPPORTED_SUFFIXES)
        )
    return found


def list_corpus_files(data: str) -> list[str]:
    """The corpus entries `data` names, sorted by path: files, or save_to_disk folders.

    `data` is a supported file, a folder (searched recursively; hidden entries skipped; a
    save_to_disk folder counts as one entry), or a glob (`*`, `?`, `[`, `**` recursive).
    """
    data = os.path.expanduser(data)
    if any(ch in data for ch in "*?["):
        entries = []
        for match in glob.glob(data, recursive=True):
            if os.path.isdir(match):
                entries.extend(_walk_folder(match))
            elif match.endswith(SUPPORTED_SUFFIXES):
                entries.append(match)
    elif os.path.isdir(data):
        entries = _walk_folder(data)
    elif os.path.isfile(data):
        if not data.endswith(SUPPORTED_SUFFIXES):
            raise ConfigError(
                f"corpus file {data} has an unsupported extension; use "
                f"{', '.join(SUPPORTED_SUFFIXES)} or a datasets save_to_disk folder"
            )
        entries = [data]
    elif os.path.exists(data):  # /dev/null, a pipe, a socket: no corpus, and reading a pipe could block
        raise ConfigError(f"corpus path {data} is not a regular file or folder; point --data at a corpus file, "
                          f"folder or glob")
    else:
        raise ConfigError(f"corpus path {data} does not exist; check the path")
    entries = sorted(set(entries))
    if not entries:
        raise ConfigError(
            f"no corpus files found at {data} (looked for {', '.join(SUPPORTED_SUFFIXES)} files "
            f"and datasets save_to_disk folders); check the path or pattern"
        )
    for entry in entries:
        kernel = _kernel_target(entry)
        if os.path.isfile(entry) and kernel is not None:  # /proc/self/pagemap: a "regular file" never read to its end
            raise ConfigError(f"corpus path {entry} leads to {kernel}, a kernel file, not corpus data; move it out of the "
                              "corpus folder, or point --data at the corpus files alone")
        if os.path.isdir(entry) and _is_saved_dataset(entry):
            saved_dataset_files(entry)  # checked before datasets opens any of them
        elif os.path.isfile(entry):
            _reject_json_array(entry)
        elif not os.path.isdir(entry):  # found in a folder: a pipe would block, /dev/zero never end
            raise ConfigError(f"corpus path {entry} is not a regular file or folder; move it out of the corpus folder, "
                              "or point --data at the corpus files alone")
    return entries


MAX_DATA_FILES = 10_000
"""Most Arrow files one save_to_disk folder may name (save_to_disk writes ~500 MB each)."""

_KERNEL_FOLDERS = ("/proc", "/sys", "/dev")


def _kernel_target(path: str) -> str | None:
    """Where `path` leads when that is inside /proc, /sys or /dev (files there never end, block,
    or are gigabytes of kernel state that read as regular files), else None."""
    target = os.path.realpath(path)
    return target if any(target == k or target.startswith(k + os.sep) for k in _KERNEL_FOLDERS) else None


def saved_dataset_files(folder: str) -> list[str]:
    """The Arrow files a datasets save_to_disk folder's state.json names, each checked to be a
    regular file inside the folder (no `..`, absolute path or link out of it, no FIFO or device),
    so a folder never reads another's rows; every malformed state.json is one line naming the
    folder, the entry and the fix."""
    fix = "save the dataset again with dataset.save_to_disk(folder)"
    state = load_settings_file(os.path.join(folder, "state.json"), kind="json", fix=fix)
    if not isinstance(state, dict):
        raise ConfigError(f"corpus folder {folder}: state.json is a JSON {type(state).__name__}, not a datasets state "
                          f"(an object with a _data_files list); {fix}")
    entries = state.get("_data_files")
    if not isinstance(entries, list) or not entries:
        shown = "missing" if entries is None else "an empty list" if entries == [] else f"a {type(entries).__name__}"
        raise ConfigError(f"corpus folder {folder}: state.json's _data_files is {shown}, not a list of the folder's "
                          f"Arrow files; {fix}")
    if len(entries) > MAX_DATA_FILES:
        raise ConfigError(f"corpus folder {folder}: state.json names {len(entries):,} data files, more than the "
                          f"{MAX_DATA_FILES:,} a corpus folder may hold; {fix}")
    root = os.path.realpath(folder)
    files = []
    for i, item in enumerate(entries):
        name = item.get("filename") if isinstance(item, dict) else None
        where = f"corpus folder {folder}: state.json's _data_files[{i}]"
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where} has no file name ({str(item)[:80]!r}); {fix}")
        path = os.path.join(folder, name)
        target = os.path.realpath(path)
        if os.path.isabs(name) or os.path.commonpath([root, target]) != root:
            raise ConfigError(f"{where} names {name[:200]!r}, which is outside the folder; a corpus folder reads only "
                              f"its own files: {fix}")
        try:
            mode = os.stat(target).st_mode
        except OSError as err:
            raise ConfigError(f"{where} names {name[:200]!r}, which cannot be read ({err.strerror}); {fix}") from None
        if not stat.S_ISREG(mode):
            raise ConfigError(f"{where} names {name[:200]!r}, which is not a regular file (a FIFO, device or folder); "
                              f"{fix}")
        files.append(path)
    return files


def _sample_digest(path: str, size: int) -> tuple[str, str]:
    """xxh64 of the first MiB and of the last MiB (empty when the file is one MiB or less)."""
    with open(path, "rb") as f:
        head = xxhash.xxh64_hexdigest(f.read(_MIB))
        tail = ""
        if size > _MIB:
            f.seek(max(_MIB, size - _MIB))
            tail = xxhash.xxh64_hexdigest(f.read(_MIB))
    return head, tail


def corpus_fingerprint(files: Sequence[str]) -> str:
    """A stable hex fingerprint of the corpus `files` (as listed by list_corpus_files).

    It hashes each data file's name relative to the files' common folder, its size, and an
    xxh64 of its first and last MiB. This is a cheap fingerprint, not a full content hash:
    an edit in the middle of a large file that keeps its size goes unnoticed. Moving the
    corpus to another folder keeps the fingerprint.
    """
    data_files = []
    for entry in files:
        data_files.extend(saved_dataset_files(entry) if os.path.isdir(entry) else [entry])
    if not data_files:
        raise ConfigError("corpus_fingerprint got no files; list them with list_corpus_files")
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in data_files])
    digest = hashlib.sha256(_FINGERPRINT_VERSION)
    for path in data_files:
        size = os.path.getsize(path)
        head, tail = _sample_digest(path, size)
        name = os.path.relpath(os.path.abspath(path), root).replace(os.sep, "/")
        digest.update(f"\n{name}\0{size}\0{head}\0{tail}".encode())
    return digest.hexdigest()[:32]
