"""Build the quickstart's tiny world: a synthetic chat corpus, a tokenizer and a tiny Qwen3 teacher.

Run from the repository root:

    python examples/make_example.py

It writes
    examples/data/chat.jsonl               training conversations
    examples/data/heldout_prompts.jsonl    single-turn prompts absent from the training corpus
    examples/teacher/                      Qwen3ForCausalLM (bf16 safetensors) + tokenizer +
                                           TRAINING.md

Seeds are fixed, so a rerun on the same machine gives the same corpus, tokenizer and weights
(only the wall times in TRAINING.md change).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synthetic_chat  # noqa: E402  (lives next to this script)
import varied_chat  # noqa: E402

EXAMPLES_DIR = Path(__file__).resolve().parent

Row = tuple[list[int], list[int]]  # token ids of a rendered chat, its 0/1 assistant mask

CORPUS_SEED = 0
HELDOUT_SEED = 1
TEACHER_EXTRA_SEED = 2
TRAIN_SEED = 0
N_TRAIN_ROWS = 3000
N_HELDOUT_ROWS = 100
# The teacher sees chat.jsonl plus this many more conversations from the same generators, each
# about once. In a trial on an earlier version of the corpus, the same compute spent on 13
# epochs of chat.jsonl alone memorised it (assistant loss 0.04): held-out assistant loss
# bottomed at 0.41 and rose again, and only 30% of held-out greedy replies were right.
N_TEACHER_EXTRA_ROWS = 30000
# An upper bound: the templated corpus runs out of pairs seen twice at about 2,100 tokens.
BPE_VOCAB_SIZE = 3000

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


@dataclass(frozen=True)
class Corpus:
    train: list[list[dict]]  # chat.jsonl
    heldout: list[synthetic_chat.HeldoutPrompt]  # heldout_prompts.jsonl, with references
    teacher_extra: list[list[dict]]  # extra teacher training rows, never written out


def build_corpus(varied: bool = False) -> Corpus:
    """The quickstart corpus; `varied`: every reply drawn among its valid phrasings."""
    world = synthetic_chat.make_world()
    train = synthetic_chat.make_corpus(CORPUS_SEED, N_TRAIN_ROWS, world, varied)
    heldout = synthetic_chat.make_heldout(
        HELDOUT_SEED, N_HELDOUT_ROWS, world, synthetic_chat.user_texts(train), varied
    )
    heldout_texts = {p.messages[-1]["content"] for p in heldout}
    extra = synthetic_chat.make_teacher_extra(
        TEACHER_EXTRA_SEED, N_TEACHER_EXTRA_ROWS, world, heldout_texts, varied
    )
    return Corpus(train=train, heldout=heldout, teacher_extra=extra)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def train_tokenizer(conversations: list[list[dict]]) -> PreTrainedTokenizerFast:
    """Byte-level BPE with single-digit number tokens (as Qwen does), trained on the corpus."""
    tok = Tokenizer(models.BPE())
    # Splitting digits first keeps arithmetic learnable: every number is spelled digit by digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train on the message texts and role names rather than rendered chats, so the special
    # tokens never take part in merges.
    texts = [text for conv in conversations for m in conv for text in (m["role"], m["content"])]
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    """save_pretrained, naming a tokenizer class that transformers 4.x can load too.

    transformers 5 records its own "TokenizersBackend", which 4.x (and the inference engines
    pinned to it) do not know; "PreTrainedTokenizerFast" loads the same tokenizer.json in both.
    """
    tokenizer.save_pretrained(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    config_path.write_text(text, encoding="utf-8")


def padded_vocab_size(n_tokens: int, multiple: int = 64) -> int:
    """Embedding rows: len(tokenizer) rounded up to `multiple`, always with >= 1 spare row.

    The spare rows are what a drafter can use as its mask token, as with Qwen's padded vocab.
    """
    return (n_tokens + 1 + multiple - 1) // multiple * multiple


def assistant_char_spans(messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render a chat like CHAT_TEMPLATE and return the char spans the assistant produces.

    A span covers the reply text and its closing <|im_end|>: predicting the end of the turn is
    part of answering.
    """
    text, spans = "", []
    for m in messages:
        head = f"<|im_start|>{m['role']}\n"
        body = m["content"] + "<|im_end|>"
        start = len(text) + len(head)
        text += head + body + "\n"
        if m["role"] == "assistant":
            spans.append((start, start + len(body)))
    return text, spans


