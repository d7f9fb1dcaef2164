"""The teacher read from its safetensors files by name (teacher_files, teacher.load_text_head): what
a vLLM build holds of the teacher, the identity both engines record, vision-language layouts, tied
embeddings, resuming a cache hashed the old way, and the build process's memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers import build_teacher, qa_rows, write_jsonl
from typer.testing import CliRunner

from cli.cache import app as cache_app
from dflash_common.errors import TeacherError
from dflash_teacher.settings.teacher_config import TeacherConfig
from dflash_teacher.teacher import (
    IDENTITY_SOURCE,
    final_norm,
    identity_like,
    legacy_weights_hash,
    load_teacher,
    load_text_head,
)
from dflash_teacher.teacher_files import stored_tensors, weights_hash

ROOT = Path(__file__).resolve().parents[1]


def _same_head(folder: str, reference: str, dtype: str = "float32"):
    head, identity = load_text_head(TeacherConfig(name_or_path=folder, dtype=dtype), torch.device("cpu"))
    model = load_teacher(TeacherConfig(name_or_path=reference, dtype=dtype, device="cpu")).model
    states = torch.randn(5, model.config.get_text_config().hidden_size)
    torch.testing.assert_close(head.norm(states), final_norm(model)(states), rtol=0, atol=0)
    torch.testing.assert_close(head.get_output_embeddings().weight, model.get_output_embeddings().weight, rtol=0, atol=0)
    torch.testing.assert_close(head.get_input_embeddings().weight, model.get_input_embeddings().weight, rtol=0, atol=0)
    return head, identity


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_the_head_read_by_name_is_the_loaded_teachers_and_both_engines_share_its_identity(arch, tmp_path, tokenizer_dir):
    folder = build_teacher(tmp_path / arch, arch, tokenizer_dir)
    _head, identity = _same_head(folder, folder)
    loaded = load_teacher(TeacherConfig(name_or_path=folder, dtype="float32", device="cpu"))
    assert identity == loaded.identity and identity["weights_hash_of"] == IDENTITY_SOURCE
    # the hash is the files': the build dtype does not change it, a changed weight does
    assert load_text_head(TeacherConfig(name_or_path=folder), torch.device("cpu"))[1]["weights_hash"] == identity["weights_hash"]
    tensors = safetensors.torch.load_file(Path(folder) / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    safetensors.torch.save_file(tensors, Path(folder) / "model.safetensors", metadata={"format": "pt"})
    assert weights_hash(stored_tensors(Path(folder))) != identity["weights_hash"]


def test_a_vision_language_layout_and_tied_embeddings_are_read_by_name(tmp_path, tokenizer_dir):
    folder = Path(build_teacher(tmp_path / "text", "qwen3_5", tokenizer_dir))
    tensors = safetensors.torch.load_file(folder / "model.safetensors")
    # Qwen3.5/3.6 checkpoints: the text model under model.language_model., a vision tower beside it
    vl = tmp_path / "vl"
    vl.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (folder / name).exists():
            (vl / name).write_bytes((folder / name).read_bytes())
    renamed = {name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: t
               for name, t in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    half = len(renamed) // 2  # split over two files with an index, as large checkpoints are
    names = sorted(renamed)
    safetensors.torch.save_file({n: renamed[n] for n in names[:half]}, vl / "model-00001-of-00002.safetensors")
    safetensors.torch.save_file({n: renamed[n] for n in names[half:]}, vl / "model-00002-of-00002.safetensors")
    (vl / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        n: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, n in enumerate(names)}}))
    _same_head(str(vl), str(folder))

    # tied embeddings: no lm_head.weight in the files, the head is the embedding
    config = json.loads((folder / "config.json").read_text())
    tied = tmp_path / "tied"
    tied.mkdir()
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    (tied / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    safetensors.torch.save_file({n: t for n, t in tensors.items() if n != "lm_head.weight"}, tied / "model.safetensors")
    head, _ = load_text_head(TeacherConfig(name_or_path=str(tied), dtype="float32"), torch.device("cpu"))
    torch.testing.assert_close(head.lm_head.weight, tensors["model.embed_tokens.weight"], rtol=0, atol=0)

    # untied without a head: one line naming it
    config_untied = tmp_path / "nohead"
    config_untied.mkdir()
    (config_untied / "config.json").write_text(json.dumps(config))
    safetensors.torch.save_file({n: t for n, t in tensors.items() if n != "lm_head.weight"}, config_untied / "model.safetensors")
    with pytest.raises(TeacherError, match="no lm_head.weight"):
        load_text_head(TeacherConfig(name_or_path=str(config_untied)), torch.device("cpu"))


def test_a_cache_hashed_the_old_way_resumes_with_the_transformers_engine_and_the_vllm_engine_says_why(tmp_path, teacher_dir):
    from dflash_teacher.vllm_engine import VllmTeacher

    folder = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", qa_rows(12, seed=3, prefix="old-"))
    out = tmp_path / "cache"
    args = ["build", "--teacher", folder, "--data", data, "--out", str(out), "--shard-size", "20kB", "--quiet",
            "--dtype", "float32", "--layers", "1,2"]
    first = CliRunner().invoke(cache_app, args)
    assert first.exit_code == 0, first.output
    manifest = json.loads((out / "manifest.json").read_text())
    teacher = load_teacher(TeacherConfig(name_or_path=folder, dtype="float32", device="cpu", layers=(1, 2)))
    old = dict(manifest["teacher"], weights_hash=legacy_weights_hash(teacher.model))
    old.pop("weights_hash_of")
    (out / "manifest.json").write_text(json.dumps({**manifest, "teacher": old}))
    rerun = CliRunner().invoke(cache_app, args)
    assert rerun.exit_code == 0, rerun.output
    assert json.loads((out / "manifest.json").read_text())["teacher"]["weights_hash"] == old["weights_hash"]

    head, identity = load_text_head(TeacherConfig(name_or_path=folder), torch.device("cpu"))
    vllm_side = VllmTeacher(cfg=teacher.cfg, model=head, tokenizer=teacher.tokenizer, layer_ids=teacher.layer_ids,
                            device=torch.device("cpu"), identity=identity)
    assert identity_like(vllm_side, manifest["teacher"]) == identity  # new caches: the file hash
    with pytest.raises(TeacherError, match="--engine transformers"):
        identity_like(vllm_side, old)


PEAK = """
import json, sys, torch
from dflash_teacher.settings.teacher_config import TeacherConfig
from dflash_teacher.teacher import load_teacher, load_text_head

