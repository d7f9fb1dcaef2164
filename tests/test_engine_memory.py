"""vLLM's share of a build's GPU (dflash_teacher.engine_memory): the LM head and the build's norm and
logits working set stay outside it, at the sizes of Qwen3.6-27B (vocab 248,320, hidden 5,120,
bf16) and the build's defaults."""

from __future__ import annotations

import pytest

from dflash_build.pipeline import build_shard_tokens
from dflash_build.settings.build_config import BuildConfig
from dflash_common.errors import ConfigError
from dflash_corpus.settings.corpus_config import CorpusConfig
from dflash_teacher.engine_memory import (
    BUILD_RESERVE_BYTES,
    ENGINE_SHARE_CAP,
    build_working_bytes,
    engine_gpu_share,
    engine_weight_bytes,
    head_bytes,
    tokens_per_generate,
)
from dflash_teacher.settings.teacher_config import TeacherConfig
from dflash_teacher.settings.vllm_args import VllmArgs

VOCAB, HIDDEN, BF16 = 248_320, 5_120, 2
H100 = 80 * 10**9  # an "80 GB" card; torch reports 79.2 GiB (85.0e9 bytes): this is the harder case
QWEN36_27B_WEIGHTS = 27_800_000_000 * BF16  # with its vision tower, as vLLM loads it without language_model_only


def _defaults() -> tuple[int, int]:
    """The head's bytes and the build's working set at the build's defaults for Qwen3.6-27B, with
    the recipe's --max-length 8192 (longer sequences than the default 4096: a larger bound)."""
    teacher, vllm = TeacherConfig(name_or_path="Qwen/Qwen3.6-27B"), VllmArgs()
    build = BuildConfig(out="y", corpus=CorpusConfig(data="x", max_length=8192), teacher=teacher, engine="vllm", vllm=vllm)
    shard = build_shard_tokens(build, teacher.num_tapped_layers, HIDDEN)
    assert 10_000 <= shard <= 10_100  # 512 MB of 5 bf16 taps a token
    tokens = tokens_per_generate(vllm.generate_tokens, shard, build.corpus.max_length)
    return head_bytes(VOCAB, HIDDEN, BF16), build_working_bytes(tokens, HIDDEN, VOCAB, teacher.logits_chunk,
                                                                teacher.top_k, BF16)


def test_an_80_gb_card_fits_the_head_the_working_set_and_the_engine_at_the_defaults():
    head, working = _defaults()
    assert head == 2_542_796_800
    share = engine_gpu_share(H100, head, working, QWEN36_27B_WEIGHTS)
    # vLLM's own 0.92 would not fit beside the build: that is what the share is for
    assert share < ENGINE_SHARE_CAP
    assert share * H100 + head + working + BUILD_RESERVE_BYTES <= H100
    assert share * H100 - QWEN36_27B_WEIGHTS > 10e9  # room for activations and KV cache
    # the same share is what a user may ask for, and a hair more is refused
    assert engine_gpu_share(H100, head, working, QWEN36_27B_WEIGHTS, requested=share) == share
    with pytest.raises(ConfigError, match=f"use at most {share}"):
        engine_gpu_share(H100, head, working, QWEN36_27B_WEIGHTS, requested=round(share + 0.002, 3))


def test_a_card_with_room_to_spare_keeps_vllms_default():
    head, working = _defaults()
    assert engine_gpu_share(141 * 10**9, head, working, QWEN36_27B_WEIGHTS) == ENGINE_SHARE_CAP


@pytest.mark.parametrize("kwargs, named", [
    ({"requested": 0.92}, "gpu_memory_utilization=0.92 leaves too little"),  # vLLM's default, asked for
    ({"card_bytes": 48 * 10**9}, "cannot hold the teacher's weights"),  # an L40S-sized card
    ({"working": 90 * 10**9}, "nothing is left for vLLM"),
])
def test_a_setting_that_cannot_fit_is_refused_in_one_line(kwargs, named):
    head, working = _defaults()
    given = {"card_bytes": H100, "head": head, "working": working, "engine_weights": QWEN36_27B_WEIGHTS, **kwargs}
    with pytest.raises(ConfigError, match=named) as err:
        engine_gpu_share(**given)
    assert "\n" not in str(err.value) and f"{given['card_bytes'] / 1e9:.1f} GB GPU" in str(err.value)


def test_the_working_set_is_the_norm_or_the_head_whichever_peaks():
    # one token a chunk: the norm's two fp32 copies beside the bf16 states dominate
    assert build_working_bytes(1000, 10, 7, 1, 0, BF16) == 1000 * 10 * (2 + 8)
    # a chunk of logits and its log_softmax beside the states, and the top-k of every position twice
    assert build_working_bytes(10, 10, 100_000, 8, 3, BF16) == 10 * 10 * 2 + 2 * 8 * 100_000 * 4 + 2 * 10 * 3 * 12


def test_a_generate_holds_whole_shards_each_past_its_budget_by_less_than_a_sequence():
    assert tokens_per_generate(65536, 10_000, 8192) == 6 * (10_000 + 8191)
    assert tokens_per_generate(1, 10_000, 100) == 10_099  # at least one shard


def test_the_engines_weights_leave_out_mtp_and_with_language_model_only_the_vision_tower():
    shapes = {"model.language_model.layers.0.w": (4, 8), "model.visual.blocks.0.w": (2, 8), "mtp.fc.weight": (8, 8),
              "lm_head.weight": (16, 8)}
    assert engine_weight_bytes(shapes, BF16, 1, False) == (32 + 16 + 128) * BF16
    assert engine_weight_bytes(shapes, BF16, 2, True) == (32 + 128) * BF16 // 2