def encode_chat(tokenizer: PreTrainedTokenizerFast, messages: list[dict]) -> Row:
    """Token ids of the rendered chat and a 0/1 mask of assistant tokens."""
    text, spans = assistant_char_spans(messages)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    mask = [int(any(s <= a and b <= e for s, e in spans)) for a, b in enc["offset_mapping"]]
    return enc["input_ids"], mask


# ---------------------------------------------------------------------------------------------
# Teacher
# ---------------------------------------------------------------------------------------------


ARCHS = ("qwen3", "qwen3_5")


def teacher_config(tokenizer: PreTrainedTokenizerFast, arch: str = "qwen3"):
    """The teacher's shape: a Qwen3, or (qwen3_5) a hybrid Qwen3.5 text model of the same width
    and depth whose layers are three Gated DeltaNet layers to one attention layer, as in Qwen3.5."""
    common = dict(
        vocab_size=padded_vocab_size(len(tokenizer)),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch != "qwen3_5":
        raise ValueError(f"unknown teacher arch {arch!r}; use one of {ARCHS}")
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        **common,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        # mrope_section must sum to the rotary half-dim: 32 * 0.5 / 2 = 8.
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [4, 2, 2], "mrope_interleaved": True},
    )


def new_teacher(config):
    """A freshly initialised teacher of `config` (the quickstart's Qwen3 exactly as it was made)."""
    if isinstance(config, Qwen3Config):
        return Qwen3ForCausalLM(config)
    return AutoModelForCausalLM.from_config(config)


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1400
    tokens_per_batch: int = 2048  # padded tokens: batch rows * longest row
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 100


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * peak_lr at the last step."""
    if step < s.warmup_steps:
        return s.peak_lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return s.peak_lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * cosine)


def length_batches(
    lengths: list[int], tokens_per_batch: int, rng: random.Random
) -> list[list[int]]:
    """Group rows of similar length so padding stays small; batch order is shuffled.

    Ties in length are broken randomly so each epoch groups rows differently.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches, current = [], []
    for i in order:
        # Rows arrive in increasing length, so row i is the longest of the batch it joins.
        if current and lengths[i] * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ids with 0/1 masks of real (non-pad) and assistant tokens."""
    longest = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    real = torch.zeros((len(rows), longest), dtype=torch.long)
    assistant = torch.zeros((len(rows), longest), dtype=torch.long)
    for r, (row_ids, row_mask) in enumerate(rows):
        ids[r, : len(row_ids)] = torch.tensor(row_ids)
        real[r, : len(row_ids)] = 1
        assistant[r, : len(row_mask)] = torch.tensor(row_mask)
    return {"input_ids": ids, "real_mask": real, "assistant_mask": assistant}


def next_token_losses(
    model: Qwen3ForCausalLM, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position loss of predicting token t+1, with masks for real and assistant targets.

    Rows are right-padded, so under the causal mask no real position ever sees a pad; passing
    no attention mask lets SDPA take its causal fast path (about 7% faster per step here).
    """
    logits = model(input_ids=batch["input_ids"]).logits
    targets = batch["input_ids"][:, 1:]
    losses = F.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), targets.flatten(), reduction="none"
    ).view_as(targets)
    real = batch["real_mask"][:, 1:].float()
    assistant = batch["assistant_mask"][:, 1:].float()
    return losses, real, assistant


