"""Stage 2: train a DFlash drafter from a cache. ``train(cfg)`` is the one entry point."""

from __future__ import annotations

import json
import math
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dflash_cache import SIZES, open_cache
from dflash_common.devices import bind_device, resolve_device
from dflash_common.errors import CacheError, ConfigError, TrainingError
from dflash_common.files import LOCK_FILE, append_line, foreign_entries, holds, one_writer, refuse_links, write_file_atomic
from dflash_common.progress import Progress
from dflash_common.resume_check import shown
from dflash_common.settings_files import load_settings_file
from dflash_teacher.tapped_layers import check_servable_layers
from dflash_train.config import RESUME_MAY_CHANGE, config_differences
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.checkpoint import (
    COMPLETE,
    CheckpointError,
    CheckpointManager,
    full_model_state,
    full_optimizer_state,
    load_full_state,
    trainer_state,
)
from dflash_train.training.data import Batch, EpochPlan, LoaderState, idle_ranks_warning, resolve_partitions, train_loader
from dflash_train.training.distributed import (
    DistInfo,
    clip_gradients,
    data_parallel,
    dist_info_from_env,
    every_rank,
    from_rank0,
    global_min,
    global_sum,
    global_sum_tensor,
    gradient_sync,
    init_distributed,
    is_sharded,
    release_gathered,
    shutdown,
    wait_for_rank0,
)
from dflash_train.training.export import check_export_folder, export_weights, read_export
from dflash_train.training.heldout import AcceptanceMeter, evaluate_heldout, meter_rows
from dflash_train.training.loss import LossOutput, batch_loss, head_dtype, set_head_matmul
from dflash_train.training.model import DFlashDrafter, attention_backend, mask_token_text, resolve_mask_token_id
from dflash_train.training.noise import add_noise_

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
        dflash2=cfg.dflash2 if cfg.model.kind == "dflash2" else None,
    )
    check_servable_layers(drafter_cfg.target_layer_ids, drafter_cfg.num_target_layers,
                          f"the cache {cfg.cache} holds layers", fix="rebuild it with --layers in {allowed}")
    torch.manual_seed(cfg.seed)
    return DFlashDrafter.build(drafter_cfg, embed, lm_head, device, attention_backend(cfg.model.attention_backend, device))


