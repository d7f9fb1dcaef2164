"""speculators 0.9's DFlash training step, driven on CPU over the batches `bench_peer.py` wrote (issue 54).

Runs in the environment of `make serving` (vLLM and speculators 0.9), not in dflash's:

    .venv-vllm/bin/python benchmarks/peer_speculators.py INIT TEACHER BATCHES STEPS OUT [--optimizer muon|adamw]

INIT is a dflash export (config.json + model.safetensors) whose weights start the peer's drafter,
so both trainers start from the same weights; TEACHER the teacher's folder (speculators reads the
verifier's embedding and LM head from it, as its trainer does); BATCHES the folder of
`step-NNNNNN.pt` batches; OUT gets INIT's config.json and the trained weights under the same
names, which vLLM and dflash's decoder load.

What is speculators' own and what is not:
- speculators' `DFlashDraftModel` (its layers, its anchored-block mask, its forward and its
  `compute_metrics` loss), its optimizer construction (`build_optimizers`: Muon on the 2-D
  matrices, AdamW elsewhere), its defaults for DFlash (`loss_fn` ce, D-PACE position weights with
  alpha 0.5, lr 1e-3, weight decay 0.01 / Muon's 0.1, momentum 0.95, 5 Newton-Schulz steps,
  match_rms_adamw), its linear schedule with 1% warmup and its gradient clip at 1.0, as its
  `Trainer.train_epoch` runs them.
- Its trainer moves models to CUDA, so the step body is run here directly, in float32 (its
  trainer autocasts to bf16 on GPUs), with sdpa attention (flex's backward needs CUDA).
- The anchors are the batch's (the same blocks dflash trained on): its `select_anchors` is
  replaced by one that returns them.
- The targets are the cache's top-k log-probs (the same bytes dflash trains on), handed to its
  forward in place of the verifier's last hidden states, with its verifier norm and head made
  identities; its ce takes their argmax, the teacher's top-1, as it does from full logits.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# speculators is imported where it is used: it lives in the vLLM environment, and the pure
# functions here are tested from dflash's

NOT_A_TARGET = -1.0e4
"""Log-prob given to tokens outside the cache's top-k: finite, so a masked position's loss is 0, not NaN."""

SLIDING_WINDOW = 2048
"""speculators' default: every DFlash layer sliding (window 2048), causal inside the block."""


class OptimizerSettings:
    """speculators 0.9's OptimizerArgs defaults (train/config/schema.py), the fields build_optimizers reads."""

    def __init__(self, optimizer: str):
        self.optimizer, self.lr, self.weight_decay = optimizer, 1e-3, 0.01
        self.muon_lr, self.muon_momentum, self.muon_weight_decay = 1e-3, 0.95, 0.1
        self.muon_ns_steps, self.muon_adjust_lr_fn = 5, "match_rms_adamw"


def peer_model(init: Path, teacher: Path):
    """speculators' DFlash drafter of INIT's shape and weights, verifier matrices from TEACHER."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    config = json.loads((init / "config.json").read_text())
    causal = bool(config["dflash_config"].get("causal", False))
    layer = Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "dflash_config")})
    layer._attn_implementation = "sdpa"
    if causal:  # its default layers: sliding, causal in the block; the window never binds at these lengths
        layer.layer_types = ["sliding_attention"] * layer.num_hidden_layers
        layer.sliding_window = SLIDING_WINDOW
    block = config["block_size"]
    spec = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=config["vocab_size"], block_size=block,
        aux_hidden_state_layer_ids=config["dflash_config"]["target_layer_ids"],
        mask_token_id=config["dflash_config"]["mask_token_id"], sample_from_anchor=False,
        sliding_window_non_causal=not causal,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(teacher), architectures=["Qwen3ForCausalLM"])))
    model = DFlashDraftModel(spec)
    keys = model.load_state_dict(load_file(init / "model.safetensors"), strict=False)
    if keys.unexpected_keys:
        raise SystemExit(f"peer: {init} holds weights speculators' DFlash has no place for: {keys.unexpected_keys[:3]}")
    model.load_verifier_weights()
    # the targets arrive as log-probs: its verifier norm and head pass them through
    model.verifier_norm, model.verifier_lm_head = torch.nn.Identity(), torch.nn.Identity()
    return model


def use_anchors(anchors: torch.Tensor, valid: torch.Tensor) -> None:
    """Make speculators' forward train exactly these blocks (its sampler draws them at random)."""
    import speculators.models.dflash.core as dflash_core

    dflash_core.select_anchors = lambda loss_mask, num_anchors, block_size: (anchors, valid)


def dense_targets(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, vocab: int) -> torch.Tensor:
    """[1, W, V] log-probs: the cache's top-k at their ids, NOT_A_TARGET elsewhere."""
    out = torch.full((*topk_ids.shape[:-1], vocab), NOT_A_TARGET)
    return out.scatter_(-1, topk_ids, topk_logprobs)


def train(model, batches: list[Path], steps: int, optimizer: str) -> list[float]:
    """speculators' train_epoch step body over the batches, one optimizer step each; the losses."""
    from speculators.train.optimizers import build_optimizers
    from transformers import get_linear_schedule_with_warmup

    optimizers = build_optimizers(model, OptimizerSettings(optimizer))
    schedulers = [get_linear_schedule_with_warmup(o, num_warmup_steps=steps // 100, num_training_steps=steps)
                  for o in optimizers]
    kwargs = model.get_trainer_kwargs(loss_fn="ce", per_position_loss_weight="dpace", loss_implementation="eager")[0]
    vocab = model.config.draft_vocab_size
    losses = []
    model.train()
    for path in batches[:steps]:
        batch = torch.load(path)
        use_anchors(batch["anchors"], batch["anchor_valid"])
        _, loss, _ = model(batch["hidden"], batch["input_ids"], batch["loss_mask"],
                           dense_targets(batch["topk_ids"], batch["topk_logprobs"], vocab), batch["document_ids"],
                           batch["position_ids"], **{**kwargs, "max_anchors": len(batch["anchors"])})
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in optimizers:
            o.step()
        for s in schedulers:
            s.step()
        losses.append(float(loss))
    return losses


def save(model, init: Path, out: Path) -> None:
    """INIT's config and the trained weights under INIT's names (everything dflash exports)."""
    names = set(load_file(init / "model.safetensors"))
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items() if k in names}
    if set(state) != names:
        raise SystemExit(f"peer: the trained model lacks {sorted(names - set(state))[:3]}")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(init / "config.json", out / "config.json")
    save_file(state, str(out / "model.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("init", type=Path)
    parser.add_argument("teacher", type=Path)
    parser.add_argument("batches", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--optimizer", choices=("muon", "adamw"), default="muon")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = sorted(args.batches.glob("step-*.pt"))
    if len(batches) < args.steps:
        raise SystemExit(f"peer: {args.batches} holds {len(batches)} batches, fewer than the {args.steps} steps asked for")
    model = peer_model(args.init, args.teacher)
    losses = train(model, batches, args.steps, args.optimizer)
    save(model, args.init, args.out)
    (args.out / "peer_losses.json").write_text(json.dumps({"optimizer": args.optimizer, "losses": losses}))


if __name__ == "__main__":
    main()