@torch.no_grad()
def evaluate(model: Qwen3ForCausalLM, rows: list[Row], pad_id: int) -> dict[str, float]:
    """Mean next-token loss over all tokens and over assistant tokens."""
    model.eval()
    sums = {"all": 0.0, "assistant": 0.0}
    counts = {"all": 0.0, "assistant": 0.0}
    for start in range(0, len(rows), 32):
        batch = collate(rows[start : start + 32], pad_id)
        losses, real, assistant = next_token_losses(model, batch)
        sums["all"] += float((losses * real).sum())
        counts["all"] += float(real.sum())
        sums["assistant"] += float((losses * assistant).sum())
        counts["assistant"] += float(assistant.sum())
    model.train()
    return {k: sums[k] / counts[k] for k in sums}


def train_teacher(
    model: Qwen3ForCausalLM,
    train_rows: list[Row],
    eval_sets: dict[str, list[Row]],
    pad_id: int,
    s: TrainSettings,
) -> list[dict[str, float]]:
    """AdamW + cosine LR on every real token of every conversation; returns the loss log."""
    rng = random.Random(TRAIN_SEED)
    # Norm weights are excluded from weight decay, as usual.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": s.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=s.peak_lr,
        betas=(0.9, 0.98),
    )
    lengths = [len(ids) for ids, _ in train_rows]
    log: list[dict[str, float]] = []
    window_loss, window_tokens = 0.0, 0.0
    started = time.perf_counter()
    step, epoch = 0, 0
    model.train()
    while step < s.steps:
        for batch_rows in length_batches(lengths, s.tokens_per_batch, rng):
            if step >= s.steps:
                break
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, s)
            batch = collate([train_rows[i] for i in batch_rows], pad_id)
            losses, real, _ = next_token_losses(model, batch)
            loss = (losses * real).sum() / real.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
            optimizer.step()
            window_loss += float(loss.detach()) * float(real.sum())
            window_tokens += float(real.sum())
            step += 1
            if step % s.log_every == 0 or step == s.steps:
                entry = {
                    "step": step,
                    "epoch": epoch,
                    "lr": lr_at(step - 1, s),
                    "train_loss_window": window_loss / window_tokens,
                    "seconds": time.perf_counter() - started,
                }
                for name, rows in eval_sets.items():
                    entry[f"{name}_assistant_loss"] = evaluate(model, rows, pad_id)["assistant"]
                log.append(entry)
                window_loss, window_tokens = 0.0, 0.0
                print(
                    f"step {step:5d}  epoch {epoch}  lr {entry['lr']:.2e}  "
                    f"train {entry['train_loss_window']:.3f}  "
                    + "  ".join(f"{n} asst {entry[f'{n}_assistant_loss']:.3f}" for n in eval_sets)
                    + f"  {entry['seconds']:.0f}s",
                    flush=True,
                )
        epoch += 1
    return log


@torch.no_grad()
def greedy_replies(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[list[dict]],
    max_new_tokens: int = 128,
) -> list[str]:
    """Greedy assistant replies, generated in left-padded batches."""
    model.eval()
    tokenizer.padding_side = "left"
    replies = []
    for start in range(0, len(prompts), 16):
        texts = [
            tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
            for p in prompts[start : start + 16]
        ]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        new = out[:, enc["input_ids"].shape[1] :]
        replies += tokenizer.batch_decode(new, skip_special_tokens=True)
    tokenizer.padding_side = "right"
    return [r.strip() for r in replies]


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def exact_match_by_task(
    heldout: list[synthetic_chat.HeldoutPrompt], replies: list[str], canonical=lambda text: text
) -> dict[str, tuple[int, int]]:
    """Per task: (greedy replies equal to the reference once both are `canonical`, prompts)."""
    scores: dict[str, tuple[int, int]] = {}
    for prompt, reply in zip(heldout, replies):
        right, total = scores.get(prompt.task, (0, 0))
        scores[prompt.task] = (right + (canonical(reply) == canonical(prompt.reference)), total + 1)
    return scores


def format_messages(messages: list[dict]) -> str:
    return "\n".join(f"[{m['role']}] {m['content']}" for m in messages)


