"""The import map, one room per stage, one way: stage 0 (dflash_regenerate) reads the corpus
(dflash_corpus) and runs the teacher (dflash_teacher); stage 1's build (dflash_build) reads the
corpus, runs the teacher and writes the cache (dflash_cache, teacher-free); stage 2 (dflash_train)
reads the cache and runs the teacher for evaluation; everything rests on dflash_common and cli
sits above all. No private name (a leading underscore) is imported from another package."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a package may import itself and the packages it lists, nothing else of ours
ALLOWED = {
    "dflash_common": set(),
    "dflash_teacher": {"dflash_common"},
    "dflash_corpus": {"dflash_common"},
    "dflash_cache": {"dflash_common"},
    "dflash_regenerate": {"dflash_corpus", "dflash_teacher", "dflash_common"},
    "dflash_build": {"dflash_cache", "dflash_corpus", "dflash_teacher", "dflash_common"},
    "dflash_train": {"dflash_cache", "dflash_teacher", "dflash_common"},
    "cli": {"dflash_train", "dflash_build", "dflash_regenerate", "dflash_cache", "dflash_corpus", "dflash_teacher",
            "dflash_common"},
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


def test_the_stages_keep_to_their_rooms():
    # what ALLOWED implies, said outright: the cache holds no teacher, stage 0 no cache, and
    # the corpus neither
    assert "dflash_teacher" not in ALLOWED["dflash_cache"]
    assert "dflash_cache" not in ALLOWED["dflash_regenerate"] and "dflash_build" not in ALLOWED["dflash_regenerate"]
    assert ALLOWED["dflash_corpus"] == {"dflash_common"}
    imported = {package: {module.split(".")[0] for path in (ROOT / package).rglob("*.py") for module, _, _ in imports_of(path)}
                for package in ("dflash_cache", "dflash_corpus", "dflash_regenerate")}
    assert "dflash_teacher" not in imported["dflash_cache"] | imported["dflash_corpus"]
    assert not {"dflash_cache", "dflash_build"} & imported["dflash_regenerate"]


# Folder names common tools treat as build output or tool state and skip (pytest's default
# norecursedirs, black's and ruff's default excludes; any name starting with a dot, any *.egg or
# *.egg-info): a product package or folder named so vanishes from test collection, formatting and
# the structure tools that follow the same habit (dflash_build was dflash_cache/build).
SKIPPED_NAMES = {"build", "dist", "_build", "buck-out", "venv", "node_modules", "site-packages", "__pypackages__",
                 "CVS", "_darcs", "{arch}"}


def skipped_name_problems(root: Path) -> list[str]:
    found = []
    for package in ALLOWED:
        for path in sorted([root / package, *(root / package).rglob("*")]):
            if path.is_dir() and (path.name in SKIPPED_NAMES or path.name.startswith(".")
                                 or path.name.endswith((".egg", ".egg-info"))):
                found.append(f"{path.relative_to(root)}: a folder named {path.name!r} is skipped by common tools")
    return found


def test_no_product_folder_takes_a_name_tools_skip():
    assert skipped_name_problems(ROOT) == []
    assert not set(ALLOWED) & SKIPPED_NAMES


def test_the_skipped_name_check_sees_one(tmp_path):
    (tmp_path / "dflash_cache" / "build").mkdir(parents=True)
    (tmp_path / "dflash_cache" / "build" / "pipeline.py").write_text("")
    assert skipped_name_problems(tmp_path) == ["dflash_cache/build: a folder named 'build' is skipped by common tools"]


def test_the_check_sees_a_wrong_way_import(tmp_path, monkeypatch):
    fake = tmp_path / "dflash_cache"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from dflash_train.training.trainer import train\n    from dflash_common.errors import _hidden\n")
    for package in ALLOWED:
        if package != "dflash_cache":
            (tmp_path / package).mkdir()
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert problems() == ["dflash_cache/bad.py:2 imports dflash_train.training.trainer: dflash_cache may not import dflash_train",
                          "dflash_cache/bad.py:3 imports the private dflash_common.errors._hidden"]


# The settings sit at the bottom of dflash_train: the implementation modules import them, never the
# reverse, and they load none of the heavy libraries, so the command lines read and check settings
# (and print --help) without loading torch.
# A settings folder, and the config modules outside it that its settings may import.
SETTINGS = {"dflash_train/settings": (), "dflash_cache/settings": (), "dflash_regenerate/settings": (),
            "dflash_teacher/settings": (), "dflash_corpus/settings": (), "dflash_build/settings": ()}
HEAVY = ("torch", "zarr", "pyarrow", "ml_dtypes")


def settings_problems() -> list[str]:
    found = []
    for folder, also in SETTINGS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module, _, line in imports_of(path):
                where = f"{path.relative_to(ROOT)}:{line}"
                top = module.split(".")[0]
                if top in HEAVY:
                    found.append(f"{where} imports {module}: settings load no {', '.join(HEAVY)}")
                elif (top in ALLOWED and top != "dflash_common" and module not in also
                      and not any(module.startswith(other.replace("/", ".")) for other in SETTINGS)):
                    found.append(f"{where} imports {module}: settings import only settings and dflash_common")
    return found


def heavy_modules_loaded(module: str) -> list[str]:
    """The HEAVY libraries that importing `module` loads, in a fresh interpreter."""
    code = f"import sys, {module}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_settings_import_only_settings_and_nothing_heavy():
    assert settings_problems() == []


def test_the_settings_check_sees_an_implementation_import(tmp_path, monkeypatch):
    fake = tmp_path / "dflash_train" / "settings"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("import torch\nfrom dflash_train.settings.loss_config import LossConfig\n"
                                 "def f():\n    from dflash_train.training.model import DFlashDrafter\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert settings_problems() == [
        "dflash_train/settings/bad.py:1 imports torch: settings load no torch, zarr, pyarrow, ml_dtypes",
        "dflash_train/settings/bad.py:4 imports dflash_train.training.model: settings import only settings and dflash_common"]


def test_the_command_lines_load_no_heavy_library():
    assert heavy_modules_loaded("cli.train") == []
    assert heavy_modules_loaded("cli.cache") == []
    assert heavy_modules_loaded("dflash_build.settings.build_config") == []
    assert heavy_modules_loaded("dflash_corpus.settings.corpus_config") == []
    assert heavy_modules_loaded("dflash_teacher.settings.vllm_args") == []
    # the same check sees torch where a module does load it
    assert "torch" in heavy_modules_loaded("dflash_train.training.model")


# Inside dflash_train, one way too, bottom to top: the settings sections, the config that composes
# them, the field tables of the command lines (options), what trains a drafter (training/), what
# measures one (measuring/: it loads and evaluates what training made), and the sweep, which does
# both. A part imports itself and the parts below it, never one above.
PARTS = ("settings", "config", "options", "training", "measuring", "sweep")


def part_of(module: str) -> str | None:
    """The part of dflash_train a dotted module name belongs to (None for other packages)."""
    pieces = module.split(".")
    return pieces[1] if pieces[0] == "dflash_train" and len(pieces) > 1 and pieces[1] in PARTS else None


def parts_problems() -> list[str]:
    found = []
    for path in sorted((ROOT / "dflash_train").rglob("*.py")):
        relative = path.relative_to(ROOT)
        here = part_of(".".join(relative.with_suffix("").parts))
        if here is None:  # dflash_train/__init__.py
            continue
        for module, _, line in imports_of(path):
            there = part_of(module)
            if there is not None and PARTS.index(there) > PARTS.index(here):
                found.append(f"{relative}:{line} imports {module}: dflash_train.{here} may not import dflash_train.{there}")
    return found


def test_dflash_train_parts_import_downward_only():
    assert parts_problems() == []


def test_every_dflash_train_module_is_in_a_part():
    # a new top-level module must be placed in the map (PARTS), not left beside it
    modules = {p.stem if p.is_file() else p.name for p in (ROOT / "dflash_train").iterdir()
               if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name != "__init__.py"}
    assert modules == set(PARTS)


def test_the_parts_check_sees_an_upward_import(tmp_path, monkeypatch):
    for part in ("training", "measuring"):
        (tmp_path / "dflash_train" / part).mkdir(parents=True)
    (tmp_path / "dflash_train" / "training" / "bad.py").write_text(
        "from dflash_train.training.model import DFlashDrafter\n"
        "def f():\n    from dflash_train.measuring.replay import greedy_replay\n"
        "    from dflash_train.sweep import run_sweep\n")
    (tmp_path / "dflash_train" / "measuring" / "fine.py").write_text("from dflash_train.training.data import Batch\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert parts_problems() == [
        "dflash_train/training/bad.py:3 imports dflash_train.measuring.replay: "
        "dflash_train.training may not import dflash_train.measuring",
        "dflash_train/training/bad.py:4 imports dflash_train.sweep: dflash_train.training may not import dflash_train.sweep"]


# One home per name: a file name says what one module holds, so no two product modules share one
# (a newcomer looking for loss.py finds one), and every config section (a *Config class) is in a
# settings/ folder, where sections are looked for.
def module_name_problems() -> list[str]:
    homes: dict[str, list[str]] = {}
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name != "__init__.py":
                homes.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    return [f"{name} names {len(paths)} modules: {', '.join(paths)}" for name, paths in sorted(homes.items()) if len(paths) > 1]


def config_home_problems() -> list[str]:
    found = []
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and node.name.endswith("Config") and "settings" not in path.parts:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} defines {node.name} outside a settings/ folder")
    return found


def test_module_names_are_distinct_and_configs_live_in_settings():
    assert module_name_problems() == []
    assert config_home_problems() == []


def test_the_name_checks_see_a_shared_name_and_a_stray_config(tmp_path, monkeypatch):
    for folder in ("dflash_cache/settings", "dflash_train/training", "dflash_train/settings", "cli"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "dflash_train/training/loss.py").write_text("class LossConfig:\n    pass\n")
    (tmp_path / "dflash_train/settings/loss.py").write_text("class NoiseConfig:\n    pass\n")
    (tmp_path / "dflash_cache/settings/__init__.py").write_text("")
    (tmp_path / "cli/__init__.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert module_name_problems() == ["loss.py names 2 modules: dflash_train/settings/loss.py, dflash_train/training/loss.py"]
    assert config_home_problems() == ["dflash_train/training/loss.py:1 defines LossConfig outside a settings/ folder"]


# No import cycle among product modules, counting imports inside functions and under
# TYPE_CHECKING: each module can be read knowing only the ones below it.
def module_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the product modules it imports (``from p import m`` counts as m when m is a module)."""
    paths = {module_of(p, root): p for package in ALLOWED for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        targets = set()
        for imported, names, _ in imports_of(path):
            subs = [f"{imported}.{name}" for name in names if f"{imported}.{name}" in paths]
            targets |= set(subs) or ({imported} if imported in paths else set())
        graph[module] = targets - {module}
    return graph


def import_cycles(root: Path) -> list[list[str]]:
    """Every cycle of the import graph found by a depth-first walk (one per strongly connected part)."""
    graph, state, found, stack = import_graph(root), {}, [], []

    def visit(module: str) -> None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def test_no_import_cycle_among_product_modules():
    assert import_cycles(ROOT) == []


def test_the_cycle_check_sees_a_lazy_and_a_type_checking_cycle(tmp_path):
    (tmp_path / "dflash_cache").mkdir()
    (tmp_path / "dflash_cache" / "a.py").write_text("def f():\n    from dflash_cache import b\n")
    (tmp_path / "dflash_cache" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                    "    from dflash_cache.a import f\n")
    assert import_cycles(tmp_path) == [["dflash_cache.a", "dflash_cache.b", "dflash_cache.a"]]


# Stage 2 reaches the cache through its public face: at most two modules of dflash_cache.
def stage2_cache_modules() -> set[str]:
    return {module for path in (ROOT / "dflash_train").rglob("*.py") for module, _, _ in imports_of(path)
            if module.split(".")[0] == "dflash_cache"}


def test_stage2_imports_the_cache_through_its_face():
    assert len(stage2_cache_modules()) <= 2, sorted(stage2_cache_modules())


# Files and functions a reader can hold in mind: no product file over 500 lines, no function over 60.
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 60


def size_problems(root: Path) -> list[str]:
    found = []
    for package in ALLOWED:
        for path in sorted((root / package).rglob("*.py")):
            text, where = path.read_text(), path.relative_to(root)
            if text.count("\n") > MAX_FILE_LINES:
                found.append(f"{where}: {text.count(chr(10))} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    return found


def test_files_and_functions_stay_short():
    assert size_problems(ROOT) == []


def test_the_size_check_sees_a_long_function_and_file(tmp_path):
    (tmp_path / "cli").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    (tmp_path / "cli" / "long.py").write_text("def f():\n" + body + "\n" * 440)
    assert size_problems(tmp_path) == ["cli/long.py: 501 lines", "cli/long.py:1 f: 61 lines"]


# vLLM runs dflash_train/measuring/vllm_worker.py and dflash_teacher's vllm_extract scripts with their
# own folder first on sys.path, so a module of ours named like a standard one (statistics.py did)
# is what vLLM's own `import statistics` finds: no product module may take a standard module's name.
def stdlib_name_problems(root: Path) -> list[str]:
    return [f"{path.relative_to(root)} takes the name of the standard module {path.stem}"
            for package in ALLOWED for path in sorted((root / package).rglob("*.py"))
            if path.stem in sys.stdlib_module_names]


def test_no_product_module_shadows_a_standard_module():
    assert stdlib_name_problems(ROOT) == []


def test_the_shadow_check_sees_one(tmp_path):
    (tmp_path / "dflash_train" / "measuring").mkdir(parents=True)
    (tmp_path / "dflash_train" / "measuring" / "statistics.py").write_text("")
    assert stdlib_name_problems(tmp_path) == [
        "dflash_train/measuring/statistics.py takes the name of the standard module statistics"]


# The write side reaches storage through the store, as the read side does: no function outside
# dflash_cache/format/store.py takes a file system and a root (or a URL) loose; it takes a CacheStore.
LOOSE_STORAGE = ({"fs", "root"}, {"fs", "url"})


def loose_storage_problems(root: Path) -> list[str]:
    found = []
    for package in ALLOWED:
        for path in sorted((root / package).rglob("*.py")):
            if path.relative_to(root).as_posix() == "dflash_cache/format/store.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names = {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
                    if any(pair <= names for pair in LOOSE_STORAGE):
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} takes fs and a root: take a CacheStore")
    return found


def test_no_function_outside_the_store_takes_a_file_system_and_a_root():
    assert loose_storage_problems(ROOT) == []


def test_the_storage_check_sees_a_loose_file_system(tmp_path):
    (tmp_path / "dflash_build").mkdir()
    (tmp_path / "dflash_build" / "bad.py").write_text("def write(fs, root, data):\n    pass\n\n\ndef fine(store, data):\n    pass\n")
    (tmp_path / "dflash_cache" / "format").mkdir(parents=True)
    (tmp_path / "dflash_cache" / "format" / "store.py").write_text("def regular_file(fs, root, path, url):\n    pass\n")
    assert loose_storage_problems(tmp_path) == ["dflash_build/bad.py:1 write takes fs and a root: take a CacheStore"]
