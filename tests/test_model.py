"""The drafter: mask semantics, training path == inference path, config derivation, MASK token."""

import warnings

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, PreTrainedTokenizerFast, Qwen3_5Config, Qwen3_5TextConfig, Qwen3Config

from dflash_common.errors import ConfigError
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.training.mask_token import mask_token_text, resolve_mask_token_id
from dflash_train.training.model import DFlashDrafter, block_attention_mask

HIDDEN = 64
VOCAB = 97
LAYER_IDS = (1, 3)


def make_cfg(**overrides):
    fields = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, vocab_size=VOCAB, mask_token_id=VOCAB - 1, target_layer_ids=LAYER_IDS,
                  num_target_layers=5, num_hidden_layers=2, block_size=4, rope_theta=10000.0,
                  max_position_embeddings=256)
    fields.update(overrides)
    return DrafterConfig(**fields)


def make_model(cfg=None, seed=0, backend="sdpa"):
    cfg = cfg or make_cfg()
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.1
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg, embed, lm_head, attention_backend=backend).eval()
    # Non-trivial norm weights so a wrong norm placement cannot hide behind all-ones.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def make_batch(cfg, lengths=(20, 13, 9), seed=1):
    gen = torch.Generator().manual_seed(seed)
    n, t = len(lengths), max(lengths)
    hidden = torch.randn(n, t, cfg.num_context_layers, cfg.hidden_size, generator=gen)
    ids = torch.randint(0, cfg.vocab_size - 1, (n, t), generator=gen)
    for row, length in enumerate(lengths):
        hidden[row, length:] = 0.0
        ids[row, length:] = 0
    return hidden, ids


# ---------------------------------------------------------------------------------------------
# The mask


def brute_force_mask(anchors, seq_len, block_size, window, causal=False):
    n, a = anchors.shape
    mask = torch.zeros(n, a * block_size, seq_len + a * block_size, dtype=torch.bool)
    for row in range(n):
        for j in range(a):
            anchor = int(anchors[row, j])
            for k in range(block_size):
                query = j * block_size + k
                query_pos = anchor + k
                for t in range(seq_len):
                    mask[row, query, t] = t < anchor and (window is None or t > query_pos - window)
                for k2 in range(block_size):
                    key_pos = anchor + k2
                    # sliding layers: causal inside the block and windowed; full layers: the whole block,
                    # or up to the query's own position for a causal drafter
                    mask[row, query, seq_len + j * block_size + k2] = (k2 <= k or not causal) if window is None else (
                        k2 <= k and key_pos > query_pos - window)
    return mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 3, 6])
def test_block_attention_mask_matches_brute_force(window, causal):
    anchors = torch.tensor([[5, 1, -1], [2, 9, 7]])
    got = block_attention_mask(anchors, 11, 4, window, causal)
    assert got.dtype == torch.bool and got.shape == (2, 12, 11 + 12)
    assert torch.equal(got, brute_force_mask(anchors, 11, 4, window, causal))
    # Every query sees at least one key, so no softmax row is empty (no NaN), unused slots included.
    assert got.any(-1).all()