def training_report(
    *,
    settings: TrainSettings,
    config: Qwen3Config,
    n_tokenizer: int,
    n_params: int,
    token_counts: dict[str, int],
    n_teacher_rows: int,
    log: list[dict[str, float]],
    final: dict[str, dict[str, float]],
    train_seconds: float,
    exact_match: float,
    by_task: dict[str, tuple[int, int]],
    samples: list[tuple[list[dict], str, str]],
    variant: dict[str, str] | None = None,
) -> str:
    """TRAINING.md: how the teacher was made and how good it is; `variant` (title, command,
    chat, model, match) describes a teacher other than the quickstart's."""
    v = {"title": "Tiny Qwen3 teacher for the quickstart", "command": "python examples/make_example.py",
         "chat": "chat.jsonl", "model": f"`Qwen3ForCausalLM`, hidden {config.hidden_size}",
         "match": "equal to the reference reply"} | (variant or {})
    lines = [
        f"# {v['title']}",
        "",
        f"Built by `{v['command']}` (run from the repository root; see",
        f"`examples/README.md`). Trained from scratch on `examples/data/{v['chat']}` plus",
        f"{N_TEACHER_EXTRA_ROWS:,} more conversations drawn from the same generators with seed",
        f"{TEACHER_EXTRA_SEED} (none of them asks a held-out prompt), each seen about once. Every",
        "token of every conversation rendered with the chat template is a target; one conversation",
        "per row, rows of similar length batched together with right padding.",
        "",
        "Why the extra rows: in a trial on an earlier version of the corpus, the same compute",
        "spent on 13 epochs of the 3,000 rows of chat.jsonl alone memorised them (assistant loss",
        "0.04); held-out assistant loss bottomed at 0.41 and rose again, and only 30% of greedy",
        "held-out replies were right.",
        "",
        "## Setup",
        "",
        f"- Seeds: corpus {CORPUS_SEED}, held-out prompts {HELDOUT_SEED}, fictional world "
        f"{synthetic_chat.WORLD_SEED}, training {TRAIN_SEED}.",
        f"- Model: {v['model']}, "
        f"{config.num_hidden_layers} layers, "
        f"{config.num_attention_heads} heads / {config.num_key_value_heads} kv heads, head_dim "
        f"{config.head_dim}, intermediate {config.intermediate_size}, untied LM head, "
        f"{n_params:,} parameters; saved in bfloat16.",
        f"- Tokenizer: byte-level BPE with single-digit splitting, {n_tokenizer} tokens; the "
        f"embedding has {config.vocab_size} rows ({config.vocab_size - n_tokenizer} spare rows "
        f"past the tokenizer, usable as a drafter's mask token).",
        f"- Data: {v['chat']} has {N_TRAIN_ROWS:,} conversations, "
        f"{token_counts['chat']:,} tokens; the "
        f"teacher's training set has {n_teacher_rows:,} conversations, "
        f"{token_counts['teacher']:,} tokens.",
        f"- Optimiser: AdamW (betas 0.9/0.98, weight decay {settings.weight_decay} on matrices), "
        f"peak LR {settings.peak_lr}, {settings.warmup_steps} warmup steps, cosine decay to "
        f"{settings.min_lr_ratio} x peak, grad clip {settings.grad_clip}, "
        f"{settings.steps} steps of at most {settings.tokens_per_batch} padded tokens, float32.",
        f"- Training wall time: {train_seconds:.0f} s with torch.set_num_threads({torch.get_num_threads()}) on a "
        f"{v.get('cpu', '2-core CPU')} "
        f"(includes the periodic evaluations).",
        "",
        "## Loss",
        "",
        "Next-token cross-entropy (nats). `train` is the mean over all tokens of the batches since",
        "the previous row; the assistant columns are assistant-token losses on 200 training",
        f"conversations and on {N_HELDOUT_ROWS} held-out single-turn conversations (prompts from",
        "`heldout_prompts.jsonl` with their reference replies).",
        "",
        "| step | epoch | lr | train (all tokens) | train assistant | held-out assistant "
        "| seconds |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in log:
        lines.append(
            f"| {e['step']} | {e['epoch']} | {e['lr']:.2e} | {e['train_loss_window']:.3f} | "
            f"{e['train_assistant_loss']:.3f} | {e['heldout_assistant_loss']:.3f} | "
            f"{e['seconds']:.0f} |"
        )
    lines += [
        "",
        "Final, measured on the saved bfloat16 weights:",
        "",
        "| set | all tokens | assistant tokens |",
        "|---|---:|---:|",
    ]
    for name, losses in final.items():
        lines.append(f"| {name} | {losses['all']:.3f} | {losses['assistant']:.3f} |")
    lines += [
        "",
        f"Greedy replies {v['match']} on {exact_match:.0%} of the "
        f"{N_HELDOUT_ROWS} held-out prompts (one wrong digit or word counts as wrong):",
        "",
        "| task | right / prompts |",
        "|---|---:|",
    ]
    for task, (right, total) in sorted(by_task.items()):
        lines.append(f"| {task.removeprefix('task_')} | {right} / {total} |")
    lines += [
        "",
        "## Sample greedy generations (held-out prompts)",
        "",
    ]
    for prompt, reference, reply in samples:
        lines += [
            "```text",
            format_messages(prompt),
            f"[assistant, greedy] {reply}",
            f"[reference]         {reference}",
            "```",
            "",
        ]
    return "\n".join(lines)


def write_corpus(
    corpus: Corpus, data_dir: Path, chat: str = "chat.jsonl", heldout: str = "heldout_prompts.jsonl"
) -> None:
    write_jsonl(
        data_dir / chat,
        [{"id": f"chat-{i:06d}", "messages": m} for i, m in enumerate(corpus.train)],
    )
    write_jsonl(
        data_dir / heldout,
        [{"id": f"heldout-{i:04d}", "messages": p.messages} for i, p in enumerate(corpus.heldout)],
    )


def read_chats(path: Path) -> list[list[dict]]:
    """The `messages` of every row of a chat JSONL file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["messages"] for line in lines if line.strip()]


def corpus_report(
    *,
    chat: Path,
    heldout: Path,
    settings: TrainSettings,
    config: Qwen3Config,
    n_tokenizer: int,
    n_params: int,
    n_rows: int,
    n_tokens: int,
    log: list[dict[str, float]],
    final: dict[str, dict[str, float]],
    train_seconds: float,
) -> str:
    """TRAINING.md of a teacher trained on a given chat corpus (--chat)."""
    lines = [
        f"# Tiny Qwen3 teacher for `{chat.name}`",
        "",
        f"Built by `python examples/make_example.py --chat {chat} --heldout {heldout} --steps "
        f"{settings.steps}`: the quickstart teacher's tokenizer training, model shape and training "
        "loop, on this corpus instead of the synthetic one. Every token of every conversation is a "
        "target.",
        "",
        f"- Model: `Qwen3ForCausalLM`, hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"{n_params:,} parameters, saved in bfloat16; tokenizer {n_tokenizer} tokens, "
        f"embedding {config.vocab_size} rows.",
        f"- Data: {n_rows:,} conversations, {n_tokens:,} tokens; {settings.steps} steps of at most "
        f"{settings.tokens_per_batch} padded tokens, peak LR {settings.peak_lr}; seed {TRAIN_SEED}.",
        f"- Training wall time: {train_seconds:.0f} s with torch.set_num_threads(2).",
        "",
        "| step | epoch | train (all tokens) | train assistant | held-out assistant |",
        "|---:|---:|---:|---:|---:|",
    ]
    for e in log:
        lines.append(
            f"| {e['step']} | {e['epoch']} | {e['train_loss_window']:.3f} | "
            f"{e['train_assistant_loss']:.3f} | {e['heldout_assistant_loss']:.3f} |"
        )
    lines += ["", "Final, on the saved bfloat16 weights:", "", "| set | all tokens | assistant tokens |",
              "|---|---:|---:|"]
    lines += [f"| {name} | {v['all']:.3f} | {v['assistant']:.3f} |" for name, v in final.items()]
    return "\n".join(lines)


def train_on_chats(chat: Path, heldout: Path, teacher_dir: Path, settings: TrainSettings) -> None:
    """The quickstart teacher's recipe on a given corpus: `heldout` rows (prompts with their
    reference answers) measure held-out loss and are never trained on."""
    conversations = read_chats(chat)
    tokenizer = train_tokenizer(conversations)
    pad_id = tokenizer.pad_token_id
    rows = [encode_chat(tokenizer, m) for m in conversations]
    eval_sets = {"train": rows[:200], "heldout": [encode_chat(tokenizer, m) for m in read_chats(heldout)]}
    config = teacher_config(tokenizer)
    model = Qwen3ForCausalLM(config)
    started = time.perf_counter()
    log = train_teacher(model, rows, eval_sets, pad_id, settings)
    train_seconds = time.perf_counter() - started
    model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = None
    final = {name: evaluate(model, r, pad_id) for name, r in eval_sets.items()}
    teacher_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(teacher_dir)
    save_tokenizer(tokenizer, teacher_dir)
    report = corpus_report(
        chat=chat, heldout=heldout, settings=settings, config=config, n_tokenizer=len(tokenizer),
        n_params=sum(p.numel() for p in model.parameters()), n_rows=len(rows),
        n_tokens=sum(len(ids) for ids, _ in rows), log=log, final=final, train_seconds=train_seconds,
    )
    (teacher_dir / "TRAINING.md").write_text(report + "\n", encoding="utf-8")
    print(f"saved teacher to {teacher_dir} (training took {train_seconds:.0f} s); final losses {final}")


def variant_of(args: argparse.Namespace, config) -> dict[str, str] | None:
    """TRAINING.md's wording for a teacher other than the quickstart's (None: the quickstart's)."""
    if not args.varied and args.arch == "qwen3" and args.teacher == "teacher":
        return None
    model = f"`{'Qwen3ForCausalLM' if args.arch == 'qwen3' else 'Qwen3_5ForCausalLM'}`"
    if args.arch == "qwen3_5":
        model += f" (hybrid: layers {', '.join(t.split('_')[0] for t in config.layer_types)})"
    corpus = "the varied corpus" if args.varied else "the quickstart corpus"
    return {
        "title": f"Tiny {'hybrid Qwen3.5' if args.arch == 'qwen3_5' else 'Qwen3'} teacher for {corpus}",
        "command": f"python examples/make_example.py{' --varied' if args.varied else ''} --arch {args.arch} "
                   f"--teacher {args.teacher} --steps {args.steps}",
        "chat": data_names(args.varied)[0],
        "model": f"{model}, hidden {config.hidden_size}",
        "match": "equal to the reference reply up to phrasing (`varied_chat.canonical`)" if args.varied
                 else "equal to the reference reply",
    } | ({"cpu": args.cpu_note} if args.cpu_note else {})


def data_names(varied: bool) -> tuple[str, str]:
    """The training and held-out prompt files under data/."""
    prefix = "varied_" if varied else ""
    return f"{prefix}chat.jsonl", f"{prefix}heldout_prompts.jsonl"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=TrainSettings.steps, help="teacher training steps"
    )
    parser.add_argument(
        "--out", type=Path, default=EXAMPLES_DIR, help="where data/ and teacher/ go"
    )
    parser.add_argument(
        "--chat", type=Path, default=None,
        help="train the teacher on this chat JSONL instead of the synthetic corpus (writes only "
        "--out/teacher; nothing under data/)",
    )
    parser.add_argument(
        "--heldout", type=Path, default=None,
        help="with --chat: JSONL conversations (prompt and reference answer) for held-out loss",
    )
    parser.add_argument("--arch", choices=ARCHS, default="qwen3",
                        help="qwen3, or qwen3_5: a hybrid of Gated DeltaNet and attention layers")
    parser.add_argument("--varied", action="store_true",
                        help="every reply drawn among its valid phrasings (varied_chat.py): writes "
                        "data/varied_chat.jsonl and data/varied_heldout_prompts.jsonl")
    parser.add_argument("--teacher", default="teacher", help="the teacher's folder under --out")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (1 trains faster than 2 where other work shares the two cores)")
    parser.add_argument("--cpu-note", default=None, help="how TRAINING.md describes the machine")
    args = parser.parse_args()
    if args.chat is not None and args.heldout is None:
        parser.error("--chat needs --heldout (conversations never trained on, for held-out loss)")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(TRAIN_SEED)
    settings = TrainSettings(steps=args.steps)
    if args.chat is not None:
        train_on_chats(args.chat, args.heldout, args.out / args.teacher, settings)
        return
    make_synthetic(args, settings)


