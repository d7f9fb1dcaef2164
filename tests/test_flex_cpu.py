"""flex_attention's CUDA path, as far as the CPU runs it (issue 57): the compiled block masks of
every layout we train equal the eager ones and the dense SDPA mask, and flex's forward and
backward equal SDPA's for every drafter kind and layout.

Two CPU limits, each worked around inside these tests only: inductor's vectorised C++ build of
create_block_mask trips a CPU codegen bug, so the masks compile with ``cpp.simdlen = 1``; flex's
``_validate_device`` refuses inputs that require grad on the CPU (its compiled backward is
CUDA-only), while its eager backward runs, so the check is given detached views of the inputs,
keeping every other check it makes."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.attention.flex_attention as flex_module
from test_host_reads import HIDDEN, KINDS, LOSSES, VOCAB, host_batch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.training.batch_objective import batch_loss
from dflash_train.training.model import DFlashDrafter, block_attention_mask, flex_mask_mod

MASKS = {"full": (None, False), "sliding": (6, False), "causal": (None, True), "sliding causal": (5, True)}


def random_blocks(gen: torch.Generator, block_size: int) -> tuple[torch.Tensor, int]:
    """Anchors [N, A] (-1 in unused slots) of a random batch and its context length."""
    seq_len = int(torch.randint(8, 70, (1,), generator=gen))
    rows, columns = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
    anchors = torch.randint(1, seq_len, (rows, columns), generator=gen)
    anchors[torch.rand(rows, columns, generator=gen) < 0.2] = -1
    return anchors, seq_len


@pytest.mark.fast_cases(1)  # ~10 s of compiling a batch on 2 cores: the sliding layout in make test
@pytest.mark.parametrize("layout", ["sliding", "full", "causal", "sliding causal"])
def test_compiled_block_masks_equal_the_eager_and_the_dense_masks(layout):
    """What _flex_attend builds, compiled as on CUDA and eagerly, over 6 random batches: the same
    block tiles (small tiles, so they skip something at these sizes), whose elements are the dense
    mask SDPA trains with."""
    torch._dynamo.reset()
    window, causal = MASKS[layout]
    block_size, gen = 4, torch.Generator().manual_seed(len(layout))
    with inductor_config.patch({"cpp.simdlen": 1}):
        for _ in range(6):
            _check_block_masks(gen, block_size, window, causal)
    torch._dynamo.reset()


def _check_block_masks(gen: torch.Generator, block_size: int, window: int | None, causal: bool) -> None:
    """One random batch's block masks, compiled and eager, against the dense mask."""
    anchors, seq_len = random_blocks(gen, block_size)
    mask_mod = flex_mask_mod(anchors, torch.full((), seq_len), block_size, window, causal)
    shape = (anchors.shape[0], None, anchors.shape[1] * block_size, seq_len + anchors.shape[1] * block_size)
    eager, compiled = (create_block_mask(mask_mod, *shape, device="cpu", BLOCK_SIZE=8, _compile=c) for c in (False, True))
    dense = block_attention_mask(anchors, seq_len, block_size, window, causal)
    assert torch.equal(create_mask(mask_mod, shape[0], 1, *shape[2:], device="cpu")[:, 0], dense)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
    assert torch.equal(compiled.to_dense(), eager.to_dense())
    # a tile is listed exactly when it holds a visible pair
    tiles = torch.nn.functional.pad(dense, (0, -dense.shape[2] % 8, 0, -dense.shape[1] % 8))
    tiles = tiles.unflatten(2, (-1, 8)).unflatten(1, (-1, 8))
    assert torch.equal(eager.to_dense()[:, 0].bool(), tiles.any(dim=(2, 4)))


def _grad_allowed_on_cpu(monkeypatch) -> None:
    check = flex_module._validate_device
    monkeypatch.setattr(flex_module, "_validate_device", lambda q, k, v: check(q.detach(), k.detach(), v.detach()))


def _pair(kind: str) -> tuple[DFlashDrafter, DFlashDrafter]:
    cfg = DrafterConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=48, vocab_size=VOCAB, mask_token_id=VOCAB - 1, target_layer_ids=(0, 2),
                        num_target_layers=3, num_hidden_layers=2, block_size=5, max_position_embeddings=128,
                        **KINDS[kind])
    gen = torch.Generator().manual_seed(0)
    embed, head = torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3
    models = []
    for backend in ("sdpa", "flex"):
        torch.manual_seed(0)
        model = DFlashDrafter.build(cfg, embed, head, "cpu", backend).train()
        with torch.no_grad():  # away from the identity starts (DFlash2's convolutions, LiLiCorr's route)
            for param in model.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
        models.append(model)
    return models[0], models[1]


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_flex_forward_and_backward_equal_sdpa(kind, layout, monkeypatch):
    """The training loss and every weight's gradient through eager flex_attention equal SDPA's
    with its dense mask: sliding and full layers, causal blocks, DSpark, DFlash2, LiLiCorr."""
    _grad_allowed_on_cpu(monkeypatch)
    sdpa, flex = _pair(kind)
    batch = host_batch(layout, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention on CPU warns that it is unfused
        outputs = [batch_loss(model, batch, LOSSES[kind]) for model in (sdpa, flex)]
    for out in outputs:
        out.loss.backward()
    want, got = outputs
    assert int(want.count.sum()) > 20
    torch.testing.assert_close(got.loss, want.loss, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(got.alpha_sum, want.alpha_sum, atol=2e-5, rtol=2e-5)
    for (name, a), b in zip(sdpa.named_parameters(), flex.parameters()):
        assert a.grad is not None and a.grad.abs().sum() > 0, name
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
