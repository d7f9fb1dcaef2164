"""The drafter's training objective (docs/design.md, "The objective").

Every function here is a pure tensor function over one batch of blocks laid out per block
position: column `p` of an `[M, P]` input is block position `k = p + 1`, `P = block_size - 1`.
The caller gathers, for every block and column, the drafter's final-norm output state, the
target token `x_{a+k}`, the teacher's top-k at `t = a + k - 1`, and whether the position is
valid. This module turns that into the loss, the acceptance estimates, and the position weights.

Full-vocabulary logits are the memory hazard (production: vocab 248,320), so they only ever
exist for one chunk of valid positions at a time, and each chunk runs under activation
checkpointing so backward recomputes the chunk instead of keeping every chunk's logits alive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from dflash_common.errors import ConfigError
from dflash_common.values import is_int, is_real

LOSS_KINDS = ("kl", "ce", "mix")
# Settings that bound memory without changing what is learned: a run may resume with other values.
OPERATIONAL_FIELDS = ("chunk_positions", "chunk_bytes")
WEIGHTINGS = ("streak", "decay", "none")
HEAD_MATMULS = ("fp32", "tf32")

# docs/design.md's (block size, gamma) pairs; other block sizes interpolate between them.
_GAMMA_ANCHORS = ((8, 4.0), (10, 5.0), (16, 7.0))


@dataclass(frozen=True)
class LossConfig:
    """How the per-position loss and the position weights are computed."""

    kind: str = field(default="kl", metadata={"name": "loss"})
    """Per-position loss: "kl" = KL(teacher || drafter) over the teacher's top-k ids plus one
    tail bucket, "ce" = cross-entropy on the true next token, "mix" = mix_lambda * kl +
    (1 - mix_lambda) * ce."""

    mix_lambda: float = 0.5
    """Weight of kl in "mix", in [0, 1]; ignored by the other kinds."""

    weighting: str = "streak"
    """Position weights: "streak" = stop-gradient estimated probability that the accepted
    streak reaches the position, "decay" = exp(-(k - 1) / gamma), "none" = 1."""

    gamma: float | None = None
    """Decay length of the "decay" weights (and of streak_decay); None picks
    default_gamma(block_size): 7 for B=16, 5 for B=10, 4 for B=8, interpolated otherwise."""

    streak_smoothing: float = 0.5
    """s in alpha~ = s + (1 - s) * alpha, in [0, 1]; s > 0 keeps late positions trained while
    early-training acceptance is still near 0."""

    streak_decay: bool = False
    """Multiply the "streak" weights by the "decay" weights; only valid with weighting "streak"."""

    min_weight: float = 0.0
    """Floor of every position weight, in [0, 1]: late block positions keep at least this share of
    the training signal however small decay or streak makes their weight (0 = no floor)."""

    chunk_positions: int | None = None
    """Valid positions whose full-vocabulary fp32 logits exist at once; None sizes chunks by
    chunk_bytes. The loss's peak memory is about 5 x chunk_positions x vocab x 4 bytes (measured
    in benchmarks/RESULTS.md), whatever the batch."""

    chunk_bytes: int = 256 * 2**20
    """With chunk_positions None: one chunk's fp32 logits stay under this many bytes (256 MiB is
    270 positions at a 248,320-token vocabulary, and a whole batch at small vocabularies)."""

    head_matmul: str = "fp32"
    """Precision of the loss's LM-head matmul on CUDA: "fp32" (exact) or "tf32" (tensor cores,
    10-bit mantissa inputs with fp32 accumulation; by FLOP count most of a production step at
    fp32). CPU always computes fp32. The accuracy and speed of both are in benchmarks/RESULTS.md."""

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ConfigError(f"loss kind {self.kind!r} is unknown (use one of {', '.join(LOSS_KINDS)})")
        if not is_real(self.mix_lambda) or not 0.0 <= self.mix_lambda <= 1.0:
            raise ConfigError(f"mix_lambda {self.mix_lambda!r} is not a number in [0, 1] (pass e.g. 0.5)")
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(
                f"loss weighting {self.weighting!r} is unknown (use one of {', '.join(WEIGHTINGS)})"
            )
        if self.gamma is not None and (
            not is_real(self.gamma, finite=True) or self.gamma <= 0
        ):
            raise ConfigError(
                f"gamma {self.gamma!r} is not a positive number (pass e.g. 7, or None for the default)"
            )
        if not is_real(self.streak_smoothing) or not 0.0 <= self.streak_smoothing <= 1.0:
            raise ConfigError(
                f"streak_smoothing {self.streak_smoothing!r} is not a number in [0, 1] (pass e.g. 0.5)"
            )
        if not is_real(self.min_weight) or not 0.0 <= self.min_weight <= 1.0:
            raise ConfigError(f"min_weight {self.min_weight!r} is not a number in [0, 1] (pass e.g. 0.05, or 0 for no floor)")
        if not isinstance(self.streak_decay, bool):
            raise ConfigError(f"streak_decay {self.streak_decay!r} is not a bool (pass True or False)")
        if self.streak_decay and self.weighting != "streak":
            raise ConfigError(
                f"streak_decay=True needs weighting 'streak', not {self.weighting!r} "
                "(use weighting 'decay' alone, or set streak_decay=False)"
            )
        chunk = self.chunk_positions
        if chunk is not None and (not is_int(chunk) or chunk < 1):
            raise ConfigError(
                f"chunk_positions {self.chunk_positions!r} is not a positive integer or None (pass e.g. 256)"
            )
        if self.head_matmul not in HEAD_MATMULS:
            raise ConfigError(f"loss head_matmul {self.head_matmul!r} is unknown (use one of {', '.join(HEAD_MATMULS)})")
        if not is_int(self.chunk_bytes) or self.chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes {self.chunk_bytes!r} is not a positive integer (pass e.g. 268435456)")

    def positions_per_chunk(self, vocab_size: int) -> int:
        """Valid positions per loss chunk for a vocabulary of vocab_size tokens."""
        if self.chunk_positions is not None:
            return self.chunk_positions
        return max(1, self.chunk_bytes // (4 * vocab_size))


def set_head_matmul(head_matmul: str, device: torch.device) -> None:
    """Let CUDA's fp32 matmuls (under bf16 autocast only the LM head in the loss) use TF32."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = head_matmul == "tf32"