def make_synthetic(args: argparse.Namespace, settings: TrainSettings) -> None:
    """The synthetic corpus under --out/data and a teacher trained on it under --out/--teacher."""
    data_dir = args.out / "data"
    corpus = build_corpus(args.varied)
    write_corpus(corpus, data_dir, *data_names(args.varied))
    print(
        f"wrote {len(corpus.train)} conversations and {len(corpus.heldout)} held-out prompts "
        f"to {data_dir}"
    )

    tokenizer = train_tokenizer(corpus.train)
    for messages in corpus.train[:50]:
        # The mask logic renders chats itself; make sure it matches the saved template.
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        assert assistant_char_spans(messages)[0] == rendered
    pad_id = tokenizer.pad_token_id
    chat_rows = [encode_chat(tokenizer, m) for m in corpus.train]
    teacher_rows = chat_rows + [encode_chat(tokenizer, m) for m in corpus.teacher_extra]
    heldout_chats = [
        p.messages + [{"role": "assistant", "content": p.reference}] for p in corpus.heldout
    ]
    eval_sets = {
        "train": chat_rows[:200],
        "heldout": [encode_chat(tokenizer, m) for m in heldout_chats],
    }

    config = teacher_config(tokenizer, args.arch)
    model = new_teacher(config)
    n_params = sum(p.numel() for p in model.parameters())
    token_counts = {
        "chat": sum(len(ids) for ids, _ in chat_rows),
        "teacher": sum(len(ids) for ids, _ in teacher_rows),
    }
    print(
        f"tokenizer {len(tokenizer)} tokens, vocab_size {config.vocab_size}, {n_params:,} params, "
        f"chat {token_counts['chat']:,} tokens, "
        f"teacher data {token_counts['teacher']:,} tokens"
    )

    started = time.perf_counter()
    log = train_teacher(model, teacher_rows, eval_sets, pad_id, settings)
    train_seconds = time.perf_counter() - started
    finish_teacher(args, model, tokenizer, corpus, eval_sets, {
        "settings": settings, "config": config, "n_tokenizer": len(tokenizer), "n_params": n_params,
        "token_counts": token_counts, "n_teacher_rows": len(teacher_rows), "log": log,
        "train_seconds": train_seconds, "variant": variant_of(args, config)})


