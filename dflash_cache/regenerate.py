"""Regenerate a chat corpus with the teacher: keep the prompts, replace the answers.

DFlash drafters learn to predict what the target model itself would write, but public chat
datasets hold answers written by other models. `regenerate` keeps each row's system prompt and
user turns, asks the teacher for every assistant turn, and writes `{"id", "messages"}` rows in
the chat format `dflash-cache build` reads, with the source row's id.

Work is cut into parts of `rows_per_part` consecutive source rows; part i covers rows
`[i * P, (i + 1) * P)` whatever the number of processes, and rank r of a `torchrun` job does the
parts with `i % world_size == r`. Each part is written whole under a temporary name and renamed,
then a small commit record is written. A rerun skips committed parts, so a killed run resumes
with no gaps or duplicates. When every part is committed, the parts are concatenated in order
into the output (atomic rename), so the output does not depend on how many ranks made it.

Decoding: temperature 0 is the teacher's argmax (its checkpoint's sampling defaults are
ignored); in float32 a left-padded batch answers exactly as each prompt alone, in bfloat16 a
near-tie may flip (see RegenerateConfig.batch_size). Sampling draws each answer from its own
generator seeded by (seed, row id, turn), so batching, ranks and resuming do not change it
beyond such float effects.

Layout next to `OUT.jsonl`:

    OUT.parts/.settings.json          what the output depends on (checked on resume)
    OUT.parts/part-000000.jsonl       regenerated rows of source rows [0, P)
    OUT.parts/.part-000000.json       its commit record, written last

Internal files start with a dot so a corpus reader pointed at the folder skips them. After the
merge, the parts and records are deleted and only `.settings.json` stays, so a rerun knows the
output is complete and with which settings it was made.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import groupby

import torch
import xxhash

from dflash_cache.chat import cut_at_stop, end_of_turn_text, strip_end_of_turn, tokenizer_render, top_p_filter
from dflash_cache.chat_server import ChatServers, Completion, RequestRefused, ServerConfig
from dflash_cache.corpus import (
    BAD_ROW_POLICIES,
    CorpusConfig,
    CorpusRow,
    check_template_kwargs,
    corpus_fingerprint,
    count_rows,
    iter_rows,
    list_corpus_files,
    parse_messages,
    render_chat,
    row_id,
)
from dflash_cache.errors import BadRowError, ConfigError
from dflash_cache.progress import Progress
from dflash_cache.teacher import TeacherConfig, load_teacher, tokenizer_hashes
from dflash_cache.values import is_int

KEEP_TURNS = ("first", "all")
TRUNCATED_POLICIES = ("keep", "drop")
REASONING_POLICIES = ("drop", "keep")
SETTINGS = ".settings.json"
# A part's or record's temporary name (see _write_atomic): ".part-000003.jsonl.tmp-1a2b3c4d".
_PART_TEMPORARY = re.compile(r"^\.+part-(\d+)\.jsonl?\.tmp-")
_SETTINGS_FORMAT = "dflash-regenerate"
_SETTINGS_VERSION = 1
# Settings that change what is written; a resume must match all of them.
RESUME_KEYS = ("backend", "teacher", "tokenizer", "dtype", "corpus", "rows_per_part", "max_new_tokens",
               "keep_turns", "sampling", "on_truncated", "reasoning", "chat_template_kwargs")
# What settings files written before a key existed meant by its absence.
_SETTINGS_DEFAULTS = {"backend": "transformers", "on_truncated": "keep", "reasoning": "drop", "chat_template_kwargs": None}


@dataclass(frozen=True)
class RegenerateConfig:
    """Everything `dflash-cache regenerate` needs."""

    data: str
    """The source corpus: anything `corpus.iter_rows` reads (chat `messages` or ShareGPT
    `conversations`; plain `text` rows have no prompt and count as bad rows)."""

    out: str
    """The regenerated corpus, a local `.jsonl` file; its parts go to the sibling `.parts` folder."""

    teacher: TeacherConfig | None
    """Which model writes the answers (name_or_path, revision, dtype and device are used); None
    with `server`, whose endpoints serve it."""

    max_new_tokens: int = 2048
    """Longest answer per assistant turn, in tokens; longer answers are cut and counted."""

    temperature: float = 0.0
    """0 for greedy decoding (the teacher's argmax), else the sampling temperature."""

    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens holding this much probability."""

    batch_size: int = 16
    """Prompts per `generate` call (left-padded). In float32 a batch answers exactly as one
    prompt alone would; in bfloat16 the padded shapes round differently, so a near-tie (two
    tokens within bf16 rounding) can go the other way. Use float32 or batch size 1 where
    bit-for-bit equality with unbatched generation matters."""

    keep_turns: str = "first"
    """'first': the messages before the first answer (system prompt and first user turn) and one
    answer; 'all': every user turn, answered turn by turn so each answer sees the regenerated
    earlier ones (see plan_turns)."""

    on_bad_row: str = "fail"
    """An unusable row: 'fail' (stop naming its file and row) or 'skip' (count it and go on)."""

    seed: int = 0
    """Sampling seed; each (seed, row id, turn) has its own random stream."""

    rows_per_part: int = 256
    """Source rows per part file: the unit of resuming and of splitting across ranks."""

    overwrite: bool = False
    """Delete an earlier output and its parts and start over (otherwise a rerun resumes)."""

    rank: int = 0
    """This process's rank in a multi-process run (torchrun's RANK)."""

    world_size: int = 1
    """Number of processes sharing the work (torchrun's WORLD_SIZE)."""

    server: ServerConfig | None = None
    """Ask OpenAI-compatible inference servers (vLLM, SGLang) instead of loading the teacher here."""

    on_truncated: str = "keep"
    """An answer cut at max_new_tokens (finish_reason 'length') or empty: 'keep' writes it and
    counts it (truncated, empty); 'drop' leaves its row out, counted as skipped 'truncated'/'empty'."""

    reasoning: str = "drop"
    """Reasoning a server returns apart from the answer (reasoning_content): 'drop' it, or 'keep'
    it as the message's reasoning_content, which chat templates render the teacher's way."""

    chat_template_kwargs: dict | None = None
    """Extra chat-template variables (e.g. {"enable_thinking": false}): passed to the local
    template, or sent to servers as chat_template_kwargs; build, eval and serving must use the same."""

    def __post_init__(self):
        if not isinstance(self.data, str) or not self.data.strip():
            raise ConfigError(f"data={self.data!r} is empty; pass the source corpus file, folder or glob")
        if not isinstance(self.out, str) or not self.out.endswith(".jsonl"):
            raise ConfigError(f"out={self.out!r} must be a .jsonl file path; e.g. regenerated.jsonl")
        if self.server is None and not isinstance(self.teacher, TeacherConfig):
            raise ConfigError(f"teacher={self.teacher!r} must be a TeacherConfig; e.g. TeacherConfig('Qwen/Qwen3-8B'), "
                              "or ask servers with --endpoint and --served-model")
        if self.server is not None and not isinstance(self.server, ServerConfig):
            raise ConfigError(f"server={self.server!r} must be a ServerConfig")
        if self.on_truncated not in TRUNCATED_POLICIES:
            raise ConfigError(f"on_truncated={self.on_truncated!r} is unknown; use 'keep' or 'drop'")
        check_template_kwargs(self.chat_template_kwargs)
        if self.reasoning not in REASONING_POLICIES:
            raise ConfigError(f"reasoning={self.reasoning!r} is unknown; use 'drop' or 'keep'")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens!r} must be a positive integer; e.g. 2048")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature!r} must be 0 (greedy) or a positive number; e.g. 0.7")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p!r} must be in (0, 1]; e.g. 0.95, or 1 to sample from all tokens")
        if not is_int(self.batch_size) or self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size!r} must be a positive integer; e.g. 16")
        if self.keep_turns not in KEEP_TURNS:
            raise ConfigError(f"keep_turns={self.keep_turns!r} is unknown; use 'first' or 'all'")
        if self.on_bad_row not in BAD_ROW_POLICIES:
            raise ConfigError(f"on_bad_row={self.on_bad_row!r} is unknown; use 'fail' or 'skip'")
        if not is_int(self.seed) or self.seed < 0:
            raise ConfigError(f"seed={self.seed!r} must be a non-negative integer; e.g. 0")
        if not is_int(self.rows_per_part) or self.rows_per_part < 1:
            raise ConfigError(f"rows_per_part={self.rows_per_part!r} must be a positive integer; e.g. 256")
        if not is_int(self.world_size) or self.world_size < 1:
            raise ConfigError(f"world_size={self.world_size!r} must be a positive integer (torchrun's WORLD_SIZE)")
        if not is_int(self.rank) or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank={self.rank!r} must be in 0..{self.world_size - 1} (torchrun's RANK)")
        if self.overwrite and self.world_size > 1:
            # Each rank would delete the others' fresh parts; starting over is a one-process job.
            raise ConfigError(f"overwrite with world_size={self.world_size} would let ranks delete each other's "
                              f"parts; delete {self.out} and {parts_dir(self.out)} first, then start the ranks")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RegenerateResult:
    """What a call did and where the output stands."""

    out: str
    """The output file."""
    complete: bool
    """True when `out` holds every source row (merged now or by an earlier run)."""
    rows: int = 0
    """Rows in the output (when complete), else rows written by this call."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Source rows left out, by reason (when complete: over the whole run)."""
    tokens: int = 0
    """Generated tokens (when complete: over the whole run)."""
    truncated: int = 0
    """Answers cut at max_new_tokens (when complete: over the whole run)."""
    empty: int = 0
    """Answers the teacher ended at once, with no text (when complete: over the whole run)."""
    parts_written: int = 0
    """Parts this call generated."""
    parts_missing: int = 0
    """Parts not committed yet (other ranks still at work), when not complete."""


# ---------------------------------------------------------------------------------------------
# Small pure pieces


def parts_dir(out: str) -> str:
    """The folder holding `out`'s parts: `OUT.parts` for `OUT.jsonl`."""
    return out[: -len(".jsonl")] + ".parts" if out.endswith(".jsonl") else out + ".parts"


def part_name(index: int) -> str:
    return f"part-{index:06d}.jsonl"


def record_name(index: int) -> str:
    return f".part-{index:06d}.json"


def part_rows(index: int, rows_per_part: int, total_rows: int) -> tuple[int, int]:
    """Source rows [start, end) of part `index`."""
    return index * rows_per_part, min((index + 1) * rows_per_part, total_rows)


def rank_parts(num_parts: int, rank: int, world_size: int) -> list[int]:
    """The parts rank `rank` owns: fixed row ranges dealt round-robin, so every world size cuts
    the corpus the same way and the merged output is the same."""
    return list(range(rank, num_parts, world_size))


def ranks_from_env(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(rank, world_size) from torchrun's RANK and WORLD_SIZE; (0, 1) without them."""
    environ = os.environ if environ is None else environ
    values = []
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1")):
        text = environ.get(name, default)
        try:
            values.append(int(text))
        except ValueError:
            raise ConfigError(f"environment variable {name}={text!r} is not an integer; "
                              f"launch with torchrun or unset it") from None
    rank, world = values
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} and WORLD_SIZE={world} are inconsistent (need 0 <= RANK < WORLD_SIZE); "
                          f"launch with torchrun or unset them")
    return rank, world


