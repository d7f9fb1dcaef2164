"""Export: an independent loader built from the documented names reproduces the drafter's logits."""

import json
import math
import os
import stat

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash_common.errors import ConfigError
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.training.export import ExportError, export_drafter, load_drafter
from dflash_train.training.model import DFlashDrafter

HIDDEN, VOCAB = 64, 97


def make_model(**overrides):
    fields = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, vocab_size=VOCAB, mask_token_id=VOCAB - 1, target_layer_ids=(0, 2),
                  num_target_layers=4, num_hidden_layers=2, block_size=4, rope_theta=5000.0, rms_norm_eps=1e-5)
    fields.update(overrides)
    cfg = DrafterConfig(**fields)
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.1
    torch.manual_seed(0)
    model = DFlashDrafter(cfg, embed, lm_head).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def documented_names(num_layers):
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
        names |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    return names


def plain_block_logits(export_dir, embed, lm_head, context_hidden, block_ids):
    """Inference forward of one block written only from config.json, the tensor names and docs/design.md.

    context_hidden [a, n_layers, H] holds positions 0..a-1; block_ids [B] sits at a..a+B-1.
    """
    cfg = json.loads((export_dir / "config.json").read_text())
    w = load_file(str(export_dir / "model.safetensors"))
    w = {k: v.float() for k, v in w.items()}
    eps, theta, d = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    a, b = context_hidden.shape[0], block_ids.shape[0]

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x, pos):  # x [S, heads, D]
        freqs = pos[:, None].float() / theta ** (torch.arange(0, d, 2).float() / d)
        cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None], torch.cat([freqs.sin()] * 2, -1)[:, None]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin

    ctx = rms(context_hidden.reshape(a, -1) @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = embed[block_ids]
    q_pos, kv_pos = torch.arange(a, a + b), torch.arange(a + b)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rope(rms((h @ w[p + "self_attn.q_proj.weight"].T).view(b, nh, d), w[p + "self_attn.q_norm.weight"]), q_pos)
        both = torch.cat([ctx, h])
        k = (both @ w[p + "self_attn.k_proj.weight"].T).view(a + b, nkv, d)
        k = rope(rms(k, w[p + "self_attn.k_norm.weight"]), kv_pos).repeat_interleave(nh // nkv, 1)
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(a + b, nkv, d).repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        if cfg["layer_types"][i] == "sliding_attention":
            # sliding layers: windowed and causal (inside the block too), as vLLM and SGLang run them
            hidden_key = (kv_pos[None, :] <= q_pos[:, None] - cfg["sliding_window"]) | (kv_pos[None, :] > q_pos[:, None])
            scores = scores.masked_fill(hidden_key, -math.inf)
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(b, nh * d)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"]) @ lm_head.T


@pytest.mark.parametrize("overrides", [{}, dict(layer_types=("sliding_attention", "full_attention"), sliding_window=5)])
def test_plain_loader_reproduces_model_logits(tmp_path, overrides):
    model = make_model(**overrides)
    out = export_drafter(model, tmp_path / "drafter", dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    context = torch.randn(9, 2, HIDDEN, generator=gen)
    block = torch.tensor([5] + [VOCAB - 1] * 3)
    with torch.no_grad():
        want = model.logits(model.forward_block(context[None], block[None]))[0]
    got = plain_block_logits(out, model.embed_weight, model.lm_head_weight, context, block)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_export_files_and_config(tmp_path):
    model = make_model(layer_types=("full_attention", "sliding_attention"), sliding_window=6)
    out = export_drafter(model, tmp_path / "drafter")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["drafter"]  # no staging folder left behind

    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == documented_names(2)
    assert not any("embed" in k or "lm_head" in k for k in tensors)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    expected = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=96, vocab_size=VOCAB, rope_theta=5000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, block_size=4, num_target_layers=4,
                    layer_types=["full_attention", "sliding_attention"], sliding_window=6)
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["max_position_embeddings"] > 0
    assert cfg["dflash_config"]["mask_token_id"] == VOCAB - 1
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2]
    assert cfg["dtype"] == "bfloat16"

    # transformers reads it as a Qwen3 config with the same rotary base and window.
    qwen = Qwen3Config.from_dict(cfg)
    assert qwen.rope_parameters["rope_theta"] == 5000.0
    assert list(qwen.layer_types) == ["full_attention", "sliding_attention"] and qwen.sliding_window == 6

    no_slide = json.loads((export_drafter(make_model(), tmp_path / "plain") / "config.json").read_text())
    assert "sliding_window" not in no_slide and no_slide["layer_types"] == ["full_attention"] * 2


def test_load_drafter_round_trip_and_overwrite(tmp_path):
    model = make_model()
    out = export_drafter(model, tmp_path / "drafter")
    loaded = load_drafter(out, model.embed_weight, model.lm_head_weight, dtype=torch.float32)
    assert loaded.cfg == model.cfg
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value.to(torch.bfloat16).float()), name

    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    export_drafter(model, out, dtype=torch.float32)
    again = load_drafter(out, model.embed_weight, model.lm_head_weight, dtype=torch.float32)
    assert torch.equal(again.state_dict()["fc.weight"], model.state_dict()["fc.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def test_export_refuses_to_replace_a_foreign_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a drafter export .it holds 'notes.txt'.; choose a new or empty folder"):
        export_drafter(make_model(), tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    # a model's config.json is not ours either, though an export writes a file of that name
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(ConfigError, match="it holds a config.json that is not an export's.; choose a new"):
        export_drafter(make_model(), model)
    assert [p.name for p in model.iterdir()] == ["config.json"]
    assert (model / "config.json").read_text() == '{"model_type": "qwen3"}'
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        export_drafter(make_model(), tmp_path / "notes.txt")


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_exported_files_get_a_plain_writes_mode(tmp_path, umask):
    """safetensors alone creates its file 0o600: a server run as another user could not read it."""
    old = os.umask(umask)
    try:
        out = export_drafter(make_model(), tmp_path / "drafter")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == {"config.json": 0o666 & ~umask, "model.safetensors": 0o666 & ~umask}


def broken_exports(tmp_path, model):
    def fresh(name):
        return export_drafter(model, tmp_path / name, dtype=torch.float32)

    def rewrite(folder, edit):
        tensors = load_file(str(folder / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(folder / "model.safetensors"))
        return folder

    no_config = fresh("no_config")
    (no_config / "config.json").unlink()
    no_weights = fresh("no_weights")
    (no_weights / "model.safetensors").unlink()
    bad_json = fresh("bad_json")
    (bad_json / "config.json").write_text("{not json")
    no_dflash = fresh("no_dflash")
    cfg = json.loads((no_dflash / "config.json").read_text())
    del cfg["dflash_config"]
    (no_dflash / "config.json").write_text(json.dumps(cfg))
    corrupt = fresh("corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    return [
        (no_config, "config.json is missing"),
        (no_weights, "model.safetensors is missing"),
        (bad_json, "config.json is not valid JSON"),
        (no_dflash, "no 'dflash_config'"),
        (corrupt, "not a readable safetensors"),
        (rewrite(fresh("missing"), lambda t: t.pop("layers.1.mlp.up_proj.weight")),
         "lacks tensor 'layers.1.mlp.up_proj.weight'"),
        (rewrite(fresh("extra"), lambda t: t.update({"embed_tokens.weight": torch.zeros(VOCAB, HIDDEN)})),
         "has tensor 'embed_tokens.weight', which a drafter of that config lacks"),
        (rewrite(fresh("shape"), lambda t: t.update({"fc.weight": torch.zeros(HIDDEN, HIDDEN)})),
         r"does not match config.json beside it: tensor 'fc.weight' has shape \(64, 64\), the config implies \(64, 128\)"),
    ]


def test_bad_export_folders_raise_export_error(tmp_path):
    model = make_model()
    for folder, message in broken_exports(tmp_path, model):
        with pytest.raises(ExportError, match=message) as info:
            load_drafter(folder, model.embed_weight, model.lm_head_weight)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("dspark", [False, True])
def test_an_earlier_export_of_either_kind_is_replaced(tmp_path, dspark):
    """A DSpark export names DSparkDraftModel: exporting again (a resumed run, `export` twice) must
    see it as ours, as a DFlash export is."""
    from dflash_train.settings.dspark_config import DSparkConfig

    model = make_model(dspark=DSparkConfig(markov_rank=8) if dspark else None)
    out = export_drafter(model, tmp_path / "drafter")
    again = export_drafter(model, tmp_path / "drafter")
    assert again == out and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "DSparkDraftModel" if dspark else "DFlashDraftModel"]
