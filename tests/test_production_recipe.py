"""The Qwen3.6-27B recipe (examples/qwen3.6-27b) and its projections (docs/production.md): both
files load through the commands' own loaders, the tapped layers are the repository's rule for a
64-layer teacher, and the doc's parameter count and disk bytes per token are recomputed from the
real drafter and a real cache built with the recipe's options at a small width."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch
import typer
from helpers import qa_rows, teacher_config, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from cli.cache import _build_config
from cli.cache import app as cache_app
from cli.train import _train_config
from dflash_build.settings.build_config import build_knobs
from dflash_cache import open_cache
from dflash_teacher.tapped_layers import default_layer_ids, resolve_layers
from dflash_train.options import train_knobs

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "qwen3.6-27b"
DOC = ROOT / "docs" / "production.md"
TEACHER_LAYERS, WIDTH, VOCAB = 64, 5120, 248_320  # Qwen3.6-27B's text_config
NODE_GPUS = 8


def recipe_build_args() -> list[str]:
    """The build options of build.sh's args=( ... ) block, as bash itself splits them (quotes,
    comments), so the test reads exactly what the script runs."""
    script = RECIPE / "build.sh"
    out = subprocess.run(["bash", "-c", 'eval "$(sed -n "/^args=(/,/^)/p" "$1")"; printf "%s\\0" "${args[@]}"',
                          "-", str(script)], capture_output=True, text=True, check=True).stdout
    args = out.split("\0")[:-1]
    assert args and args[0].startswith("--"), f"no args=( ... ) block read from {script}"
    return args


def build_config_of(args: list[str]):
    """The BuildConfig `dflash-cache build ARGS` would run with: click parses the options of the
    real command, then the command's own _build_config builds and checks the config."""
    command = typer.main.get_command(cache_app).commands["build"]
    params = command.make_context("build", list(args)).params
    # as cli.common.knob_options hands them over: a repeatable option given no time is not given
    return _build_config({k.name: params[k.name] if params[k.name] not in ([], ()) else None for k in build_knobs()})


def recipe_train_config(tmp_path):
    """The TrainConfig `dflash-train run --config train.toml --cache C --out O` trains with."""
    knob_values = {k.name: None for k in train_knobs()} | {"cache": str(tmp_path / "cache"), "out": str(tmp_path / "run")}
    return _train_config(str(RECIPE / "train.toml"), False, knob_values, [])


def doc_number(pattern: str) -> int:
    """A number the doc states in bold, e.g. **bf16: 51,717 B/token**."""
    found = re.search(pattern, DOC.read_text())
    assert found, f"docs/production.md states no {pattern!r}"
    return int(found.group(1).replace(",", ""))


def test_the_build_settings_load_as_the_build_command_loads_them_and_tap_the_rule_s_layers():
    cfg = build_config_of([*recipe_build_args(), "--data", "regenerated.jsonl", "--out", "s3://bucket/cache"])
    assert cfg.engine == "vllm" and cfg.teacher.name_or_path == "Qwen/Qwen3.6-27B"
    assert cfg.corpus.max_length >= 8192  # production answers are 2-8k tokens
    # the recipe's layers are what the repository's rule spreads over a 64-layer teacher (0-based)
    assert resolve_layers(cfg.teacher, TEACHER_LAYERS, exact_count=True) == default_layer_ids(TEACHER_LAYERS, 5)
    assert cfg.vllm.gpu_memory_utilization is not None and cfg.vllm.gpu_memory_utilization < 0.9


def test_the_train_config_loads_as_dflash_train_run_config_loads_it(tmp_path):
    cfg = recipe_train_config(tmp_path)
    assert (cfg.model.block_size, cfg.model.num_layers) == (16, 5)
    assert cfg.epochs is not None and cfg.steps is None
    assert cfg.data.batch_tokens >= 8192  # one max_length sequence fits a micro-batch
    # the doc's global batch is what the file sets on one 8-GPU node
    global_batch = NODE_GPUS * cfg.data.batch_tokens * cfg.optim.grad_accum
    assert doc_number(r"\*\*global batch: ([\d,]+) tokens\*\*") == global_batch