def plan_turns(messages: list[dict], keep_turns: str) -> list[list[dict]]:
    """The prompt messages that precede each answer to generate.

    Group j holds the system and user messages between answer j-1 and answer j. Assistant
    messages are dropped (they are what is regenerated); an answer is due after each run of
    messages that holds a user turn, including a trailing user turn with no answer in the
    source. 'first' keeps only the first group. Raises ValueError(problem) when there is no
    user turn, or when a tool message would have to follow a regenerated answer (its result
    answers a call the teacher may not make).
    """
    if keep_turns not in KEEP_TURNS:
        raise ConfigError(f"keep_turns={keep_turns!r} is unknown; use 'first' or 'all'")
    groups: list[list[dict]] = []
    current: list[dict] = []
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "assistant":
            # An answer with no new user turn before it (a greeting, a second reply) has no
            # prompt of its own: it is dropped with the rest of the source answers.
            if any(m["role"] == "user" for m in current):
                groups.append(current)
                current = []
                if keep_turns == "first":
                    return groups
        elif role == "tool":
            raise ValueError(f"messages[{i}] is a tool turn, which cannot follow a regenerated answer; "
                             f"drop such rows or regenerate them outside dflash")
        else:
            current.append({"role": role, "content": message["content"]})
    if any(m["role"] == "user" for m in current):
        groups.append(current)  # a trailing user turn still gets an answer
    if not groups:
        raise ValueError("conversation has no user turn to regenerate")
    return groups[:1] if keep_turns == "first" else groups


