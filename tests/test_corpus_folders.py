"""A datasets save_to_disk folder reads only its own regular files, every malformed state.json
is one line naming the folder, the entry and the fix, and a corpus entry leading into /proc,
/sys or /dev is refused without being read (issue 36, item 6).

The build runs as the real `dflash-cache build --dry-run` in a child process with a time limit:
a FIFO or /proc/self/pagemap that is read would hang it, which fails the test instead of the
suite."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from helpers import qa_rows

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A real save_to_disk folder of 6 rows, and another folder's rows beside it."""
    import datasets

    root = tmp_path_factory.mktemp("saved")
    for name, prefix in (("corpus", "own-"), ("outside", "other-")):
        rows = qa_rows(6, seed=2, prefix=prefix)
        datasets.Dataset.from_dict(pa.Table.from_pylist(rows).to_pydict()).save_to_disk(str(root / name))
    return root


def _dry_run(teacher: str, data: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "dflash-cache"), "build", "--teacher", teacher, "--data", str(data), "--out",
                           str(data.parent / "cache"), "--layers", "0", "--dry-run", "--quiet"],
                          capture_output=True, text=True, timeout=timeout)


def _state(folder: Path) -> dict:
    return json.loads((folder / "state.json").read_text())


def _edit(saved: Path, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "corpus"
    shutil.copytree(saved / "corpus", folder)
    state = _state(folder)
    new = edit(state, folder)
    (folder / "state.json").write_text(json.dumps(state if new is None else new))
    return folder


def _arrow_name(state: dict) -> str:
    return state["_data_files"][0]["filename"]


_MALFORMED = {
    "a list, not an object": (lambda s, f: [1, 2], "state.json is a JSON list, not a datasets state"),
    "no _data_files": (lambda s, f: {k: v for k, v in s.items() if k != "_data_files"},
                       "state.json's _data_files is missing"),
    "_data_files an int": (lambda s, f: {**s, "_data_files": 7}, "state.json's _data_files is a int"),
    "_data_files empty": (lambda s, f: {**s, "_data_files": []}, "state.json's _data_files is an empty list"),
    "100,000 entries": (lambda s, f: {**s, "_data_files": s["_data_files"] * 100_000},
                        "state.json names 100,000 data files, more than the 10,000"),
    "an entry without filename": (lambda s, f: {**s, "_data_files": [{}]}, "_data_files[0] has no file name"),
    "an int filename": (lambda s, f: {**s, "_data_files": [{"filename": 5}]}, "_data_files[0] has no file name"),
    "an entry that is a string": (lambda s, f: {**s, "_data_files": ["x.arrow"]}, "_data_files[0] has no file name"),
    "../outside": (lambda s, f: {**s, "_data_files": [{"filename": f"../outside/{_arrow_name(s)}"}]},
                   "which is outside the folder"),
    "an absolute path": (lambda s, f: {**s, "_data_files": [{"filename": str(f.parent / "outside" / _arrow_name(s))}]},
                         "which is outside the folder"),
    "/etc/passwd": (lambda s, f: {**s, "_data_files": [{"filename": "/etc/passwd"}]}, "which is outside the folder"),
    "/dev/zero": (lambda s, f: {**s, "_data_files": [{"filename": "/dev/zero"}]}, "which is outside the folder"),
    "a link out of the folder": (lambda s, f: os.symlink(f.parent / "outside" / _arrow_name(s), f / "link.arrow")
                                 or {**s, "_data_files": [{"filename": "link.arrow"}]}, "which is outside the folder"),
    "a FIFO": (lambda s, f: os.mkfifo(f / "pipe.arrow") or {**s, "_data_files": [{"filename": "pipe.arrow"}]},
               "which is not a regular file"),
    "a missing file": (lambda s, f: {**s, "_data_files": [{"filename": "gone.arrow"}]}, "which cannot be read"),
}


@pytest.mark.parametrize("case", list(_MALFORMED))
@pytest.mark.fast_cases(2)
def test_a_malformed_state_json_is_one_line_naming_folder_entry_and_fix(saved, tmp_path, teacher_dir, case):
    edit, message = _MALFORMED[case]
    folder = _edit(saved, tmp_path, edit)
    result = _dry_run(teacher_dir("qwen3"), folder)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"error: corpus folder {folder}: state.json"), lines[0]
    assert message in lines[0] and lines[0].endswith("save the dataset again with dataset.save_to_disk(folder)"), lines[0]
    assert not (tmp_path / "cache").exists()


def test_an_intact_saved_folder_still_builds(saved, tmp_path, teacher_dir):
    folder = tmp_path / "corpus"
    shutil.copytree(saved / "corpus", folder)
    result = _dry_run(teacher_dir("qwen3"), folder)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("target", ["/proc/self/pagemap", "/sys/kernel/mm/transparent_hugepage/enabled", "/dev/zero"])
@pytest.mark.fast_cases(1)
def test_a_jsonl_leading_into_a_kernel_folder_is_refused_unread(tmp_path, teacher_dir, target):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "chat.jsonl").write_text(json.dumps(qa_rows(1, seed=1, prefix="k-")[0]) + "\n")
    os.symlink(target, folder / "kernel.jsonl")
    result = _dry_run(teacher_dir("qwen3"), folder, timeout=90)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: corpus path {folder / 'kernel.jsonl'}") and "move it out of the corpus folder" \
        in lines[0], lines[0]
