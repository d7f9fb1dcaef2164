"""Stage 2: train a DFlash drafter from a cache. ``train(cfg)`` is the one entry point."""

from __future__ import annotations

import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_cache import SIZES, open_cache
from dflash_common.devices import bind_device, resolve_device
from dflash_common.errors import CacheError, DiskFullError, TrainingError
from dflash_common.files import is_disk_full, one_writer
from dflash_common.progress import Progress
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.checkpoint import (
    CheckpointManager,
    full_model_state,
    full_optimizer_state,
    trainer_state,
)
from dflash_train.training.data import train_loader
from dflash_train.training.distributed import (
    DistInfo,
    clip_gradients,
    dist_info_from_env,
    global_min,
    global_sum,
    init_distributed,
    release_gathered,
    shutdown,
    wait_for_rank0,
)
from dflash_train.training.export import check_export_folder, export_weights
from dflash_train.training.heldout import AcceptanceMeter, evaluate_heldout, meter_rows
from dflash_train.training.run_folder import check_run_folder
from dflash_train.training.session import Session, setup
from dflash_train.training.train_step import global_train_metrics, step_gradients


@dataclass
class TrainResult:
    steps: int
    export_dir: Path
    before: dict
    after: dict
























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
        if isinstance(err, Exception) and is_disk_full(err):  # every write of the run: config, metrics, saves, export
            raise run_disk_full(Path(cfg.out), err) from err
        raise
    finally:
        shutdown(info)


def _train_session(cfg: TrainConfig, cache, info: DistInfo, device: torch.device, resume: bool,
                   progress: Progress | None, resume_from: str | Path | None, skipped_sequences: int) -> TrainResult:
    session = setup(cfg, cache, info, device, resume, resume_from, progress or Progress(), skipped_sequences)
    autocast = train_autocast(device)  # one for the steps and the held-out forwards: the same dtypes
    before = held_out(session, "before", autocast) if cfg.eval_sequences and session.step == 0 else {}
    run_steps(session, autocast)
    after = held_out(session, "after", autocast) if cfg.eval_sequences else {}
    model_state = full_model_state(session.model)  # all ranks
    out = Path(cfg.out)
    export_dir = export_weights(session.model.cfg, model_state, out / "drafter") if info.is_main else out / "drafter"
    wait_for_rank0(info, "the export")
    return TrainResult(steps=session.step, export_dir=Path(export_dir), before=before, after=after)




def train_autocast(device: torch.device) -> torch.autocast:
    """The autocast a run's forwards run under: bf16 on CUDA, none on the CPU (fp32)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


def held_out(s: Session, kind: str, autocast: torch.autocast) -> dict:
    """The held-out evaluation, logged, its forwards under the training steps' ``autocast``; under
    FSDP every rank evaluates (a sharded forward gathers parameters from all of them)."""
    result = (evaluate_heldout(s.model, s.cache, s.cfg.data, s.cfg.loss, s.cfg.eval_sequences, s.device, autocast)
              if s.info.is_main or s.sharded else {})
    if s.sharded:
        release_gathered(s.model)
    if result and s.info.is_main:
        s.metrics.write({"kind": "eval", "step": s.step, **result})
        calibration = result.get("calibration") or {}
        confidence = (f", confidence head ECE {calibration['ece']:.3f} (mean abs error {calibration['mean_abs_error']:.3f})"
                      if calibration.get("ece") is not None else "")
        s.progress.message(f"held-out {kind} training: tau {result['tau']:.3f}, loss {result['loss']:.4f}{confidence}")
    wait_for_rank0(s.info, "the held-out evaluation")
    return result


def run_steps(s: Session, autocast: torch.autocast) -> None:
    """The training loop, from s.step to s.steps: micro-steps (under ``autocast``), optimizer step,
    logs, checkpoints."""
    cfg, info, device = s.cfg, s.info, s.device
    batches = iter(train_loader(cfg.cache, cfg.storage_options, cfg.data, s.loader_state, info.rank, info.world_size,
                                pin_memory=device.type == "cuda", plan=s.plan,
                                draft_positions=s.model.cfg.num_draft_positions))
    meter, tokens, largest, started, shown = AcceptanceMeter(), 0, 0, time.perf_counter(), {}
    # the first step whose loss was NaN/Inf, kept on the device: a per-step check would make
    # the host wait for every step's loss; it is read at the log and save steps (stop_if_diverged)
    first_bad = torch.full((), FINITE, dtype=torch.long, device=device)
    s.progress.start(s.steps - s.step, "training", "step")
    s.model.train()
    while s.step < s.steps:
        trained, micro_tokens, first_bad = step_gradients(s, batches, autocast, meter, first_bad)
        tokens, largest = tokens + trained, max(largest, micro_tokens)
        grad_norm = clip_gradients(s.model, cfg.optim.grad_clip)
        s.optimizer.step()
        s.scheduler.step()
        s.optimizer.zero_grad(set_to_none=True)
        s.step += 1
        if s.step % cfg.log_every == 0 or s.step % cfg.save_every == 0 or s.step == s.steps:
            stop_if_diverged(s, first_bad)  # before the metrics line and the save: neither gets NaN
        if s.step % cfg.log_every == 0 or s.step == s.steps:
            summary, rate = global_train_metrics(meter, tokens, largest, time.perf_counter() - started, s.model.cfg,
                                                 meter_rows(cfg.loss, s.model.cfg), info, device)
            if info.is_main:
                norm = {} if grad_norm is None else {"grad_norm": float(grad_norm)}
                s.metrics.write({"kind": "train", "step": s.step, "lr": s.scheduler.get_last_lr()[0],
                                 "tokens_per_s": rate, **norm, **summary})
                shown = {"loss": f"{summary.get('loss', float('nan')):.4f}", "tau": f"{summary.get('tau', 0):.3f}",
                         "tok/s": f"{rate:,.0f}"}
            meter, largest = AcceptanceMeter(), 0
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


def run_disk_full(out: Path, err: BaseException) -> DiskFullError:
    """The one line of a run whose disk filled up: the file it was writing, the newest complete
    checkpoint (each is written whole or removed, so it is intact) and the command that goes on
    from it once there is space."""
    path = err.path if isinstance(err, DiskFullError) else getattr(err, "filename", None) or out
    latest = CheckpointManager(out / "checkpoints").latest()
    if latest is None:
        return DiskFullError(path, f"no checkpoint of the run in {out} was complete yet, so nothing trained was kept",
                             "rerun the same command")
    return DiskFullError(path, f"the newest complete checkpoint, {latest}, is intact",
                         "rerun the same command with --resume to continue from it")


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