def sample_seed(seed: int, row: str, turn: int) -> int:
    """The random stream of one answer: a pure function of (seed, row id, turn), so batching,
    ranks and resuming do not change which numbers a row draws."""
    return xxhash.xxh64_intdigest(f"{seed}\0{row}\0{turn}".encode()) & ((1 << 63) - 1)


def settings_mismatch(existing: dict, current: dict, keys: Iterable[str] = RESUME_KEYS) -> str | None:
    """The first of `keys` whose value differs, said for a user, or None."""
    for key in keys:
        before = existing.get(key, _SETTINGS_DEFAULTS.get(key))
        if before != current.get(key):
            return f"{key} differs (earlier run: {_short(before)}, this run: {_short(current.get(key))})"
    return None


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 160 else text[:157] + "..."


# ---------------------------------------------------------------------------------------------
# Rows -> conversations to answer


def chat_of_row(row: CorpusRow) -> list[dict]:
    """The row's chat as [{role, content}] (canonical roles); raises BadRowError.

    parse_messages validates roles and contents but requires an assistant turn; prompt-only
    rows are fine input here, so a placeholder answer is appended for the check and dropped.
    """
    if row.problem is not None or row.data is None:
        raise BadRowError(row.path, row.row, row.problem or "row has no data")
    data = dict(row.data)
    chat_field = next((f for f in ("messages", "conversations") if data.get(f) is not None), None)
    if chat_field is not None and isinstance(data[chat_field], (list, tuple)):
        placeholder = {"role": "assistant", "content": ""} if chat_field == "messages" else {"from": "gpt", "value": ""}
        data[chat_field] = list(data[chat_field]) + [placeholder]
    content = parse_messages(CorpusRow(index=row.index, path=row.path, row=row.row, data=data, problem=None))
    if isinstance(content, str):
        raise BadRowError(row.path, row.row, "plain 'text' row has no user turn to regenerate (use chat rows)")
    return content[:-1] if chat_field is not None else content


@dataclass
class _Conversation:
    """One source row being regenerated turn by turn."""

    row: CorpusRow
    id: str
    groups: list[list[dict]]
    messages: list[dict] = field(default_factory=list)
    turn: int = 0
    failed: str | None = None

    @property
    def done(self) -> bool:
        return self.failed is not None or self.turn == len(self.groups)


