"""A production-shaped run on CPU (`make prod-shape`): a random qwen3_5 teacher with the production
width, heads and vocabulary (hidden 5120, 24/4 heads of 256, MLP 17,408, vocab 248,320, the
multimodal wrapper's text_config nesting) but 3 decoder layers, through build, training steps with
the production recipe's train settings (examples/qwen3.6-27b/train.toml, reduced to fit a CPU),
export and speculative decoding. Tiny teachers cannot show shape, dtype and memory mistakes at this
width. About 20 minutes and a 19 GB peak of memory on 2 cores (measured before the recipe: 21.7 min,
19.2 GiB RSS)."""

from __future__ import annotations

import json
import resource
import tomllib
from pathlib import Path

import pytest
import torch
from helpers import english_like_sentences, write_jsonl
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from cli.cache import app as cache_app
from cli.train import app as train_app
from dflash_cache import open_cache

pytestmark = pytest.mark.prodshape

VOCAB = 248_320
RECIPE_TRAIN = Path(__file__).resolve().parents[1] / "examples" / "qwen3.6-27b" / "train.toml"


def production_teacher_config():
    from transformers import Qwen3_5Config

    return Qwen3_5Config(text_config=dict(
        vocab_size=VOCAB, hidden_size=5120, num_hidden_layers=3, num_attention_heads=24, num_key_value_heads=4,
        head_dim=256, intermediate_size=17408, max_position_embeddings=4096, tie_word_embeddings=False,
        layer_types=["linear_attention", "linear_attention", "full_attention"], linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    ))


def _ok(result):
    assert result.exit_code == 0, result.output[-3000:]
    return result.output


@pytest.mark.timeout(2400)
def test_production_width_build_train_export_decode(tmp_path, tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = production_teacher_config()
    config.text_config.pad_token_id = tokenizer.pad_token_id
    config.text_config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    teacher = tmp_path / "teacher"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    del model
    # the released checkpoints nest the language model's settings in text_config under the
    # multimodal model_type; save_pretrained writes the flat text config, so nest it back
    text = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForCausalLM"], "tie_word_embeddings": False,
        "text_config": {k: v for k, v in text.items() if k not in ("architectures", "transformers_version")},
    }))
    assert AutoConfig.from_pretrained(teacher).model_type == "qwen3_5"  # the wrapper, as released

    # few tokens: a bf16 forward at this width is slow on a CPU, and shapes do not need volume
    sentences = english_like_sentences(16, seed=3)
    rows = [{"id": f"row-{i:03d}", "messages": [{"role": "user", "content": sentences[2 * i]},
                                                {"role": "assistant", "content": sentences[2 * i + 1]}]}
            for i in range(8)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    cache = tmp_path / "cache"
    _ok(CliRunner().invoke(cache_app, ["build", "--teacher", str(teacher), "--data", data, "--out", str(cache),
                                       "--layers", "0,1", "--top-k", "64", "--dtype", "bfloat16", "--device", "cpu",
                                       "--batch-tokens", "1024", "--logits-chunk", "256"]))
    opened = open_cache(str(cache))
    assert opened.hidden_size == 5120 and opened.top_k == 64 and opened.hidden_dtype == "bfloat16"
    record = next(iter(opened.sequences()))
    assert record.topk_ids.max() < VOCAB and (record.topk_logprobs <= 0).all()

    run = tmp_path / "run"
    # the production recipe's train settings (examples/qwen3.6-27b/train.toml: block size, loss,
    # head precision, ...) at the teacher's width and heads, reduced where a CPU must: at most 5
    # drafter layers and the MLP narrowed so that fp32 weights, gradients and AdamW state fit a
    # 24 GB machine (at 17,408 they need ~30 GB), 2 steps of 256-token batches without
    # accumulation (grad_accum changes no shape, and each micro-batch costs minutes here)
    recipe = tomllib.loads(RECIPE_TRAIN.read_text())
    layers = min(recipe["model"]["num_layers"], 5)
    _ok(CliRunner().invoke(train_app, ["run", "--config", str(RECIPE_TRAIN), "--cache", str(cache), "--out", str(run),
                                       "--steps", "2", "--batch-tokens", "256", "--grad-accum", "1",
                                       "--heldout-fraction", "0.1", "--eval-sequences", "0", "--log-every", "1",
                                       "--device", "cpu", "--set", f"model.num_layers={layers}",
                                       "--set", "model.intermediate_size=1024", "--quiet"]))
    exported = json.loads((run / "drafter" / "config.json").read_text())
    assert (exported["hidden_size"], exported["num_hidden_layers"], exported["num_attention_heads"],
            exported["num_key_value_heads"], exported["head_dim"], exported["vocab_size"]) == (5120, layers, 24, 4, 256, VOCAB)
    assert exported["block_size"] == recipe["model"]["block_size"]
    assert exported["dflash_config"]["target_layer_ids"] == [0, 1] and exported["num_target_layers"] == 3
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["loss"] == m["loss"] for m in metrics if m.get("kind") == "train")

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": [{"role": "user", "content": sentences[0]}]}])
    report = tmp_path / "eval.json"
    _ok(CliRunner().invoke(train_app, ["eval", "--checkpoint", str(run / "drafter"), "--teacher", str(teacher),
                                       "--prompts", prompts, "--max-new-tokens", "12", "--device", "cpu",
                                       "--teacher-dtype", "bfloat16", "--out", str(report), "--quiet"]))
    decoding = json.loads(report.read_text())["decoding"]
    assert decoding["matched_teacher"] and decoding["accepted_length"] >= 1
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {peak_gib:.1f} GiB")
