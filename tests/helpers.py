"""Generic builders for tests: a tiny trained tokenizer, tiny random teachers, corpus files.

Everything is built in code (no hub downloads) and is deterministic, so tests that compare
numbers across runs or processes can rely on it.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from dflash_cache import open_cache

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen-style ChatML; no default system prompt so a rendered chat holds only what the row holds.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "this model", "our team", "the river",
             "a small bird", "the old man", "every student", "the computer", "her sister"]
_VERBS = ["likes", "sees", "writes", "reads", "finds", "builds", "wants", "takes", "makes",
          "knows", "follows", "carries", "answers", "explains"]
_OBJECTS = ["a red apple", "the long road", "some water", "the answer", "a new book", "the song",
            "three stones", "the last train", "a bright light", "the question", "many numbers",
            "a quiet room", "the green door"]
_ENDINGS = ["today", "at night", "in the morning", "without a word", "with great care", "again",
            "near the house", "for a while", "before dinner", "every day"]


def peak_rss_kib(reset: bool = False) -> int:
    """This process's peak resident memory since it started (or since the last reset=True).

    Not ru_maxrss: Linux carries that across exec, so a child started by a large pytest process
    reports the parent's peak as its own, and growth below it is invisible."""
    if reset:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def english_like_sentences(count: int, seed: int = 0) -> list[str]:
    """`count` deterministic English-like sentences (also useful as corpus text)."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(count):
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.6:
            sentence += f" {rng.choice(_ENDINGS)}"
        sentence = sentence[0].upper() + sentence[1:] + rng.choice([".", ".", "!", "?"])
        if rng.random() < 0.2:
            sentence += f" It was {rng.randint(0, 999)} times."
        sentences.append(sentence)
    return sentences


def qa_rows(n: int, seed: int, prefix: str) -> list[dict]:
    """`n` one-turn chats with ids `{prefix}000`...: a sentence asked, two sentences answered."""
    s = english_like_sentences(3 * n, seed=seed)
    return [{"id": f"{prefix}{i:03d}", "messages": [{"role": "user", "content": s[3 * i]},
                                                    {"role": "assistant", "content": s[3 * i + 1] + " " + s[3 * i + 2]}]}
            for i in range(n)]


def build_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Train a ~500-token byte-level BPE with a ChatML template, save it to `path`, return it."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # trim_offsets=False (as in Qwen's tokenizer) keeps whitespace tokens' offsets exact.
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = english_like_sentences(400) + ["user", "assistant", "system", "\n"]
    backend.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )
    tokenizer.save_pretrained(str(path))
    return tokenizer


def _padded_vocab_size(tokenizer: PreTrainedTokenizerBase) -> int:
    return int(math.ceil(len(tokenizer) / 64) * 64)


def teacher_config(arch: str, tokenizer: PreTrainedTokenizerBase):
    """The tiny transformers config for `arch` in "qwen3", "qwen3_5", "llama"."""
    common = dict(
        vocab_size=_padded_vocab_size(tokenizer),
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if arch == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(
            **common,
            # Three Gated-DeltaNet layers then one attention layer, as in the production teacher.
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            # mrope_section must sum to the rotary half-dim: 16 * 0.5 / 2 = 4.
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        )
    raise ValueError(f"unknown test teacher arch {arch!r}; use qwen3, qwen3_5 or llama")


def build_teacher(
    path: str | Path,
    arch: str,
    tokenizer: PreTrainedTokenizerBase | str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Save a tiny random causal LM of `arch` plus `tokenizer` into `path`; return the path.

    The saved folder is checked to load back with AutoModelForCausalLM and run a forward.
    """
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    config = teacher_config(arch, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    path = str(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)

    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = torch.tensor([tokenizer("The cat sees the answer.")["input_ids"]])
    with torch.no_grad():
        logits = loaded(input_ids=ids).logits
    if logits.shape != (1, ids.shape[1], config.vocab_size) or not torch.isfinite(logits).all():
        raise RuntimeError(f"tiny {arch} teacher at {path} produced bad logits {tuple(logits.shape)}")
    return path


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> str:
    """Write `rows` as JSON Lines (UTF-8, one object per line); return the path."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    sentences = english_like_sentences(4 * n, seed=seed)
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": sentences[4 * i]},
                    {"role": "assistant", "content": " ".join(sentences[4 * i + 1: 4 * i + 1 + 1 + i % 3])}]
        if i % 4 == 0:
            messages = [{"role": "system", "content": "Be brief."}] + messages
        rows.append({"id": f"chat-{i:04d}", "messages": messages})
    return rows


def cache_content(url, storage_options: dict | None = None) -> dict:
    """Every sequence's arrays by id, the hidden states as their bits, for bit-exact comparisons."""
    cache = open_cache(str(url), storage_options)

    def bits(hidden) -> np.ndarray:
        hidden = np.asarray(hidden)
        return hidden.view(f"u{hidden.dtype.itemsize}").copy()

    return {r.id: (r.input_ids.copy(), r.loss_mask.copy(), bits(r.hidden), r.topk_ids.copy(), r.topk_logprobs.copy())
            for r in cache.sequences()}


def assert_same_content(a: dict, b: dict):
    assert list(a) == list(b)
    for key in a:
        for x, y in zip(a[key], b[key]):
            np.testing.assert_array_equal(x, y)


def replace_shard_records(cache: Path, records: dict[int, dict]) -> None:
    """Edit a local cache as a careful attacker would: shard ``i``'s record becomes ``records[i]``
    wherever the cache keeps it (format 1: its commit record and the manifest's list; format 2: its
    commit record and its row of the index's shard table, with the table's size and checksum in
    manifest.json rewritten to match)."""
    from dflash_cache import format as fmt
    from dflash_cache.format import index
    from dflash_cache.format.store import CacheStore

    manifest = json.loads((cache / fmt.MANIFEST).read_text())
    opened = open_cache(str(cache))
    for i, record in records.items():
        Path(fmt.shard_path(str(cache), record["name"], opened.version) + ".json").write_text(json.dumps(record, indent=1) + "\n")
    if opened.version == 1:
        for i, record in records.items():
            manifest["shards"][i] = record
    else:
        rows = [records.get(i, shard.record) for i, shard in enumerate(opened.shards)]
        sequences = opened.sequence_table().select(index.sequence_schema().names)
        manifest["index"] = index.write_tables(CacheStore.open(str(cache)), index.MERGED, index.shard_table(rows),
                                               sequences.cast(index.sequence_schema()), complete=True)
    (cache / fmt.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def train_and_resume(app, cache_url: str, tmp_path: Path, args: list[str], last_step: int = 6):
    """`run` straight to last_step, then again from a copy without its last checkpoint and its
    export, resumed (--resume): asserts both end with the same weights bit for bit and returns
    (the straight run's folder, its CliRunner result, its last checkpoint's weights)."""
    import shutil

    import safetensors.torch
    from typer.testing import CliRunner

    runner = CliRunner()
    straight = tmp_path / "straight"
    result = runner.invoke(app, ["run", "--cache", cache_url, "--out", str(straight), *args])
    assert result.exit_code == 0, result.output
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    step = f"step-{last_step:06d}"
    shutil.rmtree(resumed / "checkpoints" / step)
    shutil.rmtree(resumed / "drafter")
    again = runner.invoke(app, ["run", "--cache", cache_url, "--out", str(resumed), "--resume", *args])
    assert again.exit_code == 0, again.output
    a = safetensors.torch.load_file(str(straight / "checkpoints" / step / "model.safetensors"))
    b = safetensors.torch.load_file(str(resumed / "checkpoints" / step / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    return straight, result, a