def _conversation_or_problem(row: CorpusRow, keep_turns: str) -> _Conversation:
    chat = chat_of_row(row)
    try:
        groups = plan_turns(chat, keep_turns)
    except ValueError as err:
        raise BadRowError(row.path, row.row, str(err)) from None
    conversation = _Conversation(row=row, id=row_id(row.data), groups=groups)
    conversation.messages.extend(groups[0])
    return conversation


# ---------------------------------------------------------------------------------------------
# Generation


class RowSampler:
    """A logits processor that samples each batch row from its own generator and hands
    `generate` a one-hot choice, so greedy selection returns the sampled token. The batch's
    shared RNG would make a row's draws depend on its batch neighbours."""

    def __init__(self, generators: list[torch.Generator], temperature: float, top_p: float):
        self.generators, self.temperature, self.top_p = generators, temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = top_p_filter(torch.softmax(scores.float() / self.temperature, dim=-1), self.top_p)
        chosen = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(self.generators)])
        out = torch.full_like(scores, float("-inf"))
        return out.scatter(-1, chosen[:, None], 0.0)


@dataclass
class TeacherGenerator:
    """A loaded teacher ready to answer prompts."""

    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    stop_ids: list[int]
    pad_id: int
    end_of_turn: str
    identity: dict

    def render(self, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
        # Rendered to text then tokenized without special tokens, as the build tokenizes chats.
        text = render_chat(self.tokenizer, messages, True, chat_template_kwargs)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 sampler: RowSampler | None) -> list[tuple[list[int], bool]]:
        """Answer ids per prompt (up to the first stop token) and whether a stop token ended it."""
        from transformers import GenerationConfig, LogitsProcessorList

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[i, width - len(prompt):] = 1
        config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                                  eos_token_id=self.stop_ids, pad_token_id=self.pad_id)
        output = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
            generation_config=config,
            logits_processor=LogitsProcessorList([sampler]) if sampler is not None else None,
        )
        return [cut_at_stop(row[width:].tolist(), self.stop_ids) for row in output.cpu()]

    def decode(self, ids: list[int]) -> str:
        return strip_end_of_turn(self.tokenizer.decode(ids, skip_special_tokens=True), self.end_of_turn)

    def answer_rounds(self, pending: list["_Conversation"], cfg: RegenerateConfig):
        """(batch, answers) per generate call over the pending conversations; an answer is a
        Completion, or a problem string for a row whose chat template fails."""
        rendered = []
        for conversation in pending:
            try:
                rendered.append((conversation, self.render(conversation.messages, cfg.chat_template_kwargs)))
            except Exception as err:  # noqa: BLE001 - template errors are per row
                first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
                yield [conversation], [f"chat template failed: {first_line}"]
        # Longest first, stable: similar lengths share a batch and the order is reproducible.
        rendered.sort(key=lambda item: -len(item[1]))
        for start in range(0, len(rendered), cfg.batch_size):
            batch = rendered[start:start + cfg.batch_size]
            sampler = None
            if not cfg.greedy:
                generators = []
                for conversation, _ in batch:
                    g = torch.Generator(device=self.device)
                    g.manual_seed(sample_seed(cfg.seed, conversation.id, conversation.turn))
                    generators.append(g)
                sampler = RowSampler(generators, cfg.temperature, cfg.top_p)
            answers = self.generate([prompt for _, prompt in batch], cfg.max_new_tokens, sampler)
            yield [c for c, _ in batch], [
                Completion(text=self.decode(ids), reasoning=None, tokens=len(ids) + (1 if stopped else 0),
                           finish_reason="stop" if stopped else "length") for ids, stopped in answers]


@dataclass
class ServerGenerator:
    """OpenAI-compatible servers answering for the teacher (`dflash_cache.chat_server`)."""

    servers: ChatServers
    identity: dict

    def answer_rounds(self, pending: list["_Conversation"], cfg: RegenerateConfig):
        """(batch, answers) per group of requests; `concurrency` of them are in flight at once."""
        group = cfg.server.concurrency * 4
        for start in range(0, len(pending), group):
            batch = pending[start:start + group]
            bodies = [self.body(c, cfg) for c in batch]
            answers = self.servers.complete_many(bodies)
            yield batch, [str(a) if isinstance(a, RequestRefused) else a for a in answers]

    @staticmethod
    def body(conversation: "_Conversation", cfg: RegenerateConfig) -> dict:
        """The chat-completions request of a conversation's next answer."""
        body = {"messages": conversation.messages, "max_tokens": cfg.max_new_tokens,
                "temperature": float(cfg.temperature), "top_p": float(cfg.top_p) if not cfg.greedy else 1.0}
        if not cfg.greedy:  # each answer its own stream, as the local backend draws it
            body["seed"] = sample_seed(cfg.seed, conversation.id, conversation.turn) & 0x7FFFFFFF
        if cfg.chat_template_kwargs:
            body["chat_template_kwargs"] = cfg.chat_template_kwargs
        return body


