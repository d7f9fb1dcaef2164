"""Offline measures of a trained drafter on a cache: the greedy replay of its assistant turns, the
drafter loaded from a checkpoint or an export, the acceptance plot. The held-out acceptance and tau
are the trainer's (dflash_train.training.heldout)."""

from __future__ import annotations

import torch

from dflash_cache import Cache
from dflash_train.settings.data_config import DataConfig
from dflash_train.training.batch import Batch
from dflash_train.training.data import heldout_batches
from dflash_train.training.heldout import argmax_chunks, streak_lengths, walk_choice
from dflash_train.training.model import DFlashDrafter


def assistant_spans(loss_mask: torch.Tensor, length: int) -> list[tuple[int, int]]:
    """(start, end) of each run of loss-mask tokens: the assistant turns a decoder would generate.
    Computed on the mask's own device (a CUDA batch's): its edges are padded there, not joined
    with zeros made on the CPU (`dflash-train eval --device cuda` failed so)."""
    mask = loss_mask[:length].long()
    edges = torch.diff(torch.nn.functional.pad(mask, (1, 1)))
    starts, ends = torch.nonzero(edges == 1).flatten(), torch.nonzero(edges == -1).flatten()
    return [(int(s), int(e)) for s, e in zip(starts, ends)]


def replay_histogram(drafter_cfg) -> torch.Tensor:
    """Rounds counted by the tokens they produced, 0 to P + 1 (a whole block of P drafts
    accepted plus the teacher's token): what replay_batch counts into."""
    return torch.zeros(drafter_cfg.num_draft_positions + 2, dtype=torch.long)


@torch.no_grad()
def replay_batch(model: DFlashDrafter, batch: Batch, histogram: torch.Tensor) -> tuple[int, int]:
    """Walk each assistant turn of a batch the way greedy speculative decoding does.

    The first anchor is the turn's first token (the teacher's prefill produces it); a round
    accepts drafts while they equal the teacher's top-1 at that position, produces the accepted
    drafts plus one teacher token, and the next anchor follows them. On sequences that are the
    teacher's own greedy output this is what real greedy decoding accepts (for DSpark too: along
    an accepted streak each drafted token is the true one, so teacher-forced Markov inputs are the
    drafted ones; for DFlash2 the selector's choice and for LiLiCorr the walk's, teacher-forced likewise). Returns (tokens
    produced by rounds, rounds) and counts each round's length in ``histogram`` (from
    replay_histogram).

    Each round runs the drafter over the whole context again (rounds x a forward of the batch).
    Not reused on purpose: the context's keys and values do not depend on the anchor and could be
    computed once, with a block forward per round over them (speculative decoding's path,
    forward_block), but the numbers here come from the training forward, the one held-out
    acceptance is measured with (every kind's heads, packed layouts, flex); a second path would
    have to be shown to give the same argmaxes, at near ties too, before it could replace it.
    """
    block = model.cfg.num_draft_positions + 1
    produced = rounds = 0
    cursors = [[[s, e] for s, e in assistant_spans(batch.sequence("loss_mask", r), int(batch.lengths[r])) if e - s > 1]
               for r in range(len(batch.ids))]
    while any(cursors):
        anchors = torch.full((len(cursors), 1), -1, dtype=torch.long, device=batch.input_ids.device)
        for r, spans in enumerate(cursors):
            if spans:
                anchors[r, 0] = spans[0][0]
        states, features, third = model(batch.hidden, batch.input_ids, anchors, heads=True,
                                        packed_lengths=batch.packed_lengths)
        # [N, P]; LiLiCorr's outputs are the walk's scores along the path and their candidates
        guesses = walk_choice(features, third) if model.lilicorr is not None else argmax_chunks(model, states, features)
        for r, spans in enumerate(cursors):
            if not spans:
                continue
            a, end = spans[0]
            remaining = end - 1 - a
            top1 = batch.sequence("topk_ids", r)[a:a + block - 1, 0]
            m = min(int(streak_lengths((guesses[r, : len(top1)] == top1)[None])[0]), remaining)
            step = min(m + 1, remaining)
            produced, rounds = produced + step, rounds + 1
            histogram[step] += 1
            spans[0][0] = a + m + 1
            if spans[0][0] >= end - 1:
                spans.pop(0)
    return produced, rounds