@dataclass
class LossOutput:
    """One batch's loss plus detached per-block-position sums, so logs can aggregate across
    steps (divide a sum by `count` for a mean). Column `p` is block position `k = p + 1`."""

    loss: torch.Tensor
    """Scalar loss with a gradient path: sum(w * loss) / number of valid positions."""

    alpha_sum: torch.Tensor
    """[P] float32: sum over valid positions of the sampling acceptance estimate alpha."""

    greedy_sum: torch.Tensor
    """[P] float32: number of valid positions whose drafter argmax is the teacher's top-1."""

    count: torch.Tensor
    """[P] int64: number of valid positions."""

    loss_sum: torch.Tensor
    """[P] float32: sum over valid positions of the unweighted per-position loss."""

    @staticmethod
    def tau_from_alpha(alpha_mean: torch.Tensor | Sequence[float]) -> float:
        """Expected acceptance length from per-position mean acceptance; see tau_from_alpha."""
        return tau_from_alpha(alpha_mean)


def tau_from_alpha(alpha_mean: torch.Tensor | Sequence[float]) -> float:
    """Expected accepted length `1 + sum_k prod_{j<=k} alpha_j` for per-position mean
    acceptance `alpha_mean[k - 1]`: position k is accepted only if every position before it
    was, and the anchor's verified token always counts as one."""
    alpha = torch.as_tensor(alpha_mean, dtype=torch.float64).reshape(-1)
    return float(1.0 + torch.cumprod(alpha, dim=0).sum())


def default_gamma(block_size: int) -> float:
    """Decay length for a block size: 4 at B=8, 5 at B=10, 7 at B=16 (docs/design.md), linear
    between those points and extended beyond them with the nearest segment's slope
    (B=4 -> 2, B=12 -> 5.67, B=32 -> 12.33), never below 1."""
    if not is_int(block_size) or block_size < 2:
        raise ConfigError(f"block_size {block_size!r} is not an integer >= 2 (pass e.g. 16)")
    middle_block_size = _GAMMA_ANCHORS[1][0]
    segment = _GAMMA_ANCHORS[:2] if block_size <= middle_block_size else _GAMMA_ANCHORS[1:]
    (b0, g0), (b1, g1) = segment
    return max(1.0, g0 + (g1 - g0) * (block_size - b0) / (b1 - b0))


def resolve_gamma(cfg: LossConfig, block_size: int) -> float:
    """The configured gamma, or the block size's default when the config leaves it None."""
    return float(cfg.gamma) if cfg.gamma is not None else default_gamma(block_size)


def decay_weights(num_positions: int, gamma: float) -> torch.Tensor:
    """[num_positions] float32 weights `exp(-(k - 1) / gamma)` for block positions k = 1..P."""
    offsets = torch.arange(num_positions, dtype=torch.float64)
    return torch.exp(-offsets / gamma).to(torch.float32)