def load_server_generator(cfg: ServerConfig, on_retry=lambda url, error: None) -> ServerGenerator:
    """Servers ready to answer; refuses a --served-model the first endpoint does not serve."""
    servers = ChatServers(cfg, on_retry)
    served = servers.model_ids()
    if cfg.served_model not in served:
        servers.close()
        raise ConfigError(f"--served-model {cfg.served_model!r} is not served at {cfg.endpoints[0]} (it serves "
                          f"{', '.join(served) or 'nothing'}); pass one of those names")
    return ServerGenerator(servers=servers, identity={"served_model": cfg.served_model})


def load_generator(cfg: TeacherConfig) -> TeacherGenerator:
    """Load the teacher for generation, with none of its shipped sampling defaults.

    A checkpoint's generation_config.json may set temperature, top-k or a repetition penalty;
    those would make "greedy" differ from the teacher's argmax, which is what speculative
    decoding verifies against, so only eos and pad ids are kept.
    """
    from transformers import GenerationConfig

    teacher = load_teacher(cfg)
    model, tokenizer = teacher.model, teacher.tokenizer
    if not tokenizer.chat_template:
        raise ConfigError(f"the tokenizer of {cfg.name_or_path!r} has no chat template, so prompts cannot be "
                          f"rendered; use a chat (instruct) model as the teacher")
    end_of_turn = end_of_turn_text(tokenizer_render(tokenizer))
    stop_ids = teacher.stop_token_ids()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    model.generation_config = GenerationConfig(eos_token_id=stop_ids, pad_token_id=pad_id,
                                               bos_token_id=getattr(model.generation_config, "bos_token_id", None))
    return TeacherGenerator(model=model, tokenizer=tokenizer, device=teacher.device, stop_ids=stop_ids,
                            pad_id=pad_id, end_of_turn=end_of_turn, identity=teacher.identity)


@dataclass
class _PartOutcome:
    rows: list[dict]
    skipped: Counter
    tokens: int
    truncated: int
    empty: int = 0


def _bad(cfg: RegenerateConfig, err: BadRowError, skipped: Counter) -> None:
    if cfg.on_bad_row == "fail":
        raise err
    skipped["bad_row"] += 1


def _accept(cfg: RegenerateConfig, conversation: _Conversation, text: str, reasoning: str | None, stopped: bool,
            skipped: Counter) -> tuple[bool, bool]:
    """Record one answer; returns (the conversation is finished now, the answer was cut)."""
    cut = not stopped
    if (cut or not text.strip()) and cfg.on_truncated == "drop":
        conversation.failed = "truncated" if cut else "empty"
        skipped[conversation.failed] += 1
        return True, cut
    message = {"role": "assistant", "content": text}
    if reasoning and cfg.reasoning == "keep":
        message["reasoning_content"] = reasoning
    conversation.messages.append(message)
    conversation.turn += 1
    if conversation.turn < len(conversation.groups):
        conversation.messages.extend(conversation.groups[conversation.turn])
        return False, cut
    return True, cut


def regenerate_rows(rows: list[CorpusRow], cfg: RegenerateConfig, gen: "TeacherGenerator | ServerGenerator",
                    on_batch=lambda rows_done, tokens: None) -> _PartOutcome:
    """Regenerate the answers of `rows` and return the output rows in source order.

    Every pending answer of a round is generated in batches (of similar prompt length for the
    local teacher; `concurrency` requests in flight for servers); round j answers turn j of every
    conversation that has one, so turn j sees regenerated turns < j.
    """
    skipped: Counter = Counter()
    conversations: list[_Conversation] = []
    for row in rows:
        try:
            conversations.append(_conversation_or_problem(row, cfg.keep_turns))
        except BadRowError as err:
            _bad(cfg, err, skipped)
            on_batch(1, 0)
    tokens = truncated = empty = 0
    while True:
        pending = [c for c in conversations if not c.done]
        if not pending:
            break
        for batch, answers in gen.answer_rounds(pending, cfg):
            finished = batch_tokens = 0
            for conversation, answer in zip(batch, answers):
                if isinstance(answer, str):  # a problem of this row
                    conversation.failed = answer
                    _bad(cfg, BadRowError(conversation.row.path, conversation.row.row, answer), skipped)
                    finished += 1
                    continue
                done, cut = _accept(cfg, conversation, answer.text, answer.reasoning, answer.stopped, skipped)
                finished += done
                truncated += cut
                empty += not cut and not answer.text.strip()
                batch_tokens += answer.tokens
            tokens += batch_tokens
            on_batch(finished, batch_tokens)
    out = [{"id": c.id, "messages": c.messages} for c in conversations if c.failed is None]
    return _PartOutcome(rows=out, skipped=skipped, tokens=tokens, truncated=truncated, empty=empty)


# ---------------------------------------------------------------------------------------------
# Parts on disk


def _write_atomic(path: str, data: bytes) -> None:
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError:
        raise ConfigError(f"{path} is not valid JSON (damaged); delete it or rerun with --overwrite") from None


