"""The varied corpus (issue 54's third and fourth caches) and make_example's hybrid teacher shape."""

from __future__ import annotations

import json
import random
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import make_example  # noqa: E402
import synthetic_chat  # noqa: E402
import varied_chat  # noqa: E402


def _lines(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def test_without_the_flag_the_corpus_is_the_shipped_one_byte_for_byte():
    # The shipped quickstart teacher and caches were made from these files.
    world = synthetic_chat.make_world()
    train = synthetic_chat.make_corpus(make_example.CORPUS_SEED, make_example.N_TRAIN_ROWS, world)
    heldout = synthetic_chat.make_heldout(make_example.HELDOUT_SEED, make_example.N_HELDOUT_ROWS, world,
                                          synthetic_chat.user_texts(train))
    chat = _lines([{"id": f"chat-{i:06d}", "messages": m} for i, m in enumerate(train)])
    prompts = _lines([{"id": f"heldout-{i:04d}", "messages": p.messages} for i, p in enumerate(heldout)])
    assert chat == (ROOT / "examples" / "data" / "chat.jsonl").read_text(encoding="utf-8")
    assert prompts == (ROOT / "examples" / "data" / "heldout_prompts.jsonl").read_text(encoding="utf-8")


def test_with_the_flag_one_prompt_gets_several_replies_that_all_say_the_same():
    world = synthetic_chat.make_world()
    replies = defaultdict(list)
    for conversation in synthetic_chat.make_corpus(0, 3000, world, varied=True):
        if len(conversation) == 2:  # no system prompt, one turn: the reply depends on the user text alone
            replies[conversation[0]["content"]].append(conversation[1]["content"])
    greetings = [texts for texts in replies.values() if texts[0] == synthetic_chat.GREETING_REPLY]
    asked_again = [texts for texts in replies.values() if len(texts) >= 2 and texts not in greetings]
    assert len(asked_again) >= 20
    assert sum(len(set(texts)) >= 2 for texts in asked_again) >= 0.9 * len(asked_again)
    for texts in asked_again:
        assert len({varied_chat.canonical(t) for t in texts}) == 1, texts
    # a greeting is no answer: it keeps its one reply, so the teacher stays sure of it
    assert greetings and all(set(texts) == {synthetic_chat.GREETING_REPLY} for texts in greetings)


def test_every_variant_maps_back_to_its_base_reply_and_only_base_phrases_are_rewritten():
    world = synthetic_chat.make_world()
    base = [m["content"] for c in synthetic_chat.make_corpus(0, 1500, world) for m in c if m["role"] == "assistant"]
    # A base reply holding another member of a synonym group would be rewritten wrongly by canonical.
    others = varied_chat._alternation(p for group in varied_chat.SYNONYMS for p in group[1:])
    assert not [r for r in base if others.search(r)]
    rng = random.Random(0)
    for brief in (False, True):
        varied = [varied_chat.vary_reply(rng, r, brief) for r in base]
        assert [varied_chat.canonical(v.text) for v in varied] == base
        # full replies all get an opener or closer but for 1 in 20; brief ones only synonyms
        assert sum(v.text != r for v, r in zip(varied, base)) > (0.9 if not brief else 0.25) * len(base)
        assert all(v.nats > 0 for v, r in zip(varied, base) if v.text != r)


def test_the_hybrid_teacher_shape_is_a_qwen3_5_model_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    chats = synthetic_chat.make_corpus(0, 50, synthetic_chat.make_world(), varied=True)
    tokenizer = make_example.train_tokenizer(chats)
    config = make_example.teacher_config(tokenizer, "qwen3_5")
    torch.manual_seed(0)
    make_example.new_teacher(config).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "Qwen3_5ForCausalLM"
    assert loaded.config.layer_types.count("linear_attention") == 6 and loaded.config.layer_types[-1] == "full_attention"
    ids, _ = make_example.encode_chat(tokenizer, chats[0])
    with torch.no_grad():
        logits = loaded(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config.vocab_size) and torch.isfinite(logits).all()
    # the default shape is still the quickstart's Qwen3
    assert type(make_example.teacher_config(tokenizer)).__name__ == "Qwen3Config"
