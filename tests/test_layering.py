"""The import map: cli -> dflash_train / dflash_regenerate -> dflash_cache -> dflash_common, one way,
and no private name (a leading underscore) imported from another package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a package may import itself and the packages it lists, nothing else of ours
ALLOWED = {
    "dflash_common": set(),
    "dflash_cache": {"dflash_common"},
    "dflash_regenerate": {"dflash_cache", "dflash_common"},
    "dflash_train": {"dflash_cache", "dflash_common"},
    "cli": {"dflash_train", "dflash_regenerate", "dflash_cache", "dflash_common"},
}


def imports_of(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) of every import in a file, at any depth (lazy imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
    return found


def problems() -> list[str]:
    found = []
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            for module, names, line in imports_of(path):
                target = module.split(".")[0]
                if target not in ALLOWED or target == package:
                    continue
                where = f"{path.relative_to(ROOT)}:{line}"
                if target not in ALLOWED[package]:
                    found.append(f"{where} imports {module}: {package} may not import {target}")
                found += [f"{where} imports the private {module}.{name}" for name in names if name.startswith("_")]
    return found


def test_imports_go_one_way_and_private_names_stay_home():
    assert problems() == []


def test_the_check_sees_a_wrong_way_import(tmp_path, monkeypatch):
    fake = tmp_path / "dflash_cache"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from dflash_train.trainer import train\n    from dflash_common.errors import _hidden\n")
    for package in ALLOWED:
        if package != "dflash_cache":
            (tmp_path / package).mkdir()
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert problems() == ["dflash_cache/bad.py:2 imports dflash_train.trainer: dflash_cache may not import dflash_train",
                          "dflash_cache/bad.py:3 imports the private dflash_common.errors._hidden"]