def _rows_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def commit_part(folder: str, index: int, rows_span: tuple[int, int], outcome: _PartOutcome) -> dict:
    """Write part `index` whole, then its record (the commit); returns the record."""
    data = _rows_bytes(outcome.rows)
    _write_atomic(os.path.join(folder, part_name(index)), data)
    record = {"index": index, "rows": list(rows_span), "written": len(outcome.rows), "skipped": dict(outcome.skipped),
              "tokens": outcome.tokens, "truncated": outcome.truncated, "empty": outcome.empty, "bytes": len(data),
              "checksum": xxhash.xxh64_hexdigest(data)}
    _write_atomic(os.path.join(folder, record_name(index)), (json.dumps(record) + "\n").encode())
    return record


def committed_parts(folder: str, num_parts: int) -> dict[int, dict]:
    """Records of the committed parts, by index; a part counts once its record and file exist."""
    committed = {}
    for index in range(num_parts):
        record = _read_json(os.path.join(folder, record_name(index)))
        if record is not None and os.path.exists(os.path.join(folder, part_name(index))):
            committed[index] = record
    return committed


def _sum_records(records: Iterable[dict]) -> tuple[int, Counter, int, int, int]:
    rows, skipped, tokens, truncated, empty = 0, Counter(), 0, 0, 0
    for record in records:
        rows += record["written"]
        skipped.update(record["skipped"])
        tokens += record["tokens"]
        truncated += record["truncated"]
        empty += record.get("empty", 0)  # records written before it was counted
    return rows, skipped, tokens, truncated, empty


def merge_parts(out: str, progress: Progress | None = None) -> RegenerateResult:
    """Concatenate the committed parts in row order into `out` (atomic rename), then delete
    them. Refuses, naming the first gap, when a part is missing. Safe to run by several ranks
    at once: each writes identical bytes, and one that finds the parts gone reports the
    merge another rank finished."""
    progress = progress or Progress()
    folder = parts_dir(out)
    settings = _read_json(os.path.join(folder, SETTINGS))
    if settings is None:
        raise ConfigError(f"{folder} holds no regeneration to merge (no {SETTINGS}); run `dflash-cache regenerate` first")
    if settings.get("merged") is not None and os.path.exists(out):
        return _complete_result(out, settings["merged"])
    total_rows, per_part = settings["corpus"]["rows"], settings["rows_per_part"]
    num_parts = math.ceil(total_rows / per_part)
    records = committed_parts(folder, num_parts)
    missing = [i for i in range(num_parts) if i not in records]
    if missing:
        first = part_rows(missing[0], per_part, total_rows)
        raise ConfigError(f"cannot merge {out}: {len(missing)} of {num_parts} part(s) are not written yet (first: "
                          f"{part_name(missing[0])}, source rows {first[0]}..{first[1] - 1}); finish every rank, "
                          f"or rerun the command to generate them")
    tmp = os.path.join(os.path.dirname(os.path.abspath(out)), f".{os.path.basename(out)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as dst:
            for index in range(num_parts):
                with open(os.path.join(folder, part_name(index)), "rb") as src:
                    data = src.read()
                if xxhash.xxh64_hexdigest(data) != records[index]["checksum"]:
                    raise ConfigError(f"{os.path.join(folder, part_name(index))} does not match its record (changed "
                                      f"after it was written); delete it and {record_name(index)} and rerun to redo it")
                dst.write(data)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, out)
    except FileNotFoundError:
        # Another rank merged first and deleted the parts.
        if os.path.exists(tmp):
            os.remove(tmp)
        settings = _read_json(os.path.join(folder, SETTINGS)) or {}
        if settings.get("merged") is not None and os.path.exists(out):
            return _complete_result(out, settings["merged"])
        raise
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    rows, skipped, tokens, truncated, empty = _sum_records(records.values())
    merged = {"rows": rows, "skipped": dict(skipped), "tokens": tokens, "truncated": truncated, "empty": empty,
              "checksum": _file_checksum(out)}
    _write_atomic(os.path.join(folder, SETTINGS), (json.dumps(dict(settings, merged=merged), indent=1) + "\n").encode())
    for index in range(num_parts):  # the merged file holds it all now; keep only the settings
        for name in (record_name(index), part_name(index)):
            try:
                os.remove(os.path.join(folder, name))
            except FileNotFoundError:
                pass
    result = _complete_result(out, merged)
    progress.message(f"wrote {rows:,} rows to {out}" + _summary(result))
    return result


def _file_checksum(path: str) -> str:
    digest = xxhash.xxh64()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _complete_result(out: str, merged: dict) -> RegenerateResult:
    return RegenerateResult(out=out, complete=True, rows=merged["rows"], skipped=dict(merged["skipped"]),
                            tokens=merged["tokens"], truncated=merged["truncated"], empty=merged.get("empty", 0))


def _summary(result: RegenerateResult) -> str:
    parts = []
    if result.skipped:
        parts.append("skipped " + ", ".join(f"{k}: {v}" for k, v in sorted(result.skipped.items())))
    if result.truncated:
        parts.append(f"{result.truncated:,} answer(s) cut at --max-new-tokens")
    if result.empty:
        parts.append(f"{result.empty:,} empty answer(s)")
    return ("; " + "; ".join(parts)) if parts else ""