def peak():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024

before = peak()
cfg = TeacherConfig(name_or_path=sys.argv[1], dtype="bfloat16", device="cpu")  # a copy of the fp32 files
if sys.argv[2] == "head":
    head, identity = load_text_head(cfg, torch.device("cpu"))
    head.get_input_embeddings()  # what the frozen teacher files read, once
else:
    load_teacher(cfg)
print(json.dumps({"before": before, "after": peak()}))
"""


@pytest.mark.slow
def test_the_vllm_builds_process_never_holds_the_whole_teacher(tmp_path, tokenizer_dir):
    from helpers import teacher_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = teacher_config("qwen3", tokenizer)
    config.num_hidden_layers, config.intermediate_size, config.hidden_size = 12, 4096, 512  # ~300 MB of layers
    config.head_dim, config.layer_types = 64, ["full_attention"] * 12
    folder = tmp_path / "big"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    weights = (folder / "model.safetensors").stat().st_size
    grown = {}
    for what in ("head", "whole"):
        out = subprocess.run([sys.executable, "-c", PEAK, str(folder), what], capture_output=True, text=True, cwd=ROOT,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        peak = json.loads(out.stdout)
        grown[what] = peak["after"] - peak["before"]
    # the whole teacher in bf16 is half the fp32 files; the head pieces are ~1% of them
    assert grown["whole"] - grown["head"] > 0.35 * weights, (grown, weights)
