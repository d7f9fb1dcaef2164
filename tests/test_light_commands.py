"""`dflash-cache info` and `verify` read a cache without torch or transformers: they run where only
the format's own libraries are (a storage node, a CI job), and start in a fraction of the time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# runs a command of cli.cache in this interpreter and prints, last, the heavy libraries it loaded
PROBE = """
import sys
from cli.cache import app
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print(json.dumps(sorted(m for m in ("torch", "transformers") if m in sys.modules)))
"""


def heavy_loaded(*args: str) -> tuple[list[str], str]:
    done = subprocess.run([sys.executable, "-c", "import json\n" + PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout + done.stderr


@pytest.mark.parametrize("version,hidden_format", [(1, "lossless"), (2, "lossless"), (2, "fp8_e4m3")])
def test_info_and_verify_load_neither_torch_nor_transformers(tiny_cache, tmp_path, version, hidden_format):
    from dflash_build import BuildConfig, build_cache
    from dflash_cache.settings.storage_config import StorageConfig
    from dflash_corpus import CorpusConfig
    from dflash_teacher.teacher import TeacherConfig

    if hidden_format == "lossless":
        cache = tiny_cache(format_version=version)
    else:  # an fp8 cache: verify decodes its codes' NaN marks and checks its scales
        source = json.loads((Path(tiny_cache()) / "manifest.json").read_text())["build"]
        cache = str(tmp_path / "fp8")
        build_cache(BuildConfig(out=cache, corpus=CorpusConfig(data=source["corpus"]["data"]),
                                teacher=TeacherConfig(name_or_path=source["teacher"]["name_or_path"], layers=(0, 2), top_k=6),
                                storage=StorageConfig(hidden_format=hidden_format, shard_bytes=20_000)))
    loaded, output = heavy_loaded("info", cache)
    assert loaded == [] and "sequences" in output, output
    loaded, output = heavy_loaded("verify", cache, "--quiet")
    assert loaded == [] and "ok:" in output, output
    # the probe sees what it looks for: reading a cache's head as tensors loads torch
    done = subprocess.run([sys.executable, "-c", f"import sys\nfrom dflash_cache import open_cache\n"
                           f"open_cache({cache!r}).load_teacher_head()\nprint('torch' in sys.modules)"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "True", done.stderr[-2000:]