# ---------------------------------------------------------------------------------------------
# The command


def _check_paths(cfg: RegenerateConfig, files: list[str]) -> None:
    out, folder = os.path.abspath(cfg.out), os.path.abspath(parts_dir(cfg.out))
    data = os.path.abspath(os.path.expanduser(cfg.data))
    inside = os.path.isdir(data) and os.path.commonpath([data, out]) == data
    listed = any(os.path.abspath(f) == out or os.path.abspath(f).startswith(folder + os.sep) for f in files)
    if inside or listed:
        raise ConfigError(f"--out {cfg.out} lies inside --data {cfg.data}, so the output would be read back as input; "
                          f"write it outside the corpus folder")


def _plain_settings(cfg: RegenerateConfig, files: list[str], total_rows: int) -> dict:
    """The settings known without loading the teacher."""
    # Greedy decoding ignores seed and top-p, so changing them does not change the output.
    sampling = ({"temperature": 0.0} if cfg.greedy else
                {"temperature": float(cfg.temperature), "top_p": float(cfg.top_p), "seed": cfg.seed})
    server = cfg.server
    return {
        "format": _SETTINGS_FORMAT,
        "version": _SETTINGS_VERSION,
        "backend": "server" if server else "transformers",
        # the endpoints may move (other hosts, ports); the served model and the settings define the output
        "teacher_name": server.served_model if server else cfg.teacher.name_or_path,
        "dtype": None if server else cfg.teacher.dtype,
        "corpus": {"fingerprint": corpus_fingerprint(files), "rows": total_rows},
        "rows_per_part": cfg.rows_per_part,
        "max_new_tokens": cfg.max_new_tokens,
        "keep_turns": cfg.keep_turns,
        "sampling": sampling,
        "on_truncated": cfg.on_truncated,
        "reasoning": cfg.reasoning,
        "chat_template_kwargs": cfg.chat_template_kwargs,
    }


def _teacher_settings(gen: "TeacherGenerator | ServerGenerator") -> dict:
    if isinstance(gen, ServerGenerator):
        return {"teacher": gen.identity, "tokenizer": None}
    identity = {k: v for k, v in gen.identity.items() if k not in ("name", "revision")}  # hashes name it; paths move
    return {"teacher": identity, "tokenizer": tokenizer_hashes(gen.tokenizer)}


def _refuse_mismatch(cfg: RegenerateConfig, existing: dict, settings: dict, keys: Iterable[str]) -> None:
    settings_path = os.path.join(parts_dir(cfg.out), SETTINGS)
    if existing.get("format") != _SETTINGS_FORMAT or existing.get("version") != _SETTINGS_VERSION:
        raise ConfigError(f"{settings_path} was written by another tool or version; pass --overwrite to start over")
    problem = settings_mismatch(existing, settings, keys)
    if problem:
        raise ConfigError(f"{cfg.out} was regenerated with other settings: {problem}; rerun with the earlier settings "
                          f"to resume, or pass --overwrite to start over")


def _prepare(cfg: RegenerateConfig, settings: dict) -> dict | None:
    """Check or start OUT.parts; returns the merged summary when the output is already complete."""
    folder = parts_dir(cfg.out)
    settings_path = os.path.join(folder, SETTINGS)
    if cfg.overwrite:
        if os.path.isdir(folder):
            shutil.rmtree(folder)
        if os.path.exists(cfg.out):
            os.remove(cfg.out)
    existing = _read_json(settings_path)
    if existing is None:
        if os.path.exists(cfg.out):
            raise ConfigError(f"{cfg.out} already exists and {folder} does not say how it was made; choose another "
                              f"--out, or pass --overwrite to replace it")
        # Temporaries may be another rank writing the settings right now.
        if os.path.isdir(folder) and any(".tmp-" not in name for name in os.listdir(folder)):
            raise ConfigError(f"{folder} is not empty but has no {SETTINGS}; delete it or pass --overwrite")
        os.makedirs(folder, exist_ok=True)
        _write_atomic(settings_path, (json.dumps(settings, indent=1) + "\n").encode())
        return None
    _refuse_mismatch(cfg, existing, settings, RESUME_KEYS)
    merged = existing.get("merged")
    if merged is not None:
        if not os.path.exists(cfg.out):
            # Deleted after the merge, and its parts went with the merge: generate it again.
            _write_atomic(settings_path, (json.dumps(settings, indent=1) + "\n").encode())
            return None
        if _file_checksum(cfg.out) != merged.get("checksum"):
            raise ConfigError(f"{cfg.out} changed since this command finished it; keep it, or pass --overwrite to "
                              f"regenerate it")
    return merged


