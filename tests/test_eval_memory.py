"""What a drafter loaded for eval holds on the teacher's device (issue 57): the teacher's own
embedding and LM head, not fp32 copies of them (~10 GB of the ~76 of 79 GiB an H100 peaked at
beside a bf16 27B teacher), with the greedy decoding those copies gave."""

from __future__ import annotations

import copy

import pytest
import torch
from test_speculative import copy_drafter, one_thread, run_teacher  # noqa: F401 (the fixture: one thread)

from dflash_teacher.teacher import TeacherConfig, load_teacher
from dflash_train.measuring.commands import release_for_vllm
from dflash_train.measuring.decode_report import load_pair
from dflash_train.measuring.replay import load_trained_drafter
from dflash_train.measuring.speculative import speculative_generate
from dflash_train.settings.drafter_config import drafter_config_from_teacher
from dflash_train.settings.spec_config import SpecConfig
from dflash_train.training.export import export_drafter, load_drafter
from dflash_train.training.model import DFlashDrafter


def own_bytes(drafter: torch.nn.Module, teacher: torch.nn.Module) -> int:
    """Bytes of the storages the drafter's tensors hold that none of the teacher's tensors share:
    what loading the drafter added on the device."""
    theirs = {t.untyped_storage().data_ptr() for t in [*teacher.parameters(), *teacher.buffers()]}
    mine = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*drafter.parameters(), *drafter.buffers()]}
    return sum(size for pointer, size in mine.items() if pointer not in theirs)


def _frozen(teacher) -> tuple[torch.Tensor, torch.Tensor]:
    return teacher.get_input_embeddings().weight.detach(), teacher.get_output_embeddings().weight.detach()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An fp32 teacher and a drafter that accepts several tokens a round, exported in fp32."""
    teacher = run_teacher("qwen3", 0.14)
    return teacher, export_drafter(copy_drafter(teacher, 4), tmp_path_factory.mktemp("drafter"), dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_drafter_reads_the_teachers_own_embedding_and_head(exported, dtype):
    fp32_teacher, folder = exported
    teacher = copy.deepcopy(fp32_teacher).to(dtype)
    embed, head = _frozen(teacher)
    before = load_drafter(folder, embed.float(), head.float(), dtype=torch.float32)  # what eval loaded until now
    after = load_trained_drafter(str(folder), embed, head, torch.device("cpu"))
    assert after.embed_weight.data_ptr() == embed.data_ptr() and after.lm_head_weight.data_ptr() == head.data_ptr()
    assert after.dtype == torch.float32 and after.embed_weight.dtype == dtype

    trained = sum(p.numel() * p.element_size() for p in after.parameters())
    copies = (embed.numel() + head.numel()) * 4
    held_before, held_after = own_bytes(before, teacher), own_bytes(after, teacher)
    print(f"{dtype}: drafter's own bytes beside the teacher {held_before:,} -> {held_after:,} "
          f"(trained weights {trained:,}, fp32 copies of embedding and head {copies:,})")
    assert held_after == trained
    # a bf16 teacher's tensors were copied in fp32; an fp32 teacher's were already shared
    assert held_before == trained + (copies if dtype == torch.bfloat16 else 0)

    # the same drafts as from the fp32 copies: logits and embeddings equal, greedy decoding too
    states = torch.randn(5, after.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([0, 3, 31])
    assert torch.equal(after.logits(states), before.logits(states)) and torch.equal(after.embed(ids), before.embed(ids))
    cfg = SpecConfig(max_new_tokens=24)
    for prompt in ([3, 7, 3, 9, 12], [5, 5, 1], [20, 2, 17, 4, 4, 9, 0]):  # the run teacher's vocabulary is 32
        old, new = (speculative_generate(teacher, d, prompt, cfg) for d in (before, after))
        assert new.tokens == old.tokens and new.draft_tokens == old.draft_tokens
        assert max(new.accepted_lengths) > 1  # drafts really are accepted, so they were compared


def test_eval_loads_the_pair_sharing_them_and_keeps_sharing_them_in_host_memory_for_after_vllm(teacher_dir, tmp_path):
    """load_pair (eval's and generate's loader) on a bf16 teacher, then --engine vllm's release."""
    path = teacher_dir("qwen3", torch.bfloat16)
    model = load_teacher(TeacherConfig(name_or_path=path, dtype="bfloat16", top_k=1)).model
    cfg = drafter_config_from_teacher(model.config.to_dict(), (0, 2), mask_token_id=model.config.vocab_size - 1,
                                      block_size=4, num_hidden_layers=1)
    folder = export_drafter(DFlashDrafter.build(cfg, *(t.float() for t in _frozen(model)), "cpu"), tmp_path / "d")
    teacher, drafter = load_pair(str(folder), path, "bfloat16", "cpu")
    embed, head = _frozen(teacher.model)
    assert embed.dtype == torch.bfloat16 and own_bytes(drafter, teacher.model) == sum(
        p.numel() * p.element_size() for p in drafter.parameters())
    teacher, drafter = release_for_vllm(teacher, drafter, torch.device("cuda", 0), keep=True)
    embed, head = _frozen(teacher.model)
    assert drafter.embed_weight.data_ptr() == embed.data_ptr() and drafter.lm_head_weight.data_ptr() == head.data_ptr()