def test_sliding_layers_are_causal_inside_the_block():
    anchors = torch.tensor([[4]])
    full = block_attention_mask(anchors, 6, 4, None)[0, :, 6:]
    sliding = block_attention_mask(anchors, 6, 4, 100)[0, :, 6:]
    assert full.all()  # full attention: every block position sees the whole block
    assert torch.equal(sliding, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    # a causal drafter's full layer: the whole context (vLLM's causal attention over context + block)
    causal = block_attention_mask(anchors, 6, 4, None, causal=True)[0]
    assert torch.equal(causal[:, 6:], torch.tril(torch.ones(4, 4, dtype=torch.bool))) and causal[:, :4].all()


@pytest.mark.parametrize("layer_types, causal, causal_drafter", [
    (("sliding_attention",) * 2, True, False), (None, False, False), (None, True, True),
    (("sliding_attention", "full_attention"), True, True)])
def test_block_position_sees_later_positions_only_on_full_layers(layer_types, causal, causal_drafter):
    cfg = make_cfg(layer_types=layer_types, sliding_window=None if layer_types is None else 64, causal=causal_drafter)
    model = make_model(cfg)
    hidden, _ = make_batch(cfg, lengths=(12,))
    block = torch.full((1, cfg.block_size), cfg.mask_token_id)
    block[0, 0] = 3
    changed = block.clone()
    changed[0, 2:] = 7  # tokens after block position 1
    with torch.no_grad():
        base, other = model.forward_block(hidden[:, :8], block), model.forward_block(hidden[:, :8], changed)
    assert torch.equal(base[:, :2], other[:, :2]) == causal
    assert not torch.equal(base[:, 2:], other[:, 2:])


# ---------------------------------------------------------------------------------------------
# Mask semantics through the model


def test_block_ignores_the_future_and_other_blocks():
    cfg = make_cfg()
    model = make_model(cfg)
    hidden, ids = make_batch(cfg, lengths=(20,))
    anchors = torch.tensor([[3, 8, 14]])
    j, a = 1, 8
    with torch.no_grad():
        base = model(hidden, ids, anchors)

        future_hidden = hidden.clone()
        future_hidden[:, a:] += torch.randn_like(future_hidden[:, a:])
        future_ids = ids.clone()
        future_ids[:, a + 1:] = (future_ids[:, a + 1:] + 1) % (VOCAB - 1)
        # Block 2's anchor token moves too: blocks never see each other's tokens.
        other_anchor_ids = ids.clone()
        other_anchor_ids[0, 3] = (ids[0, 3] + 5) % (VOCAB - 1)
        assert torch.equal(model(future_hidden, ids, anchors)[:, j], base[:, j])
        assert torch.equal(model(hidden, future_ids, anchors)[:, j], base[:, j])
        assert torch.equal(model(hidden, other_anchor_ids, anchors)[:, j], base[:, j])
        assert not torch.equal(model(hidden, other_anchor_ids, anchors)[:, 0], base[:, 0])

        past_hidden = hidden.clone()
        past_hidden[:, a - 1] += 1.0
        anchor_ids = ids.clone()
        anchor_ids[0, a] = (ids[0, a] + 1) % (VOCAB - 1)
        assert not torch.allclose(model(past_hidden, ids, anchors)[:, j], base[:, j])
        assert not torch.allclose(model(hidden, anchor_ids, anchors)[:, j], base[:, j])


def test_sliding_window_hides_old_context():
    window = 5
    cfg = make_cfg(layer_types=("sliding_attention", "sliding_attention"), sliding_window=window)
    model = make_model(cfg)
    hidden, ids = make_batch(cfg, lengths=(20,))
    anchors = torch.tensor([[12, 4]])
    a = 12
    with torch.no_grad():
        base = model(hidden, ids, anchors)
        # The block's first query (position a) sees keys > a - window; older ones are out of reach.
        old = hidden.clone()
        old[:, : a - window + 1] += torch.randn_like(old[:, : a - window + 1])
        edge = hidden.clone()
        edge[:, a - window + 1] += 1.0
        assert torch.equal(model(old, ids, anchors)[:, 0], base[:, 0])
        assert not torch.allclose(model(edge, ids, anchors)[:, 0], base[:, 0])

        full = make_model(make_cfg())
        assert not torch.allclose(full(old, ids, anchors)[:, 0], full(hidden, ids, anchors)[:, 0])


# ---------------------------------------------------------------------------------------------
# Training path == inference path


@pytest.mark.parametrize("layer_types, window, causal", [
    (None, None, False),
    (("sliding_attention", "full_attention"), 6, False),
    (None, None, True),
    (("sliding_attention", "full_attention"), 6, True),
])
def test_many_anchor_forward_equals_forward_block(layer_types, window, causal):
    cfg = make_cfg(layer_types=layer_types, sliding_window=window, causal=causal)
    model = make_model(cfg)
    lengths = (20, 13, 9)
    hidden, ids = make_batch(cfg, lengths)
    anchors = torch.tensor([[1, 17, 9, 4], [12, -1, 6, -1], [8, 2, -1, -1]])
    with torch.no_grad():
        out = model(hidden, ids, anchors)
        assert out.shape == (3, 4, cfg.block_size, HIDDEN)
        assert torch.isfinite(out).all()
        checked = 0
        for row in range(3):
            for j in range(4):
                a = int(anchors[row, j])
                if a < 0:
                    continue
                block = torch.full((1, cfg.block_size), cfg.mask_token_id)
                block[0, 0] = ids[row, a]
                single = model.forward_block(hidden[row:row + 1, :a], block)
                torch.testing.assert_close(out[row, j], single[0], atol=1e-5, rtol=1e-5)
                checked += 1
        assert checked == 8


def test_forward_block_accepts_incrementally_cached_context():
    cfg = make_cfg(layer_types=("full_attention", "sliding_attention"), sliding_window=4)
    model = make_model(cfg)
    hidden, ids = make_batch(cfg, lengths=(15,))
    block = torch.full((1, cfg.block_size), cfg.mask_token_id)
    block[0, 0] = ids[0, 11]
    with torch.no_grad():
        direct = model.forward_block(hidden[:, :11], block)
        first = model.context_kv(hidden[:, :6])
        second = model.context_kv(hidden[:, 6:11], start=6)
        cached = [(torch.cat((k1, k2), dim=2), torch.cat((v1, v2), dim=2))
                  for (k1, v1), (k2, v2) in zip(first, second)]
        torch.testing.assert_close(model.forward_block(None, block, context_kv=cached), direct,
                                   atol=1e-5, rtol=1e-5)
        wrong_start = [(torch.cat((k1, k2), dim=2), torch.cat((v1, v2), dim=2))
                       for (k1, v1), (k2, v2) in zip(first, model.context_kv(hidden[:, 6:11]))]
        assert not torch.allclose(model.forward_block(None, block, context_kv=wrong_start), direct)


@pytest.mark.parametrize("causal", [False, True])
def test_flex_backend_equals_sdpa(causal):
    cfg = make_cfg(layer_types=("sliding_attention", "full_attention"), sliding_window=6, causal=causal)
    sdpa = make_model(cfg)
    flex = make_model(cfg, backend="flex")
    hidden, ids = make_batch(cfg)
    anchors = torch.tensor([[1, 17, 9, 4], [12, -1, 6, -1], [8, 2, -1, -1]])
    with torch.no_grad(), warnings.catch_warnings():
        # Eager flex_attention on CPU warns that it is unfused; that is expected here.
        warnings.simplefilter("ignore")
        torch.testing.assert_close(flex(hidden, ids, anchors), sdpa(hidden, ids, anchors), atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # compiles flex_attention on the CPU (tens of seconds a graph)
def test_compiled_flex_compiles_a_bounded_number_of_times_over_varied_batches(monkeypatch):
    """40 packed batches of varied sequence counts, lengths and anchors through compiled
    flex_attention: dynamo compiles a few graphs (1 and several sequences, then dynamic shapes),
    not one per batch (a mask closed over per-batch Python ints recompiled on every new length,
    then fell back to eager at the recompile limit), and every output equals SDPA's."""
    import torch._dynamo
    import torch._dynamo.utils

    from dflash_train.training import model as model_module

    monkeypatch.setattr(model_module, "COMPILE_FLEX_ON", {"cpu"})
    monkeypatch.setattr(model_module, "_compiled_flex_attention", None)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # full attention only: inductor's CPU flex kernel does not compile the sliding layers' mask
    # (C++ error: cur_kvSplitSize7 not declared, torch 2.13); CUDA's is the GPU check's
    cfg = make_cfg()
    sdpa, flex = make_model(cfg), make_model(cfg, backend="flex")
    gen = torch.Generator().manual_seed(5)
    for index in range(40):
        lengths = torch.randint(12, 90, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen)
        anchors = torch.stack([torch.randint(0, int(n) - 1, (int(torch.randint(2, 7, (1,), generator=gen)),),
                                             generator=gen) for n in lengths[:1]] * len(lengths))
        total = int(lengths.sum())
        hidden = torch.randn(1, total, cfg.num_context_layers, cfg.hidden_size, generator=gen)
        ids = torch.randint(0, cfg.vocab_size - 1, (1, total), generator=gen)
        with torch.no_grad():
            got = flex(hidden, ids, anchors, packed_lengths=lengths)
            if index % 8 == 0:
                torch.testing.assert_close(got, sdpa(hidden, ids, anchors, packed_lengths=lengths), atol=1e-5, rtol=1e-5)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= compiled <= 4, compiled
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# Parameters, dtypes, logits


def expected_export_names(num_layers):
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        p = f"layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"self_attn.{x}_norm.weight" for x in "qk"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    return names


def test_state_dict_has_exactly_the_export_names_and_only_they_train():
    cfg = make_cfg()
    model = make_model(cfg).train()
    assert set(model.state_dict()) == expected_export_names(2)
    assert {name for name, _ in model.named_parameters()} == expected_export_names(2)
    hidden, ids = make_batch(cfg)
    out = model(hidden, ids, torch.tensor([[1, 5], [3, -1], [2, 6]]))
    model.logits(out).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert model.embed_weight.grad is None and model.lm_head_weight.grad is None


def test_bf16_model_takes_fp32_features_and_logits_use_the_lm_head():
    cfg = make_cfg()
    model = make_model(cfg).to(torch.bfloat16)
    hidden, ids = make_batch(cfg)
    with torch.no_grad():
        out = model(hidden, ids, torch.tensor([[1, 5], [3, -1], [2, 6]]))
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        logits = model.logits(out[0, 0])
        assert logits.shape == (cfg.block_size, VOCAB)
        torch.testing.assert_close(logits, out[0, 0] @ model.lm_head_weight.T)


def test_mismatched_context_layers_are_a_config_error():
    model = make_model()
    hidden = torch.zeros(1, 5, 3, HIDDEN)
    with pytest.raises(ConfigError, match="3 layers"):
        model(hidden, torch.zeros(1, 5, dtype=torch.long), torch.tensor([[1]]))


# ---------------------------------------------------------------------------------------------
# DrafterConfig


@pytest.mark.parametrize("overrides, message", [
    (dict(num_key_value_heads=3), "multiple of"),
    (dict(head_dim=15), "odd"),
    (dict(mask_token_id=VOCAB), "outside the vocabulary"),
    (dict(target_layer_ids=(1, 5)), "outside the teacher"),
    (dict(target_layer_ids=()), "empty"),
    (dict(target_layer_ids=(1, 1)), "repeats"),
    (dict(block_size=1), "drafts nothing"),
    (dict(layer_types=("full_attention",)), "1 entries"),
    (dict(layer_types=("full_attention", "linear_attention")), "unknown"),
    (dict(layer_types=("sliding_attention", "full_attention")), "sliding_window is None"),
    (dict(sliding_window=8), "no layer is sliding"),
    (dict(causal=1), "causal=1 is not a bool"),
    (dict(hidden_size=0), "hidden_size=0"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
])
def test_config_validation(overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg(**overrides)


def test_hf_config_round_trip():
    for cfg in (make_cfg(), make_cfg(layer_types=("full_attention", "sliding_attention"), sliding_window=7),
                make_cfg(causal=True)):
        assert DrafterConfig.from_hf_config(cfg.to_hf_config()) == cfg
    cfg = make_cfg(target_layer_ids=[3, 1])
    assert cfg.target_layer_ids == (3, 1)


def test_from_teacher_qwen3():
    teacher = Qwen3Config(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                          intermediate_size=256, num_hidden_layers=8, vocab_size=300, rms_norm_eps=1e-5,
                          max_position_embeddings=4096,
                          rope_parameters={"rope_type": "default", "rope_theta": 123456.0}).to_dict()
    cfg = DrafterConfig.from_teacher(teacher, (1, 3, 5), mask_token_id=299, block_size=8, num_hidden_layers=3)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (128, 8, 2, 32)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.num_target_layers) == (256, 300, 8)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position_embeddings) == (1e-5, 123456.0, 4096)
    assert (cfg.block_size, cfg.num_hidden_layers, cfg.target_layer_ids) == (8, 3, (1, 3, 5))
    assert cfg.layer_types == ("full_attention",) * 3 and cfg.sliding_window is None


def test_from_teacher_llama_derives_head_dim_and_takes_overrides():
    teacher = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=200,
                          num_hidden_layers=6, vocab_size=500,
                          rope_parameters={"rope_type": "default", "rope_theta": 500000.0}).to_dict()
    del teacher["head_dim"]
    cfg = DrafterConfig.from_teacher(teacher, [2], mask_token_id=7, num_hidden_layers=2,
                                     sliding_window=64, sliding_layers=[1], intermediate_size=128)
    assert cfg.head_dim == 16 and cfg.rope_theta == 500000.0 and cfg.num_key_value_heads == 3
    assert cfg.intermediate_size == 128
    assert cfg.layer_types == ("full_attention", "sliding_attention") and cfg.sliding_window == 64
    # A legacy config with rope_theta at the top level.
    legacy = dict(teacher, rope_theta=2.5e5)
    del legacy["rope_parameters"]
    assert DrafterConfig.from_teacher(legacy, [2], mask_token_id=7).rope_theta == 2.5e5


def test_from_teacher_qwen3_5_text_and_multimodal_configs():
    text = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256,
                num_hidden_layers=8, vocab_size=400,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    for teacher in (Qwen3_5TextConfig(**text).to_dict(), Qwen3_5Config(text_config=text).to_dict()):
        cfg = DrafterConfig.from_teacher(teacher, (1, 4), mask_token_id=399, num_hidden_layers=2)
        assert (cfg.hidden_size, cfg.head_dim, cfg.num_target_layers, cfg.vocab_size) == (128, 64, 8, 400)
        assert cfg.rope_theta == 1e7


def test_from_teacher_errors():
    teacher = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
                          vocab_size=100).to_dict()
    with pytest.raises(ConfigError, match="unknown drafter config field 'hidden'"):
        DrafterConfig.from_teacher(teacher, [1], mask_token_id=5, hidden=3)
    with pytest.raises(ConfigError, match="without sliding_window"):
        DrafterConfig.from_teacher(teacher, [1], mask_token_id=5, sliding_layers=[0])
    with pytest.raises(ConfigError, match="without sliding_layers"):
        DrafterConfig.from_teacher(teacher, [1], mask_token_id=5, sliding_window=4)
    with pytest.raises(ConfigError, match="outside the teacher"):
        DrafterConfig.from_teacher(teacher, [4], mask_token_id=5)
    with pytest.raises(ConfigError, match="'vocab_size'"):
        DrafterConfig.from_teacher({k: v for k, v in teacher.items() if k != "vocab_size"}, [1], mask_token_id=5)


