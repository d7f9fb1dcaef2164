"""RegenerateConfig: what stage 0 regenerates, with what, into where."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from dflash_common.errors import ConfigError
from dflash_common.knobs import Knob, config_knobs
from dflash_common.template_kwargs import check_template_kwargs
from dflash_common.values import is_int
from dflash_corpus.settings.corpus_config import BAD_ROW_POLICIES
from dflash_regenerate.settings.server_config import ServerConfig
from dflash_teacher.settings.teacher_config import TeacherConfig

KEEP_TURNS = ("first", "all")


TRUNCATED_POLICIES = ("keep", "drop")


REASONING_POLICIES = ("drop", "keep")


def parts_dir(out: str) -> str:
    """The folder holding `out`'s parts: `OUT.parts` for `OUT.jsonl`."""
    return out[: -len(".jsonl")] + ".parts" if out.endswith(".jsonl") else out + ".parts"


def output_root(out: str) -> str:
    """The folder OUT and OUT.parts are in: every write and delete of regenerate goes through
    dflash_common.files with it as root, so a symlinked OUT.parts (or a link in it) is refused."""
    return os.path.dirname(os.path.abspath(out))


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
    """Delete an earlier output and its parts and start over (otherwise a rerun resumes). Only the
    files regenerate writes in OUT.parts are deleted; any other file there is refused."""

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


# Not options: rank and world size come from torchrun's environment (dflash_common.environment.rank_and_world); the
# retry backoff and the teacher fields below matter to a build only, not to answering prompts.
NOT_OPTIONS = ("rank", "world_size", "server.backoff_s", "teacher.device_map", "teacher.layers",
               "teacher.num_tapped_layers", "teacher.top_k", "teacher.batch_tokens", "teacher.logits_chunk")


def regenerate_knobs() -> tuple[Knob, ...]:
    """The options of `dflash-cache regenerate`: RegenerateConfig's fields, its teacher's and its server's."""
    return config_knobs(RegenerateConfig, exclude=NOT_OPTIONS)