def drafter_weights(path: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """The drafter config and trained tensors of a checkpoint folder (step-NNNNNN) or an export folder."""
    path = Path(path)
    if (path / COMPLETE).exists():
        state = CheckpointManager.load(path)
        return DrafterConfig.from_hf_config(state["trainer"]["drafter"]), state["model"]
    if not (path / "config.json").is_symlink() and not (path / "config.json").is_file():  # read_export names a link
        raise ConfigError(f"--init-from {path} is neither a checkpoint folder (checkpoints/step-NNNNNN, with its "
                          f"{COMPLETE} marker) nor an exported drafter folder; pass one of those")
    return read_export(path)


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


def init_weights(model: DFlashDrafter, path: str | Path) -> None:
    """Replace the drafter's initial weights by those of an earlier run (cfg.init_from), refusing
    one of another shape or of other tapped teacher layers in one line."""
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
class TrainResult:
    steps: int
    export_dir: Path
    before: dict
    after: dict


class MetricsLog:
    """metrics.jsonl in the run folder (appended, so a resumed run continues it), TensorBoard optionally."""

    def __init__(self, out: Path, tensorboard: bool):
        self.out, self.path = out, out / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("--tensorboard needs the tensorboard package; pip install tensorboard") from None
            refuse_links(out / "tensorboard", out)  # its event files are written by TensorBoard, not through us
            self.writer = SummaryWriter(str(out / "tensorboard"))

    def write(self, record: dict) -> None:
        append_line(self.path, json.dumps(record), root=self.out)
        if self.writer is not None and "step" in record:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.writer.add_scalar(f"{record.get('kind', 'train')}/{key}", value, record["step"])


def agreed_checkpoint(manager: CheckpointManager, resume: bool, resume_from: str | Path | None,
                      info: DistInfo) -> Path | None:
    """The checkpoint this run continues (None: it starts at step 0), decided by rank 0 alone and
    sent to every rank: the newest complete one in rank 0's checkpoints/ (every rank then takes
    the step folder of that name in its own --out) or `resume_from`. A rank that does not see it
    (a node-local --out on another node) would start at step 0 while rank 0 resumes and the ranks'
    collectives would stop matching (a hang), so every rank stops with the same line instead."""
    decision = None
    if info.is_main:
        latest = manager.latest()
        if not resume and latest is not None:
            decision = "refuse"
        elif resume:
            decision = str(resume_from) if resume_from is not None else (latest.name if latest else None)
    decision = from_rank0(decision, info)
    if decision == "refuse":
        raise CheckpointError(f"{manager.run} already holds checkpoints; pass --resume to continue that run or choose a new --out")
    if decision is None:
        return None
    path = Path(decision) if resume_from is not None else manager.root / decision
    missing = [rank for rank, seen in enumerate(every_rank((path / COMPLETE).is_file(), info)) if not seen]
    if missing:
        raise CheckpointError(f"rank 0 resumes from checkpoint {path}, which rank(s) {', '.join(map(str, missing))} of "
                              f"{info.world_size} cannot see (a node-local --out?); put --out on storage every node "
                              "sees, or copy that checkpoint folder to the same path on every node")
    return path


def _checkpoint_to_resume(manager: CheckpointManager, fingerprint: str, current: dict, progress: Progress,
                          path: Path | None) -> tuple[Path, dict] | None:
    """The checkpoint `path` a resume continues (agreed_checkpoint) and its state, checked
    against this run (None: start at step 0)."""
    if path is None:
        progress.message(f"no complete checkpoint in {manager.root}; starting from step 0")
        return None
    state = manager.load(path)
    trainer = state["trainer"]
    saved = trainer["loader"]["manifest_fingerprint"]
    if saved != fingerprint:
        raise CacheError(f"checkpoint {path} was trained on a different cache (fingerprint {saved}, this cache {fingerprint}); pass the original --cache or use a new --out")
    differences = config_differences(state["config"], current, free=RESUME_MAY_CHANGE)
    if differences:
        key, before, after = differences[0]
        raise ConfigError(f"the {key.split('.')[0]} fields differ from checkpoint {path}: {key} differs (checkpoint: "
                          f"{shown(before)}, this run: {shown(after)}); resume with the original values or use a new --out")
    return path, state


def _restore(checkpoint: tuple[Path, dict], model, optimizer, scheduler, progress: Progress) -> int:
    """Load a checked checkpoint's weights, optimizer, schedule and RNG; its step."""
    path, state = checkpoint
    trainer = state["trainer"]
    load_full_state(model, optimizer, state["model"], trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    torch.set_rng_state(trainer["rng"]["torch"])
    progress.message(f"resuming from {path} (step {trainer['step']})")
    return int(trainer["step"])


def on_device(batch: Batch, device: torch.device, cfg: TrainConfig, step: int, steps: int) -> Batch:
    """The batch on the training device in float32, with step `step`'s noise drawn there: the
    draws are the same on any device, and the loader is left only the reading."""
    if not batch.ids:
        return batch
    lengths = batch.lengths.tolist()
    batch = batch.to(device)
    add_noise_(batch.hidden, batch.ids, lengths, cfg.noise, step, steps, packed=batch.packed_lengths is not None)
    return batch


def micro_step(model: DFlashDrafter, forward, batch: Batch, cfg: TrainConfig, info: DistInfo,
               device: torch.device, autocast) -> LossOutput | None:
    """Forward and backward of one batch. With several ranks the loss is normalised by the valid
    positions of the whole global batch, so the ranks' gradient average equals one process's step.
    Every rank runs a forward before the position count's all-reduce: the forward's own
    collectives (FSDP's gathers, DDP's bucket sync) must come in the same order on every rank."""
    with autocast:
        out = batch_loss(model, batch, cfg.loss, forward) if batch.ids else None
        idle = idle_loss(model, forward, device) if out is None else None
    scale = 1.0
    if info.active:  # the count crosses to the host only when the ranks need it
        local = float(out.count.sum()) if out is not None else 0.0
        scale = local / max(global_sum(local, info, device), 1.0) * info.world_size
    loss = out.loss * scale if out is not None else idle
    (loss / cfg.optim.grad_accum).backward()
    return out


def global_train_metrics(meter: AcceptanceMeter, tokens: int, seconds: float, drafter_cfg: DrafterConfig,
                         rows: tuple[str, ...], info: DistInfo, device: torch.device) -> tuple[dict, float]:
    """Loss, acceptance and tau since the last log over every rank's share of the batches, and
    the session's tokens/s over all ranks. Every rank calls this at the same steps."""
    stats = torch.cat([meter.stacked(drafter_cfg.num_draft_positions, rows).flatten(), torch.tensor([float(tokens)], dtype=torch.float64)])
    stats = global_sum_tensor(stats, info, device)
    return AcceptanceMeter.from_stacked(stats[:-1].view(len(rows), -1), rows).summary(), float(stats[-1]) / max(seconds, 1e-9)


def idle_loss(model: DFlashDrafter, forward, device: torch.device) -> torch.Tensor:
    """A zero loss through a whole forward, for a rank whose share of a global batch is empty: its
    backward joins the other ranks' collectives (DDP's all-reduce, FSDP's gathers and
    reduce-scatters) in the same order, with zero gradients, for every trained weight: the
    forward's and those only the loss reads (model.loss_weights, read after the forward as the
    loss reads them: under FSDP2 the root unit's gathered copies)."""
    drafter_cfg = model.cfg
    hidden = torch.zeros(1, 1, drafter_cfg.num_context_layers, drafter_cfg.hidden_size, device=device)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    outputs = forward(hidden, ids, torch.full((1, 1), -1, device=device), heads=True)
    return (sum(out.sum() for out in outputs if out is not None) + sum(w.sum() for w in model.loss_weights)) * 0.0


# What a run folder may hold before its config.json exists: a sweep writes the run's log first,
# and the run's lock (one_writer) is taken before config.json is written.
_BEFORE_CONFIG = {"train.log", LOCK_FILE}
# What a run writes or deletes in its folder; none of them may be a symlink (see refuse_links).
RUN_ENTRIES = ("config.json", "metrics.jsonl", "checkpoints", "drafter", "tensorboard", LOCK_FILE)


def check_run_folder(out: Path) -> None:
    """Refuse an --out that is not ours to write into: a file, or a non-empty folder that is not a
    dflash-train run (a run writes config.json first), since training replaces config.json and
    drafter/ there; and a run folder where one of the entries a run writes is a symlink, before
    any work (every write checks again)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder; choose a new or empty folder for the run")
    if not out.is_dir():
        return
    for name in RUN_ENTRIES:
        refuse_links(out / name, out)
    if (out / "checkpoints").is_dir():  # step folders are pruned, and leftovers deleted
        for entry in (out / "checkpoints").iterdir():
            refuse_links(entry)
    config = out / "config.json"
    if config.is_file():
        try:  # bounded: a config.json of gigabytes (or a link to /dev/zero) is not a run's
            values = load_settings_file(str(config))
        except (OSError, ConfigError):
            values = None
        if isinstance(values, dict) and {"cache", "model", "loss", "optim"} <= set(values):
            return
        raise ConfigError(f"--out {out} holds a config.json that is not a dflash-train run's; choose a new or empty "
                          "folder (training would overwrite it and replace drafter/)")
    foreign = foreign_entries(out, lambda entry: entry.name in _BEFORE_CONFIG)
    if foreign:
        raise ConfigError(f"--out {out} is a non-empty folder that is not a dflash-train run (it holds {holds(foreign)}); "
                          "choose a new or empty folder")


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


def train(cfg: TrainConfig, resume: bool = False, progress: Progress | None = None,
          resume_from: str | Path | None = None) -> TrainResult:
    """Train (or with `resume`, continue from the newest complete checkpoint in cfg.out, or from
    the checkpoint folder `resume_from`) and export the drafter."""
    resume = resume or resume_from is not None
    place = dist_info_from_env(cfg.wrap_single_rank)  # torchrun's variables checked before anything is opened
    check_run_folder(Path(cfg.out))
    # the run ends by replacing drafter/: refuse a user's files there now, not after the training
    check_export_folder(Path(cfg.out) / "drafter")
    cache = open_cache(cfg.cache, cfg.storage_options)
    if not cache.complete:
        raise CacheError(f"{cfg.cache} is an incomplete cache; rerun its `dflash-cache build` command to finish it")
    # sizes against the commit records, before any work: a damaged shard would otherwise stop
    # training with a decoder error hours in, whenever the epoch plan first reaches it
    skipped_sequences = cache.ensure_intact((SIZES,), skip=cfg.data.skip_shards)
    device = resolve_device(cfg.device)
    # rank 0 does every write of a run (config, metrics, checkpoints, export), so it alone holds
    # the folder's lock; a second run on the same --out stops here, before anything is written.
    # Taken after the read-only checks above, so their refusals leave no folder behind.
    with (one_writer(Path(cfg.out), "dflash-train run",
                     f"wait for it to end (or stop it), or choose another --out than {cfg.out}") if place.is_main
          else nullcontext()):
        return _train_locked(cfg, cache, device, resume, progress, resume_from, skipped_sequences)


def _train_locked(cfg: TrainConfig, cache, device: torch.device, resume: bool, progress: Progress | None,
                  resume_from: str | Path | None, skipped_sequences: int) -> TrainResult:
    bind_device(device)  # before the process group: NCCL, pinning and barriers use the current GPU
    info = init_distributed(device, cfg.wrap_single_rank, cfg.collective_timeout, cfg.save_timeout)
    try:  # the session, and its DDP wrapper, is gone when shutdown runs
        return _train_session(cfg, cache, info, device, resume, progress, resume_from, skipped_sequences)
    except BaseException as err:
        traceback.clear_frames(err.__traceback__)  # a failed session's, too: its frames would keep it
        raise
    finally:
        shutdown(info)


def _train_session(cfg: TrainConfig, cache, info: DistInfo, device: torch.device, resume: bool,
                   progress: Progress | None, resume_from: str | Path | None, skipped_sequences: int) -> TrainResult:
    session = setup(cfg, cache, info, device, resume, resume_from, progress or Progress(), skipped_sequences)
    before = held_out(session, "before") if cfg.eval_sequences and session.step == 0 else {}
    run_steps(session)
    after = held_out(session, "after") if cfg.eval_sequences else {}
    model_state = full_model_state(session.model)  # all ranks
    out = Path(cfg.out)
    export_dir = export_weights(session.model.cfg, model_state, out / "drafter") if info.is_main else out / "drafter"
    wait_for_rank0(info, "the export")
    return TrainResult(steps=session.step, export_dir=Path(export_dir), before=before, after=after)


def setup(cfg: TrainConfig, cache, info: DistInfo, device: torch.device, resume: bool,
          resume_from: str | Path | None, progress: Progress, skipped_sequences: int) -> Session:
    """The drafter, optimizer, schedule and checkpoint manager of a run, resumed when asked;
    writes the run's config.json (rank 0)."""
    progress = progress if info.is_main else Progress()
    out = Path(cfg.out)
    model = build_drafter(cfg, cache, device)
    if cfg.init_from is not None:  # before the wrapper: DDP and FSDP take the weights they find
        init_weights(model, cfg.init_from)
        progress.message(f"starting from the drafter weights of {cfg.init_from} (optimizer and schedule fresh)")
    forward = data_parallel(model, info, cfg.strategy, device, cfg.grad_reduce_dtype)
    # fused: one kernel for all parameters instead of several per tensor (CUDA only)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                  weight_decay=cfg.optim.weight_decay, fused=device.type == "cuda")
    set_head_matmul(cfg.loss.head_matmul, device)
    manager = CheckpointManager(out / "checkpoints", keep=cfg.keep_checkpoints)
    chosen = agreed_checkpoint(manager, resume, resume_from, info)
    checkpoint = (_checkpoint_to_resume(manager, cache.fingerprint, json.loads(json.dumps(cfg.to_dict())), progress,
                                        chosen) if resume else None)
    loader_state, plan = plan_session(cfg, cache, info, LoaderState(**checkpoint[1]["trainer"]["loader"]) if checkpoint
                                      else LoaderState(manifest_fingerprint=cache.fingerprint), progress)
    steps = total_steps(cfg, plan, loader_state.partitions)
    warmup = cfg.optim.warmup_steps if cfg.optim.warmup_steps is not None else max(1, steps // 25)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, steps, warmup, cfg.optim.min_lr_ratio))
    step = _restore(checkpoint, model, optimizer, scheduler, progress) if checkpoint else 0
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        write_file_atomic(out / "config.json", (json.dumps(cfg.to_dict(), indent=1) + "\n").encode(), root=out)
    metrics = MetricsLog(out, cfg.tensorboard) if info.is_main else None
    if cfg.data.skip_shards and info.is_main:
        progress.message(f"skipping {len(cfg.data.skip_shards)} shard(s) (--skip-shards): {skipped_sequences:,} sequences left out")
        metrics.write({"kind": "data", "skipped_shards": list(cfg.data.skip_shards), "skipped_sequences": skipped_sequences})
    return Session(cfg=cfg, cache=cache, info=info, device=device, model=model, forward=forward, optimizer=optimizer,
                   scheduler=scheduler, manager=manager, metrics=metrics, progress=progress, steps=steps, step=step,
                   loader_state=loader_state, plan=plan)


def held_out(s: Session, kind: str) -> dict:
    """The held-out evaluation, logged; under FSDP every rank evaluates (a sharded forward
    gathers parameters from all of them)."""
    result = (evaluate_heldout(s.model, s.cache, s.cfg.data, s.cfg.loss, s.cfg.eval_sequences, s.device)
              if s.info.is_main or s.sharded else {})
    if s.sharded:
        release_gathered(s.model)
    if result and s.info.is_main:
        s.metrics.write({"kind": "eval", "step": s.step, **result})
        s.progress.message(f"held-out {kind} training: tau {result['tau']:.3f}, loss {result['loss']:.4f}")
    wait_for_rank0(s.info, "the held-out evaluation")
    return result


def run_steps(s: Session) -> None:
    """The training loop, from s.step to s.steps: micro-steps, optimizer step, logs, checkpoints."""
    cfg, info, device = s.cfg, s.info, s.device
    batches = iter(train_loader(cfg.cache, cfg.storage_options, cfg.data, s.loader_state, info.rank, info.world_size,
                                pin_memory=device.type == "cuda", plan=s.plan))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    meter, tokens, started, shown = AcceptanceMeter(), 0, time.perf_counter(), {}
    # the first step whose loss was NaN/Inf, kept on the device: a per-step check would make
    # the host wait for every step's loss; it is read at the log and save steps (stop_if_diverged)
    first_bad = torch.full((), FINITE, dtype=torch.long, device=device)
    s.progress.start(s.steps - s.step, "training", "step")
    s.model.train()
    while s.step < s.steps:
        for index in range(cfg.optim.grad_accum):
            batch = next(batches)
            s.loader_state = LoaderState(**batch.state_after)
            with gradient_sync(s.forward, s.model, sync=index == cfg.optim.grad_accum - 1):
                result = micro_step(s.model, s.forward, on_device(batch, device, cfg, s.step, s.steps), cfg, info,
                                    device, autocast)
            if result is not None:
                meter.add(result)
                tokens += batch.num_tokens
                first_bad = torch.where(torch.isfinite(result.loss.detach()), first_bad, first_bad.clamp(max=s.step + 1))
        grad_norm = clip_gradients(s.model, cfg.optim.grad_clip)
        s.optimizer.step()
        s.scheduler.step()
        s.optimizer.zero_grad(set_to_none=True)
        s.step += 1
        if s.step % cfg.log_every == 0 or s.step % cfg.save_every == 0 or s.step == s.steps:
            stop_if_diverged(s, first_bad)  # before the metrics line and the save: neither gets NaN
        if s.step % cfg.log_every == 0 or s.step == s.steps:
            summary, rate = global_train_metrics(meter, tokens, time.perf_counter() - started, s.model.cfg,
                                                 meter_rows(cfg.loss, s.model.cfg), info, device)
            if info.is_main:
                norm = {} if grad_norm is None else {"grad_norm": float(grad_norm)}
                s.metrics.write({"kind": "train", "step": s.step, "lr": s.scheduler.get_last_lr()[0],
                                 "tokens_per_s": rate, **norm, **summary})
                shown = {"loss": f"{summary.get('loss', float('nan')):.4f}", "tau": f"{summary.get('tau', 0):.3f}",
                         "tok/s": f"{rate:,.0f}"}
            meter = AcceptanceMeter()
        s.progress.advance(1, **shown)
        if s.step % cfg.save_every == 0 or s.step == s.steps:
            save_checkpoint(s)
    s.progress.close()


FINITE = torch.iinfo(torch.int64).max  # first_bad's value while every loss was finite


def _nonfinite_weights(model: torch.nn.Module) -> int:
    """NaN/Inf values in this rank's trained weights (its shards under FSDP), in one host sync."""
    counts = [(~torch.isfinite(p.to_local() if hasattr(p, "to_local") else p)).sum()
              for p in model.parameters() if p.requires_grad]
    return int(torch.stack(counts).sum()) if counts else 0


def stop_if_diverged(s: Session, first_bad: torch.Tensor) -> None:
    """Stop the run (every rank, at the same steps) when a loss since the start was NaN/Inf on any
    rank or the weights now hold one: those weights are never saved nor exported, and the
    checkpoints already saved (all finite, as each save is preceded by this check) are kept."""
    bad = global_min(int(first_bad), s.info, s.device)
    broken = global_sum(float(_nonfinite_weights(s.model)), s.info, s.device)
    if bad == FINITE and not broken:
        return
    what = f"the loss was NaN/Inf at step {bad}" if bad != FINITE else f"the weights hold NaN/Inf after step {s.step}"
    if s.info.is_main:
        s.metrics.write({"kind": "stopped", "step": bad if bad != FINITE else s.step, "reason": "non-finite loss or weights"})
    s.progress.close()
    latest = s.manager.latest()
    kept = f"the last finite checkpoint, {latest.name}, is kept" if latest else "no checkpoint was saved before it"
    raise TrainingError(f"training diverged: {what} (lr {s.cfg.optim.lr:g}); the run stopped without saving or exporting "
                        f"those weights ({kept}): lower --lr or check the cache with `dflash-cache verify`, then train "
                        "again into a new --out")


def save_checkpoint(s: Session) -> None:
    """Gather the whole state (every rank: collective under FSDP) and save it on rank 0."""
    model_state, optimizer_state = full_model_state(s.model), full_optimizer_state(s.model, s.optimizer)
    if s.info.is_main:
        state = trainer_state(s.step, optimizer_state, s.scheduler.state_dict(), s.loader_state.to_dict(),
                              s.model.cfg.to_hf_config())
        s.manager.save(s.step, model_state, state, s.cfg.to_dict())
    wait_for_rank0(s.info, f"saving checkpoint step {s.step}")


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Export the drafter of a checkpoint folder (no cache or teacher needed)."""
    check_export_folder(out_dir)  # before reading the checkpoint: a refusal costs nothing
    state = CheckpointManager.load(checkpoint)
    drafter_cfg = DrafterConfig.from_hf_config(state["trainer"]["drafter"])
    return export_weights(drafter_cfg, state["model"], out_dir)
