"""What `dflash-cache regenerate` writes next to its output (the parts folder's names, the settings a
resume must match) and what it reports (RegenerateResult)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SETTINGS = ".settings.json"
# A part's or record's temporary name (see _write_atomic): ".part-000003.jsonl.tmp-1a2b3c4d".
PART_TEMPORARY = re.compile(r"^\.+part-(\d+)\.jsonl?\.tmp-")
# Every name regenerate writes in OUT.parts: parts (part_plan.part_name), their commit records
# (part_plan.record_name), the settings, and the temporaries of all three (".NAME.tmp-XXXXXXXX").
# --overwrite deletes only these.
_WRITTEN = rf"(?:part-\d{{6,}}\.jsonl|\.part-\d{{6,}}\.json|{re.escape(SETTINGS)})"
PARTS_ENTRY = re.compile(rf"^(?:{_WRITTEN}|\.{_WRITTEN}\.tmp-[0-9a-f]+)$")
# The one-writer lock files of OUT.parts (dflash_common.files.one_writer): one per rank, since
# the ranks of one regeneration write their own parts side by side. Never deleted: removing a held
# lock's file would let a second writer lock a new one.
LOCK_ENTRY = re.compile(r"^\.dflash(?:\.rank-\d+)?\.lock$")


def lock_name(rank: int, world_size: int) -> str:
    """The lock file of this rank in OUT.parts (a name LOCK_ENTRY matches)."""
    return ".dflash.lock" if world_size == 1 else f".dflash.rank-{rank}.lock"


SETTINGS_FORMAT = "dflash-regenerate"
SETTINGS_VERSION = 1
# Settings that change what is written; a resume must match all of them.
RESUME_KEYS = ("backend", "teacher", "tokenizer", "dtype", "corpus", "rows_per_part", "max_new_tokens",
               "keep_turns", "sampling", "on_truncated", "reasoning", "chat_template_kwargs")
# What settings files written before a key existed meant by its absence.
SETTINGS_DEFAULTS = {"backend": "transformers", "on_truncated": "keep", "reasoning": "drop", "chat_template_kwargs": None}


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