def finish_teacher(args, model, tokenizer, corpus: Corpus, eval_sets, report_args: dict) -> None:
    """Save the trained teacher in bfloat16 with its tokenizer and TRAINING.md (its losses and greedy
    replies measured on the saved weights)."""
    teacher_dir, config, pad_id = args.out / args.teacher, report_args["config"], tokenizer.pad_token_id
    model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = None
    final = {name: evaluate(model, rows, pad_id) for name, rows in eval_sets.items()}
    replies = greedy_replies(model, tokenizer, [p.messages for p in corpus.heldout])
    by_task = exact_match_by_task(corpus.heldout, replies, varied_chat.canonical if args.varied else str)
    exact_match = sum(right for right, _ in by_task.values()) / len(replies)
    print(f"final losses {final}; held-out greedy exact match {exact_match:.0%}")

    teacher_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(teacher_dir)
    save_tokenizer(tokenizer, teacher_dir)
    samples = [(p.messages, p.reference, reply) for p, reply in zip(corpus.heldout[:3], replies)]
    report = training_report(final=final, exact_match=exact_match, by_task=by_task, samples=samples,
                             **report_args)
    (teacher_dir / "TRAINING.md").write_text(report + "\n", encoding="utf-8")
    print(f"saved teacher to {teacher_dir} (training took {report_args['train_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