# ---------------------------------------------------------------------------------------------
# MASK token


def word_tokenizer(words, added=()):
    vocab = {w: i for i, w in enumerate(["[UNK]", *words])}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(list(added))
    return tok


def test_resolve_mask_token_id_cases():
    plain = word_tokenizer(["a", "b", "c"])
    with_mask = word_tokenizer(["a", "b", "c"], added=["<|MASK|>"])
    assert resolve_mask_token_id(plain, 10, override=2) == 2
    assert resolve_mask_token_id(with_mask, 10) == 4
    assert resolve_mask_token_id(with_mask, 10, override=1) == 1
    # Padded embedding (Qwen style): the first row the tokenizer does not use.
    assert resolve_mask_token_id(plain, 10) == 4
    assert resolve_mask_token_id(PreTrainedTokenizerFast(tokenizer_object=plain), 10) == 4
    assert resolve_mask_token_id(PreTrainedTokenizerFast(tokenizer_object=with_mask), 10) == 4


def test_resolve_mask_token_id_errors():
    plain = word_tokenizer(["a", "b", "c"])
    with pytest.raises(ConfigError, match="--mask-token-id"):
        resolve_mask_token_id(plain, 4)
    with pytest.raises(ConfigError, match="outside the teacher's 10 embedding rows"):
        resolve_mask_token_id(plain, 10, override=10)


def test_mask_token_is_exported_when_the_tokenizer_has_it():
    """SGLang refuses a mask_token_id that disagrees with the tokenizer's <|MASK|>: the export names the token."""
    with_mask = PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(["a", "b", "c"], added=["<|MASK|>"]))
    plain = PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(["a", "b", "c"]))
    teacher = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
                          intermediate_size=128, vocab_size=10).to_dict()
    for tokenizer, want in ((with_mask, "<|MASK|>"), (plain, None)):
        mask_id = resolve_mask_token_id(tokenizer, 10)
        cfg = DrafterConfig.from_teacher(teacher, [1], mask_id, num_hidden_layers=1,
                                         mask_token=mask_token_text(tokenizer, mask_id))
        exported = cfg.to_hf_config()["dflash_config"]
        assert exported.get("mask_token") == want and exported["mask_token_id"] == mask_id == 4
        assert DrafterConfig.from_hf_config(cfg.to_hf_config()) == cfg
    assert mask_token_text(with_mask, 2) == "b"