@torch.no_grad()
def greedy_replay(model: DFlashDrafter, cache: Cache, data_cfg: DataConfig, max_sequences: int,
                  device: torch.device) -> dict:
    """Greedy replay (see replay_batch) over the held-out split of a cache."""
    model.eval()
    produced, rounds, histogram = 0, 0, replay_histogram(model.cfg)
    for batch in heldout_batches(cache, data_cfg, max_sequences, model.cfg.num_draft_positions):
        p, r = replay_batch(model, batch.to(device), histogram)
        produced, rounds = produced + p, rounds + r
    return {"accepted_length": produced / max(rounds, 1), "rounds": rounds, "accepted_histogram": histogram.tolist()}


def load_trained_drafter(path: str, embed: torch.Tensor, lm_head: torch.Tensor, device: torch.device) -> DFlashDrafter:
    """A drafter from a checkpoint folder (step-*) or an export folder around the given frozen
    embedding and LM head, its trained weights in fp32 on `device`. The frozen tensors are used as
    they are, never cast, and moved only when they lie elsewhere: beside a teacher on the device
    they are the teacher's own (fp32 copies of a bf16 production teacher's were 10 GB more on
    the GPU, ~76 of 79 GiB at peak on an H100); the drafter upcasts a row or a vocabulary slice
    at a time where it reads them (DFlashDrafter.embed, .logits), which gives what the copies gave."""
    from pathlib import Path

    from dflash_train.settings.drafter_config import DrafterConfig
    from dflash_train.training.checkpoint import COMPLETE, CheckpointManager
    from dflash_train.training.export import read_export

    if (Path(path) / COMPLETE).exists():
        state = CheckpointManager.load(path)
        cfg, weights = DrafterConfig.from_hf_config(state["trainer"]["drafter"]), state["model"]
    else:
        cfg, weights = read_export(path)
    # the trained weights alone are cast (an export may be bf16): casting the module would cast the head too
    weights = {name: tensor.float() for name, tensor in weights.items()}
    return DFlashDrafter.build(cfg, embed, lm_head, device, state=weights).eval()


def share_teacher_head(drafter: DFlashDrafter, teacher_model: torch.nn.Module, device: torch.device) -> DFlashDrafter:
    """The drafter reading the teacher's own embedding and LM head again, on `device`, after the
    teacher moved (eval frees the GPU for vLLM and brings the pair back): moving the drafter
    alone would move copies of them."""
    drafter.embed_weight = teacher_model.get_input_embeddings().weight.detach().to(device)
    drafter.lm_head_weight = teacher_model.get_output_embeddings().weight.detach().to(device)
    return drafter


def load_drafter_for(path: str, cache: Cache, device: torch.device, skip_shards: tuple[str, ...] = ()) -> DFlashDrafter:
    """A trained drafter with the cache's frozen head; refuses a cache of other tapped layers and,
    as `dflash-train run` does before training, a cache with damaged shards not in ``skip_shards``
    (the shards' checksums are checked as evaluation first reads them: data.load_batch)."""
    from dflash_cache import SIZES
    from dflash_common.errors import CacheError

    cache.ensure_intact((SIZES,), skip=skip_shards)  # run's own check, so eval refuses what run refuses
    head = cache.load_teacher_head()
    # as training holds them (session.build_drafter): the embedding, a lookup, in the cache's
    # dtype; the head in fp32, since the held-out loss upcasts it whole where it is not
    model = load_trained_drafter(path, head["embed_tokens.weight"], head["lm_head.weight"].float(), device)
    if list(model.cfg.target_layer_ids) != list(cache.layer_ids):
        raise CacheError(f"the drafter at {path} reads teacher layers {list(model.cfg.target_layer_ids)}, the cache holds "
                         f"{cache.layer_ids}; evaluate it on a cache built with --layers {','.join(map(str, model.cfg.target_layer_ids))}")
    return model


def plot_acceptance(curves: dict[str, list[float]], path, title: str) -> None:
    """Acceptance against block position, one line per named curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", label=name)
    ax.set_xticks(range(1, 1 + max((len(v) for v in curves.values()), default=0)))
    ax.set_xlabel("block position k")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    from dflash_common.files import write_atomic

    # whole or not at all, and never through a link at `path` (an eval.png beside a drafter)
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
