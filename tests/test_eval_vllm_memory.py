"""eval --engine vllm|both on one GPU (issue 42, finding 5): vLLM asks for a share of the whole GPU
and refuses to start unless that much is free, while eval held the teacher (54 GB at 27B), the
drafter and its fp32 embedding and head copies there. What a CPU can show: what the measuring
process still holds when vLLM starts, and the share it asks for from the memory that is free."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from dflash_common.devices import child_devices_of
from dflash_teacher.teacher import TeacherConfig, load_teacher
from dflash_train.measuring.commands import release_for_vllm, vllm_memory_share
from dflash_train.measuring.serving import ServingError
from dflash_train.settings.drafter_config import drafter_config_from_teacher
from dflash_train.training.model import DFlashDrafter

GIB = 1 << 30


def _pair(teacher_dir):
    teacher = load_teacher(TeacherConfig(name_or_path=teacher_dir("qwen3"), dtype="float32", layers=(0, 2), top_k=1))
    model = teacher.model
    cfg = drafter_config_from_teacher(model.config.to_dict(), (0, 2), mask_token_id=model.config.vocab_size - 1,
                                      block_size=4, num_hidden_layers=1)
    drafter = DFlashDrafter.build(cfg, model.get_input_embeddings().weight.detach(),
                                  model.get_output_embeddings().weight.detach(), "cpu")
    return teacher, drafter


def test_the_teacher_and_drafter_are_gone_when_vllm_starts_after_the_built_in_decoder(teacher_dir):
    """--engine both: nothing of the pair is left (the memory returns to the allocator)."""
    teacher, drafter = _pair(teacher_dir)
    held = [weakref.ref(teacher.model), weakref.ref(drafter), weakref.ref(teacher.model.get_output_embeddings().weight)]
    teacher, drafter = release_for_vllm(teacher, drafter, torch.device("cuda", 0), keep=False)
    gc.collect()
    assert teacher is None and drafter is None
    assert [ref() for ref in held] == [None, None, None]


def test_a_pair_kept_for_the_estimate_after_vllm_waits_in_host_memory(teacher_dir):
    """--engine vllm alone: the offline estimate after vLLM needs the pair, so it waits on the CPU."""
    teacher, drafter = _pair(teacher_dir)
    teacher, drafter = release_for_vllm(teacher, drafter, torch.device("cuda", 0), keep=True)
    tensors = [*teacher.model.parameters(), *teacher.model.buffers(), *drafter.parameters(), *drafter.buffers()]
    assert tensors and {t.device.type for t in tensors} == {"cpu"}


def test_vllm_asks_for_the_share_that_is_free():
    total = 141 * GIB
    assert vllm_memory_share(140 * GIB, total) == 0.9  # the pair left: vLLM's default
    # the pair still there (54 GB of teacher, ~10 GB of fp32 copies): vLLM's 0.9 would be refused
    share = vllm_memory_share(total - 66 * GIB, total)
    assert share == pytest.approx((total - 67 * GIB) / total, abs=1e-4) and share * total < total - 66 * GIB
    with pytest.raises(ServingError, match=r"only 0\.5 GiB of the GPU's 141\.0 GiB are free for vLLM") as caught:
        vllm_memory_share(GIB // 2, total)
    assert "\n" not in str(caught.value)


def test_vllm_runs_on_the_eval_devices_gpu():
    assert child_devices_of(torch.device("cuda", 3), None) == "3"
    assert child_devices_of(torch.device("cuda", 1), "4,6") == "6"
    assert child_devices_of(torch.device("cuda", 0), "GPU-77b0") == "GPU-77b0"
