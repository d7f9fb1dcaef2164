"""A training session's setup: the drafter (built for the cache, or started from an earlier
run's weights), its data-parallel wrapper, optimizer and schedule, the epoch plan, and the
checkpoint it resumes from."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dflash_common.errors import ConfigError
from dflash_common.files import disk_full_at, write_file_atomic
from dflash_common.progress import Progress
from dflash_teacher.tapped_layers import check_servable_layers
from dflash_train.settings.dflash2_config import DFlash2Config
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.checkpoint import (
    CHECKPOINT_FILES,
    COMPLETE,
    CheckpointManager,
)
from dflash_train.training.data import LoaderState
from dflash_train.training.distributed import (
    DistInfo,
    data_parallel,
    is_sharded,
)
from dflash_train.training.epoch_plan import EpochPlan, idle_ranks_warning, resolve_partitions
from dflash_train.training.export import read_export
from dflash_train.training.mask_token import mask_token_text, resolve_mask_token_id
from dflash_train.training.model import DFlashDrafter, attention_backend
from dflash_train.training.objectives import head_dtype, set_head_matmul
from dflash_train.training.resuming import agreed_checkpoint, checkpoint_to_resume, restore_checkpoint
from dflash_train.training.run_folder import MetricsLog

DEFAULT_STEPS = 1000


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to min_ratio at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_drafter(cfg: TrainConfig, cache, device: torch.device) -> DFlashDrafter:
    """The drafter for this cache: shape from the saved teacher config, frozen head from the cache."""
    head = cache.load_teacher_head()
    # the embedding is a lookup and keeps the cache's dtype (bf16: half of 2.5 GB at production
    # size); the LM head is fp32 because the loss's logits are, unless head_matmul bf16 on CUDA
    embed = head["embed_tokens.weight"].to(device)
    lm_head = head["lm_head.weight"].to(device).to(head_dtype(cfg.loss.head_matmul, device))
    tokenizer = cache.load_tokenizer()
    mask_id = resolve_mask_token_id(tokenizer, embed.shape[0], cfg.model.mask_token_id)
    drafter_cfg = DrafterConfig.from_teacher(
        cache.teacher_config(), tuple(cache.layer_ids), mask_id, block_size=cfg.model.block_size,
        num_hidden_layers=cfg.model.num_layers, sliding_window=cfg.model.sliding_window,
        sliding_layers=cfg.model.sliding_layers, mask_token=mask_token_text(tokenizer, mask_id), **cfg.model.overrides(),
        dspark=cfg.dspark if cfg.model.kind == "dspark" else None,
        dflash2=_convolutions(cfg), lilicorr=cfg.lilicorr if cfg.model.kind == "lilicorr" else None,
        causal=cfg.model.causal,
    )
    check_servable_layers(drafter_cfg.target_layer_ids, drafter_cfg.num_target_layers,
                          f"the cache {cfg.cache} holds layers", fix="rebuild it with --layers in {allowed}")
    torch.manual_seed(cfg.seed)
    return DFlashDrafter.build(drafter_cfg, embed, lm_head, device, attention_backend(cfg.model.attention_backend, device))


def _convolutions(cfg: TrainConfig) -> DFlash2Config | None:
    """The drafter's DFlash2 settings: all of them for DFlash2, the convolutions' geometry alone
    for LiLiCorr + conv (its other DFlash2 fields are the selector's, which LiLiCorr has none of)."""
    if cfg.model.kind == "dflash2":
        return cfg.dflash2
    if cfg.model.kind == "lilicorr" and cfg.lilicorr.conv:
        return DFlash2Config(conv_kernel_size=cfg.dflash2.conv_kernel_size, conv_group_size=cfg.dflash2.conv_group_size)
    return None


def drafter_weights(path: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """The drafter config and trained tensors of a checkpoint folder (step-NNNNNN) or an export folder."""
    path = Path(path)
    if (path / COMPLETE).exists():
        state = CheckpointManager.load(path)
        return DrafterConfig.from_hf_config(state["trainer"]["drafter"]), state["model"]
    problem = not_a_drafter(path)
    if problem:
        raise ConfigError(f"--init-from {path} {problem}")
    return read_export(path)


def not_a_drafter(path: Path) -> str | None:
    """Why `path`, which has no COMPLETE marker, is not a drafter --init-from can read (what it is
    instead and what to pass), or None for a folder to read as an export. A run folder's or a step
    folder's config.json is a train config, which read as a drafter config said only "drafter
    config has no 'hidden_size'"."""
    if not path.is_dir():
        return ("does not exist or is not a folder; pass a checkpoint folder (RUN/checkpoints/step-NNNNNN) or an "
                "exported drafter folder (RUN/drafter)")
    if (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file():
        newest = CheckpointManager(path / "checkpoints").latest() if (path / "checkpoints").is_dir() else None
        export = path / "drafter"
        choices = ([f"its newest checkpoint, {newest}"] if newest else []) + \
            ([f"its export, {export}"] if (export / "config.json").is_file() else [])
        return ("is a training run's folder, not a drafter; pass " + (" or ".join(choices) if choices else
                "one of its checkpoints (RUN/checkpoints/step-NNNNNN) or its export (RUN/drafter): it has neither yet"))
    steps = sorted(p.name for p in path.glob("step-*") if (p / COMPLETE).is_file())
    if steps:
        return f"is a run's checkpoints folder, not a checkpoint; pass one of its step folders, e.g. {path / steps[-1]}"
    written = [name for name in CHECKPOINT_FILES if (path / name).exists()]
    if "trainer.pt" in written or path.name.startswith(("step-", ".tmp-step-")):
        missing = [name for name in (*CHECKPOINT_FILES, COMPLETE) if not (path / name).exists()]
        return (f"is an incomplete checkpoint: it lacks {', '.join(missing)} (its save did not finish, and only a "
                f"checkpoint with its {COMPLETE} marker is whole); pass a complete step folder of that run, or its export")
    if not (path / "config.json").is_symlink() and not (path / "config.json").is_file():  # read_export names a link
        return (f"is neither a checkpoint folder (checkpoints/step-NNNNNN, with its {COMPLETE} marker) nor an exported "
                "drafter folder (it has no config.json); pass one of those")
    return None


def config_changes(saved: object, run: object, prefix: str = "") -> list[str]:
    """The drafter config fields (nested sections by dotted name) whose value in `saved`, the config
    --init-from's weights were trained with, differs from this run's, as "name saved -> run": what
    starting from those weights does not carry over (the weights fit either way)."""
    if not (is_dataclass(saved) and is_dataclass(run) and type(saved) is type(run)):
        return [] if saved == run else [f"{prefix} {_shown(saved)} -> {_shown(run)}"]
    changes = []
    for f in fields(saved):
        changes += config_changes(getattr(saved, f.name), getattr(run, f.name), f"{prefix}{'.' if prefix else ''}{f.name}")
    return changes


def _shown(value: object) -> str:
    if is_dataclass(value):
        return "set"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) or "()"
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def init_from_lines(path: str | Path, saved: DrafterConfig, run: DrafterConfig, tensors: int) -> list[str]:
    """What --init-from kept and what this run's options replaced, one line; and a warning line when
    the attention it was trained with (causal blocks or not) is not this run's."""
    changes = config_changes(saved, run)
    dropped = (f"; not kept from the drafter config it was trained with (this run's options apply): {', '.join(changes)}"
               if changes else "; its drafter config equals this run's")
    lines = [f"starting from the drafter weights of {path}: kept its {tensors} tensors (optimizer and schedule fresh)"
             f"{dropped}"]
    if saved.causal != run.causal:
        trained, now = ("causal", "non-causal") if saved.causal else ("non-causal", "causal")
        fix = "pass --causal to keep causal blocks" if saved.causal else "leave out --causal to keep them"
        lines.append(f"warning: --init-from {path} was trained with {trained} blocks and this run trains {now} ones, "
                     f"so its drafter will be served with attention its weights did not learn; {fix}")
    return lines


def weights_mismatch(wanted: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> str | None:
    """The first difference between two drafters' tensor sets (names, then shapes), or None."""
    for name in sorted(set(wanted) | set(given)):
        if name not in given:
            return f"it lacks {name} (this run's drafter has it, shape {tuple(wanted[name].shape)})"
        if name not in wanted:
            return f"it has {name}, which this run's drafter lacks"
        if wanted[name].shape != given[name].shape:
            return f"its {name} is {tuple(given[name].shape)}, this run's is {tuple(wanted[name].shape)}"
    return None


def init_weights(model: DFlashDrafter, path: str | Path) -> list[str]:
    """Replace the drafter's initial weights by those of an earlier run (cfg.init_from), refusing
    one of another shape or of other tapped teacher layers in one line; returns the lines that say
    what was kept and what this run replaced (init_from_lines)."""
    saved_cfg, state = drafter_weights(path)
    problem = weights_mismatch(model.state_dict(), state)
    if problem is None and tuple(saved_cfg.target_layer_ids) != tuple(model.cfg.target_layer_ids):
        problem = (f"it reads teacher layers {list(saved_cfg.target_layer_ids)}, this run's cache "
                   f"{list(model.cfg.target_layer_ids)}")
    if problem:
        raise ConfigError(f"--init-from {path} is not a drafter of this run's shape: {problem}; pass the drafter of a "
                          "run with the same drafter options (--num-layers, --model-kind, ...) on a cache of the same teacher")
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(state[name])
    return init_from_lines(path, saved_cfg, model.cfg, len(state))


def total_steps(cfg: TrainConfig, plan: EpochPlan, partitions: int = 1) -> int:
    if cfg.epochs is None:
        return cfg.steps or DEFAULT_STEPS
    return max(1, math.ceil(cfg.epochs * plan.steps(0, partitions) / cfg.optim.grad_accum))


def plan_session(cfg: TrainConfig, cache, info: DistInfo, state: LoaderState, progress: Progress) -> tuple[LoaderState, EpochPlan]:
    """The loader state this session starts from, with the partitions its epochs are planned
    over (a resumed run's own), and the epoch plan; one line when a rank gets no sequence."""
    if not state.partitions and state.batch_in_epoch:
        progress.message(f"the checkpoint's loader state predates per-rank epoch plans: epoch {state.epoch} restarts "
                         f"from its first batch ({state.batch_in_epoch} of its batches were trained on)")
        state = replace(state, batch_in_epoch=0)
    state = replace(state, partitions=resolve_partitions(cfg.data.partitions, info.world_size, state.partitions))
    plan = EpochPlan(cache, cfg.data)
    warning = idle_ranks_warning(plan, state.epoch, state.partitions, info.world_size)
    if warning:
        progress.message(warning)
    return state, plan


@dataclass
class Session:
    """One training process between setup and finish: what the loop reads and advances."""

    cfg: TrainConfig
    cache: Any
    info: DistInfo
    device: torch.device
    model: DFlashDrafter
    forward: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    manager: CheckpointManager
    metrics: MetricsLog | None
    progress: Progress
    steps: int
    step: int
    loader_state: LoaderState
    plan: EpochPlan | None = None  # the training split's epoch plan, made at setup

    @property
    def sharded(self) -> bool:
        return is_sharded(self.model)


def setup(cfg: TrainConfig, cache, info: DistInfo, device: torch.device, resume: bool,
          resume_from: str | Path | None, progress: Progress, skipped_sequences: int) -> Session:
    """The drafter, optimizer, schedule and checkpoint manager of a run, resumed when asked;
    writes the run's config.json (rank 0)."""
    progress = progress if info.is_main else Progress()
    out = Path(cfg.out)
    model = build_drafter(cfg, cache, device)
    if cfg.init_from is not None:  # before the wrapper: DDP and FSDP take the weights they find
        for line in init_weights(model, cfg.init_from):
            progress.message(line)
    forward = data_parallel(model, info, cfg.strategy, device, cfg.grad_reduce_dtype)
    # fused: one kernel for all parameters instead of several per tensor (CUDA only)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                  weight_decay=cfg.optim.weight_decay, fused=device.type == "cuda")
    set_head_matmul(cfg.loss.head_matmul, device)
    manager = CheckpointManager(out / "checkpoints", keep=cfg.keep_checkpoints)
    chosen = agreed_checkpoint(manager, resume, resume_from, info)
    checkpoint = (checkpoint_to_resume(manager, cache.fingerprint, json.loads(json.dumps(cfg.to_dict())), progress,
                                        chosen) if resume else None)
    loader_state, plan = plan_session(cfg, cache, info, LoaderState(**checkpoint[1]["trainer"]["loader"]) if checkpoint
                                      else LoaderState(manifest_fingerprint=cache.fingerprint), progress)
    steps = total_steps(cfg, plan, loader_state.partitions)
    warmup = cfg.optim.warmup_steps if cfg.optim.warmup_steps is not None else max(1, steps // 25)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, steps, warmup, cfg.optim.min_lr_ratio))
    step = restore_checkpoint(checkpoint, model, optimizer, scheduler, progress) if checkpoint else 0
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        with disk_full_at(out / "config.json"):  # the run's own line says what is kept (trainer.run_disk_full)
            write_file_atomic(out / "config.json", (json.dumps(cfg.to_dict(), indent=1) + "\n").encode(), root=out)
    metrics = MetricsLog(out, cfg.tensorboard) if info.is_main else None
    if cfg.data.skip_shards and info.is_main:
        progress.message(f"skipping {len(cfg.data.skip_shards)} shard(s) (--skip-shards): {skipped_sequences:,} sequences left out")
        metrics.write({"kind": "data", "skipped_shards": list(cfg.data.skip_shards), "skipped_sequences": skipped_sequences})
    return Session(cfg=cfg, cache=cache, info=info, device=device, model=model, forward=forward, optimizer=optimizer,
                   scheduler=scheduler, manager=manager, metrics=metrics, progress=progress, steps=steps, step=step,
                   loader_state=loader_state, plan=plan)