def _remove_stale_temporaries(cfg: RegenerateConfig) -> None:
    """Delete temporaries a killed run left (never committed, so never read). With several
    ranks, only those of this rank's parts: another rank may be writing its own right now."""
    folder = parts_dir(cfg.out)
    stale = []
    for name in os.listdir(folder):
        match = _PART_TEMPORARY.match(name)
        if match and int(match.group(1)) % cfg.world_size == cfg.rank:
            stale.append(os.path.join(folder, name))
        elif ".tmp-" in name and cfg.world_size == 1:
            stale.append(os.path.join(folder, name))
    if cfg.world_size == 1:  # an interrupted merge
        out_dir, base = os.path.split(os.path.abspath(cfg.out))
        stale.extend(os.path.join(out_dir, n) for n in os.listdir(out_dir) if n.startswith(f".{base}.tmp-"))
    for path in stale:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def regenerate(cfg: RegenerateConfig, progress: Progress | None = None) -> RegenerateResult:
    """Regenerate this rank's parts (skipping committed ones) and merge when all are done."""
    progress = progress or Progress()
    files = list_corpus_files(cfg.data)
    _check_paths(cfg, files)
    total_rows = count_rows(files)
    if total_rows == 0:
        raise ConfigError(f"the corpus {cfg.data!r} has no rows; point --data at a non-empty file")
    settings = _plain_settings(cfg, files, total_rows)
    existing = None if cfg.overwrite else _read_json(os.path.join(parts_dir(cfg.out), SETTINGS))
    if existing is not None:  # refuse what can be refused before spending minutes loading a large teacher
        _refuse_mismatch(cfg, existing, settings, [k for k in RESUME_KEYS if k in settings])
    if cfg.server is not None:
        gen = load_server_generator(cfg.server, on_retry=lambda url, error: progress.message(
            f"retrying a request to {url} ({error[:160]})"))
        try:
            return _regenerate_with(cfg, gen, settings, files, total_rows, progress)
        finally:
            gen.servers.close()
    return _regenerate_with(cfg, load_generator(cfg.teacher), settings, files, total_rows, progress)


def _regenerate_with(cfg: RegenerateConfig, gen: "TeacherGenerator | ServerGenerator", settings: dict,
                     files: list[str], total_rows: int, progress: Progress) -> RegenerateResult:
    merged = _prepare(cfg, {**settings, **_teacher_settings(gen)})
    if merged is not None:
        result = _complete_result(cfg.out, merged)
        progress.message(f"{cfg.out} is already complete ({result.rows:,} rows); nothing to do")
        return result

    folder = parts_dir(cfg.out)
    _remove_stale_temporaries(cfg)
    num_parts = math.ceil(total_rows / cfg.rows_per_part)
    mine = rank_parts(num_parts, cfg.rank, cfg.world_size)
    done = committed_parts(folder, num_parts)
    todo = [i for i in mine if i not in done]
    if len(todo) < len(mine):
        progress.message(f"resuming: {len(mine) - len(todo)} of {len(mine)} part(s) of rank {cfg.rank} "
                         f"already written, {len(todo)} to go")

    corpus = CorpusConfig(data=cfg.data, on_bad_row=cfg.on_bad_row)
    todo_set = set(todo)
    started = time.perf_counter()
    stats = {"rows": 0, "tokens": 0}

    def on_batch(rows_done: int, tokens: int) -> None:
        stats["rows"] += rows_done
        stats["tokens"] += tokens
        elapsed = max(time.perf_counter() - started, 1e-9)
        rates = {"rows/s": f"{stats['rows'] / elapsed:,.2f}", "tok/s": f"{stats['tokens'] / elapsed:,.0f}"}
        if isinstance(gen, ServerGenerator):
            rates["retries"] = str(gen.servers.retries)
        progress.advance(rows_done, **rates)

    written = 0
    spans = [part_rows(i, cfg.rows_per_part, total_rows) for i in todo]
    progress.start(sum(end - start for start, end in spans), "regenerating", "rows")
    try:
        if todo:
            last = todo[-1]
            source = iter_rows(corpus, start_row=todo[0] * cfg.rows_per_part)
            # One pass over the corpus (rows of other ranks' parts are read and passed over):
            # restarting the reader per part would rescan JSON Lines files from the top.
            for index, group in groupby(source, key=lambda r: r.index // cfg.rows_per_part):
                if index > last:
                    break
                if index not in todo_set:
                    continue
                outcome = regenerate_rows(list(group), cfg, gen, on_batch)
                commit_part(folder, index, part_rows(index, cfg.rows_per_part, total_rows), outcome)
                written += 1
    finally:
        progress.close()

    done = committed_parts(folder, num_parts)
    missing = num_parts - len(done)
    if missing:
        progress.message(f"rank {cfg.rank} finished its parts; {missing} part(s) of other ranks are still missing. "
                         f"The last rank to finish merges them, or rerun with --merge-only once all are done")
        rows, skipped, tokens, truncated, empty = _sum_records(done[i] for i in mine if i in done)
        return RegenerateResult(out=cfg.out, complete=False, rows=rows, skipped=dict(skipped), tokens=tokens,
                                truncated=truncated, empty=empty, parts_written=written, parts_missing=missing)
    result = merge_parts(cfg.out, progress)
    result.parts_written = written
    return result
