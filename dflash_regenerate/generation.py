"""Answering: the teacher in transformers (batched, greedy or per-row sampled) or inference servers, and the
rows of one part regenerated with either."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from dflash_common.errors import BadRowError, ConfigError
from dflash_common.redact import display_url
from dflash_corpus import CorpusRow
from dflash_regenerate.chat_server import ChatServers, Completion, RequestRefused
from dflash_regenerate.conversations import Conversation, conversation_or_problem
from dflash_regenerate.part_plan import sample_seed
from dflash_regenerate.settings.regenerate_config import RegenerateConfig
from dflash_regenerate.settings.server_config import ServerConfig
from dflash_teacher.chat_template import (
    cut_at_stop,
    end_of_turn_text,
    error_text,
    render_chat,
    strip_end_of_turn,
    template_fault,
    tokenizer_render,
)
from dflash_teacher.sampling import top_p_filter
from dflash_teacher.teacher import TeacherConfig, load_teacher


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

    def answer_rounds(self, pending: list["Conversation"], cfg: RegenerateConfig):
        """(batch, answers) per generate call over the pending conversations; an answer is a
        Completion, or a problem string for a row whose chat template fails."""
        rendered = []
        for conversation in pending:
            try:
                rendered.append((conversation, self.render(conversation.messages, cfg.chat_template_kwargs)))
            except Exception as err:  # noqa: BLE001 - template errors are per row
                fault = template_fault(lambda m, g: render_chat(self.tokenizer, m, g, cfg.chat_template_kwargs), err,
                                       getattr(self.tokenizer, "name_or_path", "") or "the teacher")
                if fault:  # not a bad row: --on-bad-row skip would skip every row
                    raise ConfigError(fault) from None
                yield [conversation], [f"chat template failed: {error_text(err)}"]
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
    """OpenAI-compatible servers answering for the teacher (`dflash_regenerate.chat_server`)."""

    servers: ChatServers
    identity: dict

    def answer_rounds(self, pending: list["Conversation"], cfg: RegenerateConfig):
        """(batch, answers) per group of requests; `concurrency` of them are in flight at once."""
        group = cfg.server.concurrency * 4
        for start in range(0, len(pending), group):
            batch = pending[start:start + group]
            bodies = [self.body(c, cfg) for c in batch]
            answers = self.servers.complete_many(bodies)
            yield batch, [str(a) if isinstance(a, RequestRefused) else a for a in answers]

    @staticmethod
    def body(conversation: "Conversation", cfg: RegenerateConfig) -> dict:
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
        raise ConfigError(f"--served-model {cfg.served_model!r} is not served at {display_url(cfg.endpoints[0])} (it serves "
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
class PartOutcome:
    rows: list[dict]
    skipped: Counter
    tokens: int
    truncated: int
    empty: int = 0


def _bad(cfg: RegenerateConfig, err: BadRowError, skipped: Counter) -> None:
    if cfg.on_bad_row == "fail":
        raise err
    skipped["bad_row"] += 1


def _accept(cfg: RegenerateConfig, conversation: Conversation, text: str, reasoning: str | None, stopped: bool,
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
                    on_batch=lambda rows_done, tokens: None) -> PartOutcome:
    """Regenerate the answers of `rows` and return the output rows in source order.

    Every pending answer of a round is generated in batches (of similar prompt length for the
    local teacher; `concurrency` requests in flight for servers); round j answers turn j of every
    conversation that has one, so turn j sees regenerated turns < j.
    """
    skipped: Counter = Counter()
    conversations: list[Conversation] = []
    for row in rows:
        try:
            conversations.append(conversation_or_problem(row, cfg.keep_turns))
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
    return PartOutcome(rows=out, skipped=skipped, tokens=tokens, truncated=truncated, empty=empty)


