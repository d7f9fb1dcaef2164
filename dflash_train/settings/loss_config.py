"""The loss section: the per-position terms and the position weights (dflash_train.training.loss computes them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_common.errors import ConfigError
from dflash_common.values import is_int, is_real

TERMS = ("kl", "ce", "top1", "tv", "nla", "lk_hybrid", "rkl", "jsd", "onpolicy_kl", "chain")
"""Per-position terms a loss sums (docs/design.md, "The objective"): each is a function of the
teacher's top-k buckets plus its tail, the drafter's distribution and, for ce, the true token."""
LOSS_KINDS = (*TERMS, "mix")
# Settings that bound memory without changing what is learned: a run may resume with other values.
OPERATIONAL_FIELDS = ("chunk_positions", "chunk_bytes")
WEIGHTINGS = ("streak", "decay", "dpace", "first_error", "none")
# Terms with a divergence of their own that temperature would leave at T = 1: refused beside a temperature.
UNTEMPERED_DIVERGENCES = ("lk_hybrid", "rkl", "jsd", "onpolicy_kl")
HEAD_MATMULS = ("fp32", "tf32", "bf16")
# kl_temperature's range. The T^2 factor scales kl's gradient by about T below 1 (measured on
# tempered_kl: 0.017 at T = 0.1 against 0.053 at 1, 1.8e-4 at 0.001, exactly 0 at 1e-30, where the loss
# reads 0.0000); above 100 both tempered distributions are within fp32 rounding of uniform and
# their KL is rounding (at T = 1e4 it read 18 times its large-T limit). Distillation uses 1 to 20.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.1, 100.0


@dataclass(frozen=True)
class LossConfig:
    """How the per-position loss and the position weights are computed."""

    kind: str = field(default="kl", metadata={"name": "loss"})
    """Per-position loss, over the teacher's top-k ids plus one tail bucket (p: teacher, q:
    drafter, alpha = sum min(p, q), the acceptance rate): "kl" = KL(p || q), "ce" = cross-entropy
    on the true next token (the cached sequence's), "top1" = cross-entropy on the teacher's top-1
    token (its greedy choice, what greedy verification accepts; speculators' ce, which takes the
    target's argmax: the same as ce where the cache holds the teacher's own greedy answers, not
    where it holds a corpus's), "tv" = 1 - alpha, "nla" = -log(alpha), "lk_hybrid" = l * kl + (1 - l)
    * tv with l = exp(-lk_eta * alpha) detached (the LK losses), "rkl" = KL(q || p), "jsd" =
    Jensen-Shannon, "onpolicy_kl" = kl on the positions the drafter's own greedy block gets
    accepted, rkl decayed by onpolicy_decay after its first rejection (on-policy replay), "chain" =
    minus the block's expected accepted length, differentiable: at its k-th valid position 1 -
    prod over i <= k of alpha_i (an invalid position ends the chain), so a block's sum is its valid
    positions minus E[accepted] and the loss, divided by the valid positions as every term is, is
    in [0, 1] per position (tv at k = 1); the position weights do not multiply it (the product is
    its own weighting), "mix" = mix_lambda * kl + (1 - mix_lambda) * ce. Ignored when terms is set."""

    terms: dict[str, float] | None = field(default=None, metadata={"name": "loss_terms"})
    """A weighted sum of per-position losses instead of kind, as a JSON object of kind names to
    weights, e.g. {"ce": 0.1, "tv": 0.9}; each term is logged on its own (None: kind alone)."""

    mix_lambda: float = 0.5
    """Weight of kl in "mix", in [0, 1]; ignored by the other kinds."""

    lk_eta: float = 3.0
    """eta of lk_hybrid's blend l = exp(-eta * alpha): larger moves from kl to tv at lower
    acceptance (3 is the LK paper's choice)."""

    onpolicy_decay: float = 0.5
    """In onpolicy_kl, the weight of the reverse KL at the j-th position after the drafter's first
    greedy rejection in its block is onpolicy_decay ** j, in [0, 1]."""

    weighting: str = "streak"
    """Position weights: "streak" = stop-gradient estimated probability that the accepted
    streak reaches the position, "decay" = exp(-(k - 1) / gamma), "dpace" = the drafter's own
    confidence (D-PACE): sum over j >= k of prod over i <= j of c~_i, c~ = s + (1 - s) *
    q(true token), s = dpace_smoothing, detached; "first_error" = the probability that the block's
    first rejection is at the position, (prod over i < k of alpha_i) * (1 - alpha_k), detached
    (our reading of the first-error focal weights of arXiv 2606.11552; min_weight floors it);
    "none" = 1. The chain term is never weighted."""

    dpace_smoothing: float = 0.5
    """s of the dpace weights' smoothed confidence c~ = s + (1 - s) * c, in (0, 1]."""

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

    temperature: float = field(default=1.0, metadata={"name": "kl_temperature"})
    """Temperature T of the kl term (1 = unchanged): KL(p_T || q_T) * T^2 (Hinton's factor keeps the
    gradient's scale), q_T = softmax(logits / T), p_T prop. to p^(1/T) on the cached top-k and, for the
    tail bucket, assuming its mass is spread evenly over the V - k other tokens, tail^(1/T) *
    (V - k)^(1 - 1/T). Only kl is tempered; ce, tv, nla and chain stay at T = 1 beside it, and a
    temperature other than 1 is refused without kl or with lk_hybrid, rkl, jsd or onpolicy_kl, and one
    outside [0.1, 100] always (below, T^2 leaves kl no gradient to train on; above, fp32 rounding). Each
    loss chunk then holds about two more [positions, vocab] fp32 tensors (lower chunk_bytes to match)."""

    chunk_positions: int | None = None
    """Valid positions whose full-vocabulary fp32 logits exist at once; None sizes chunks by
    chunk_bytes. The loss's peak memory is about 5 x chunk_positions x vocab x 4 bytes (measured
    in benchmarks/RESULTS.md), whatever the batch."""

    chunk_bytes: int = 256 * 2**20
    """With chunk_positions None: one chunk's fp32 logits stay under this many bytes (256 MiB is
    270 positions at a 248,320-token vocabulary, and a whole batch at small vocabularies)."""

    head_matmul: str = "fp32"
    """Precision of the loss's LM-head matmul: "fp32" (exact), "tf32" (CUDA tensor cores,
    10-bit mantissa inputs with fp32 accumulation; by FLOP count most of a production step at
    fp32) or "bf16" (the frozen head held in bf16 on CUDA, half its memory: 2.5 GB at production
    size; bf16 inputs, fp32 accumulation and fp32 logits). CPU keeps the head in fp32: there
    "tf32" is fp32 and "bf16" rounds the matmul's inputs to bf16 the way CUDA computes it. The
    accuracy and speed of each are in benchmarks/RESULTS.md."""

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ConfigError(f"loss kind {self.kind!r} is unknown (use one of {', '.join(LOSS_KINDS)})")
        if not is_real(self.mix_lambda) or not 0.0 <= self.mix_lambda <= 1.0:
            raise ConfigError(f"mix_lambda {self.mix_lambda!r} is not a number in [0, 1] (pass e.g. 0.5)")
        check_terms(self.terms)
        if not is_real(self.lk_eta, finite=True) or self.lk_eta < 0:
            raise ConfigError(f"lk_eta {self.lk_eta!r} is not a number >= 0 (pass e.g. 3)")
        if not is_real(self.onpolicy_decay) or not 0.0 <= self.onpolicy_decay <= 1.0:
            raise ConfigError(f"onpolicy_decay {self.onpolicy_decay!r} is not a number in [0, 1] (pass e.g. 0.5)")
        if not is_real(self.dpace_smoothing) or not 0.0 < self.dpace_smoothing <= 1.0:
            raise ConfigError(f"dpace_smoothing {self.dpace_smoothing!r} is not a number in (0, 1] (pass e.g. 0.5)")
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
        check_temperature(self.temperature, self.term_weights())
        if self.head_matmul not in HEAD_MATMULS:
            raise ConfigError(f"loss head_matmul {self.head_matmul!r} is unknown (use one of {', '.join(HEAD_MATMULS)})")
        if not is_int(self.chunk_bytes) or self.chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes {self.chunk_bytes!r} is not a positive integer (pass e.g. 268435456)")

    def term_weights(self) -> dict[str, float]:
        """The loss as {term: weight}: terms when set, else kind (mix as its two terms)."""
        if self.terms is not None:
            return {name: float(weight) for name, weight in self.terms.items()}
        if self.kind == "mix":
            return {"kl": float(self.mix_lambda), "ce": 1.0 - float(self.mix_lambda)}
        return {self.kind: 1.0}

    def positions_per_chunk(self, vocab_size: int) -> int:
        """Valid positions per loss chunk for a vocabulary of vocab_size tokens."""
        if self.chunk_positions is not None:
            return self.chunk_positions
        return max(1, self.chunk_bytes // (4 * vocab_size))


def check_terms(terms) -> None:
    """Refuse a terms table that is not {known term: weight >= 0} with some weight > 0."""
    if terms is None:
        return
    example = '{"ce": 0.1, "tv": 0.9}'
    if not isinstance(terms, dict) or not terms:
        raise ConfigError(f"loss terms {terms!r} is not a non-empty table of term weights (pass e.g. {example})")
    unknown = sorted(str(name) for name in terms if name not in TERMS)
    if unknown:
        raise ConfigError(f"loss term {unknown[0]!r} is unknown (use some of {', '.join(TERMS)}, e.g. {example})")
    bad = [name for name, weight in terms.items() if not is_real(weight, finite=True) or weight < 0]
    if bad:
        raise ConfigError(f"loss term {bad[0]!r} has weight {terms[bad[0]]!r}, not a number >= 0 (e.g. {example})")
    if not any(weight > 0 for weight in terms.values()):
        raise ConfigError(f"loss terms {terms!r} weigh every term 0; give one a positive weight (e.g. {example})")


def check_temperature(temperature, weights: dict[str, float]) -> None:
    """Refuse a temperature that is not > 0, or other than 1 for a loss with no kl term to temper
    or with a divergence that would stay untempered beside it."""
    if not is_real(temperature, finite=True) or temperature <= 0:
        raise ConfigError(f"kl_temperature {temperature!r} is not a number > 0 (pass e.g. 2, or 1 for none)")
    if not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        why = ("the T^2 factor would leave the kl term almost no gradient, so the run would train nothing"
               if temperature < MIN_TEMPERATURE else "the tempered distributions would be within fp32 rounding of "
               "uniform, so their KL would be rounding error")
        raise ConfigError(f"kl_temperature {temperature:g} is outside [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]: {why}; "
                          "pass a temperature in that range (distillation uses 1 to 20; 1 for none)")
    if temperature == 1:
        return
    if "kl" not in weights:
        raise ConfigError(f"kl_temperature {temperature!r} tempers the kl term, and the loss {sorted(weights)} has "
                          "none (use --loss kl or a kl term, or kl_temperature 1)")
    untempered = [name for name in weights if name in UNTEMPERED_DIVERGENCES]
    if untempered:
        raise ConfigError(f"kl_temperature {temperature!r} would leave {untempered[0]!r}'s divergence at T = 1; "
                          "use it without a temperature, or drop that term")