def streak_weights(alpha: torch.Tensor, valid: torch.Tensor, smoothing: float) -> torch.Tensor:
    """[M, P] detached weights `prod_{j<k} alpha~_j`, alpha~ = s + (1 - s) * alpha.

    An invalid position counts as alpha~ = 1: it is either past the end of the sequence (so
    every later position is invalid too and the value is irrelevant) or a token the drafter is
    not trained on (loss_mask 0), for which there is no acceptance estimate. Treating it as
    neutral keeps such a gap from erasing the training signal of the valid positions after it.
    """
    smoothed = smoothing + (1.0 - smoothing) * alpha.detach().to(torch.float32)
    smoothed = torch.where(valid.bool(), smoothed, torch.ones_like(smoothed))
    reach = torch.cumprod(smoothed, dim=1)
    # Position k's weight multiplies the positions strictly before it, so shift by one.
    return torch.cat([torch.ones_like(reach[:, :1]), reach[:, :-1]], dim=1)


def position_weights(
    alpha: torch.Tensor, valid: torch.Tensor, cfg: LossConfig, block_size: int
) -> torch.Tensor:
    """[M, P] detached weights for every block position under cfg.weighting (values at invalid
    positions are defined but unused)."""
    num_blocks, num_positions = valid.shape
    if cfg.weighting == "none":
        return torch.ones(num_blocks, num_positions, device=valid.device)
    decay = decay_weights(num_positions, resolve_gamma(cfg, block_size)).to(valid.device)
    if cfg.weighting == "decay":
        weights = decay.expand(num_blocks, num_positions).clone()
    else:
        weights = streak_weights(alpha, valid, cfg.streak_smoothing)
        weights = weights * decay if cfg.streak_decay else weights
    return weights.clamp(min=cfg.min_weight)


def bucket_kl(
    teacher_p: torch.Tensor,
    log_q: torch.Tensor,
    teacher_tail: torch.Tensor | None,
    log_q_tail: torch.Tensor | None,
) -> torch.Tensor:
    """[n] KL(p || q) over the k top-k buckets plus the tail bucket (omitted when None).

    teacher_p [n, k] and teacher_tail [n] are probabilities; log_q [n, k] and log_q_tail [n]
    are the drafter's log-probabilities of the same buckets. 0 * log 0 counts as 0, and the
    top-k is never renormalised: that would reward moving the tail's mass into the top-k.
    """
    kl = (torch.xlogy(teacher_p, teacher_p) - teacher_p * log_q).sum(-1)
    if teacher_tail is not None:
        kl = kl + torch.xlogy(teacher_tail, teacher_tail) - teacher_tail * log_q_tail
    return kl