def test_the_doc_s_parameter_count_is_the_recipe_drafter_s(tmp_path):
    from dflash_train.training.model import DFlashDrafter, DrafterConfig

    cfg = recipe_train_config(tmp_path)
    text = dict(model_type="qwen3_5_text", vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=TEACHER_LAYERS,
                num_attention_heads=24, num_key_value_heads=4, head_dim=256, intermediate_size=17408,
                rms_norm_eps=1e-6, rope_theta=10_000_000.0, max_position_embeddings=262_144)
    # the released wrapper's nesting: the drafter reads its text settings from text_config
    drafter_cfg = DrafterConfig.from_teacher({"model_type": "qwen3_5", "text_config": text},
                                             default_layer_ids(TEACHER_LAYERS, 5), 248_077,
                                             block_size=cfg.model.block_size, num_hidden_layers=cfg.model.num_layers)
    head = torch.empty(VOCAB, WIDTH, device="meta")
    model = DFlashDrafter.build(drafter_cfg, head, head, "meta")
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert doc_number(r"\*\*([\d,]+) trained parameters\*\*") == params


@pytest.fixture(scope="module")
def deep_teacher(tmp_path_factory, tokenizer_dir):
    """A tiny hybrid qwen3_5 teacher with the production depth (64 layers, 3 Gated-DeltaNet to 1
    attention) at width 64, so the recipe's --layers resolve as on the real teacher."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = teacher_config("qwen3_5", tokenizer)
    config.num_hidden_layers = TEACHER_LAYERS
    config.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(TEACHER_LAYERS)]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("deep_teacher")
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), config.hidden_size


def measured_bytes_per_token(cache: Path) -> tuple[float, float]:
    """(stored bytes per hidden value, token-table bytes per token) of a built cache's shards,
    from the files themselves: hidden.zarr's one shard object over the rows it stores (padding of
    the last inner chunk included, as its zarr.json says), tokens.arrow over the tokens."""
    hidden_bytes = stored_values = table_bytes = tokens = 0
    for meta in sorted(cache.glob("shards/*/*/hidden.zarr/zarr.json")):
        array = json.loads(meta.read_text())
        rows, layers, width = array["shape"]
        stored_rows = array["chunk_grid"]["configuration"]["chunk_shape"][0] * math.ceil(
            rows / array["chunk_grid"]["configuration"]["chunk_shape"][0])
        hidden_bytes += sum(f.stat().st_size for f in (meta.parent / "c").rglob("*") if f.is_file())
        stored_values += stored_rows * layers * width
        table_bytes += (meta.parent.parent / "tokens.arrow").stat().st_size
        tokens += rows
    assert tokens > 1000, f"the test cache holds only {tokens} tokens"
    return hidden_bytes / stored_values, table_bytes / tokens


@pytest.mark.parametrize("hidden_format, label", [("lossless", "bf16"), ("fp8_e4m3", "fp8")])
def test_the_doc_s_disk_bytes_per_token_are_a_real_cache_s_scaled_to_the_production_width(
        tmp_path, deep_teacher, hidden_format, label):
    teacher, width = deep_teacher
    data = write_jsonl(tmp_path / "chat.jsonl", qa_rows(40, seed=5, prefix="recipe-"))
    out = tmp_path / "cache"
    # the recipe's own options; then what this machine must change: no vLLM, no GPU, the tiny teacher
    args = [*recipe_build_args(), "--engine", "transformers", "--device", "cpu", "--teacher", teacher,
            "--data", data, "--out", str(out), "--hidden-format", hidden_format, "--batch-tokens", "4096"]
    result = CliRunner().invoke(cache_app, ["build", *args, "--quiet"])
    assert result.exit_code == 0, result.output[-2000:]
    cache = open_cache(str(out))
    assert list(cache.layer_ids) == [1, 16, 31, 46, 61] and cache.top_k == 64
    per_value, table_per_token = measured_bytes_per_token(out)
    # hidden bytes grow with the width; the token tables (ids, mask, top-k, fp8 scales) do not
    projected = len(cache.layer_ids) * WIDTH * per_value + table_per_token
    stated = doc_number(rf"\*\*{label}: ([\d,]+) B/token\*\*")
    assert abs(projected - stated) / stated < 0.002, (
        f"a {width}-wide cache scaled to {WIDTH} stores {projected:,.0f} B/token; docs/production.md says {stated:,}")
