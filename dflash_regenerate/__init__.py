"""Stage 0: regenerate a chat corpus with the teacher: keep the prompts, replace the answers.

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

import importlib

# Which module holds each public name. They load when asked for, so the settings
# (dflash_regenerate.settings) import without torch, transformers or pyarrow: the command line
# reads its options from them.
_HOMES = {
    "command": ("regenerate",),
    "outputs": ("RESUME_KEYS", "SETTINGS", "RegenerateResult"),
    "settings.regenerate_config": ("KEEP_TURNS", "REASONING_POLICIES", "TRUNCATED_POLICIES", "RegenerateConfig", "parts_dir"),
    "conversations": ("chat_of_row",),
    "generation": ("RowSampler", "ServerGenerator", "TeacherGenerator", "load_generator", "load_server_generator",
                   "regenerate_rows"),
    "parts": ("commit_part", "committed_parts", "merge_parts"),
    "part_plan": ("part_name", "part_rows", "plan_turns", "rank_parts", "record_name", "sample_seed",
             "settings_mismatch"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(f"dflash_regenerate.{_HOME[name]}"), name)
    raise AttributeError(f"module 'dflash_regenerate' has no attribute {name!r}")