def _chunk_terms(
    states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    kind: str,
    mix_lambda: float,
    has_tail: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position (loss, alpha, greedy) for n gathered valid positions; the only place
    full-vocabulary logits exist. Runs under checkpoint, so it must stay deterministic."""
    # Autocast would silently run the LM head in bf16; the buckets need fp32 logits.
    with torch.autocast(device_type=states.device.type, enabled=False):
        logits = states.float() @ lm_head_weight.float().T
        log_norm = torch.logsumexp(logits, dim=-1)
        log_q = logits.gather(1, topk_ids) - log_norm[:, None]
        teacher_p = topk_logprobs.float().exp()
        if has_tail:
            teacher_tail = (1.0 - teacher_p.sum(-1)).clamp(min=0.0)
            # log(1 - sum q) cancels catastrophically when the top-k holds nearly all the mass.
            outside_topk = logits.scatter(1, topk_ids, float("-inf"))
            log_q_tail = torch.logsumexp(outside_topk, dim=-1) - log_norm
        else:
            teacher_tail = log_q_tail = None

        if kind == "ce":
            per_position = log_norm - logits.gather(1, targets[:, None]).squeeze(1)
        else:
            per_position = bucket_kl(teacher_p, log_q, teacher_tail, log_q_tail)
            if kind == "mix":
                ce = log_norm - logits.gather(1, targets[:, None]).squeeze(1)
                per_position = mix_lambda * per_position + (1.0 - mix_lambda) * ce

        with torch.no_grad():
            alpha = torch.minimum(teacher_p, log_q.exp()).sum(-1)
            if has_tail:
                alpha = alpha + torch.minimum(teacher_tail, log_q_tail.exp())
            greedy = (logits.argmax(dim=-1) == topk_ids[:, 0]).to(torch.float32)
    return per_position, alpha, greedy


def _check_inputs(states: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor, topk_ids: torch.Tensor,
                  topk_logprobs: torch.Tensor, valid: torch.Tensor, block_size: int) -> None:
    """Shapes of block_loss's inputs, each refused with the shape it should have."""
    if states.dim() != 3:
        raise ValueError(f"states must be [M, P, H], got shape {tuple(states.shape)}")
    num_blocks, num_positions, hidden = states.shape
    if num_positions != block_size - 1:
        raise ValueError(
            f"states has {num_positions} block positions, block_size {block_size} needs {block_size - 1}"
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden:
        raise ValueError(f"lm_head_weight must be [V, {hidden}], got shape {tuple(lm_head_weight.shape)}")
    grid = (num_blocks, num_positions)
    for name, tensor in (("targets", targets), ("valid", valid)):
        if tuple(tensor.shape) != grid:
            raise ValueError(f"{name} must be [M, P] = {list(grid)}, got shape {tuple(tensor.shape)}")
    if topk_ids.dim() != 3 or tuple(topk_ids.shape[:2]) != grid or topk_ids.shape[2] < 1:
        raise ValueError(
            f"topk_ids must be [M, P, k] with M, P = {list(grid)}, got shape {tuple(topk_ids.shape)}"
        )
    if tuple(topk_logprobs.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_logprobs shape {tuple(topk_logprobs.shape)} differs from "
            f"topk_ids shape {tuple(topk_ids.shape)}"
        )


def block_loss(
    states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    valid: torch.Tensor,
    cfg: LossConfig,
    block_size: int,
) -> LossOutput:
    """Weighted training loss of a batch of blocks.

    states [M, P, H]: drafter outputs after its final norm; lm_head_weight [V, H]: the
    teacher's frozen LM head (keep it fp32 to avoid a per-chunk upcast); targets [M, P]:
    x_{a+k}; topk_ids / topk_logprobs [M, P, k]: the teacher's distinct top-k ids and
    log-probs at t = a+k-1; valid [M, P] bool. Values at invalid positions are never read, so
    they may hold padding. P must equal block_size - 1.
    """
    _check_inputs(states, lm_head_weight, targets, topk_ids, topk_logprobs, valid, block_size)
    num_blocks, num_positions, hidden = states.shape
    valid = valid.bool()
    rows = valid.reshape(-1).nonzero().squeeze(1)
    num_valid = int(rows.numel())
    device = states.device

    if num_valid == 0:
        zeros = torch.zeros(num_positions, dtype=torch.float32, device=device)
        return LossOutput(
            # An empty sum keeps the graph connected, so backward still reaches the drafter.
            loss=states.reshape(-1)[:0].float().sum(),
            alpha_sum=zeros,
            greedy_sum=zeros.clone(),
            count=torch.zeros(num_positions, dtype=torch.long, device=device),
            loss_sum=zeros.clone(),
        )

    valid_states = states.reshape(-1, hidden).index_select(0, rows)
    valid_targets = targets.reshape(-1).index_select(0, rows).long()
    valid_ids = topk_ids.reshape(num_blocks * num_positions, -1).index_select(0, rows).long()
    valid_logprobs = topk_logprobs.reshape(num_blocks * num_positions, -1).index_select(0, rows)
    # With k >= V the top-k is the whole vocabulary and there is no tail bucket to compare.
    has_tail = valid_ids.shape[1] < lm_head_weight.shape[0]
    recompute = torch.is_grad_enabled() and (states.requires_grad or lm_head_weight.requires_grad)

    losses, alphas, greedies = [], [], []
    step = cfg.positions_per_chunk(lm_head_weight.shape[0])
    for start in range(0, num_valid, step):
        piece = slice(start, start + step)
        args = (
            valid_states[piece],
            lm_head_weight,
            valid_targets[piece],
            valid_ids[piece],
            valid_logprobs[piece],
            cfg.kind,
            float(cfg.mix_lambda),
            has_tail,
        )
        terms = checkpoint(_chunk_terms, *args, use_reentrant=False) if recompute else _chunk_terms(*args)
        losses.append(terms[0])
        alphas.append(terms[1])
        greedies.append(terms[2])
    per_position = torch.cat(losses)
    alpha = torch.cat(alphas).detach()
    greedy = torch.cat(greedies)

    alpha_grid = torch.zeros(num_blocks * num_positions, device=device).index_copy(0, rows, alpha)
    weights = position_weights(alpha_grid.view(num_blocks, num_positions), valid, cfg, block_size)
    valid_weights = weights.reshape(-1).index_select(0, rows)
    loss = (valid_weights * per_position).sum() / num_valid

    columns = rows % num_positions
    return LossOutput(
        loss=loss,
        alpha_sum=_sum_per_column(alpha, columns, num_positions),
        greedy_sum=_sum_per_column(greedy, columns, num_positions),
        count=torch.bincount(columns, minlength=num_positions),
        loss_sum=_sum_per_column(per_position, columns, num_positions),
    )


def _sum_per_column(values: torch.Tensor, columns: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[P] detached float32 sums of per-valid-position values by block column."""
    totals = torch.zeros(num_positions, dtype=torch.float32, device=values.device)
    return totals.index_add(0, columns, values.detach().float())
