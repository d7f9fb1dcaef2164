"""Speculative decoding with a DFlash drafter against real (tiny) transformers teachers.

What must hold: greedy output equals the teacher's own greedy output (ours and transformers'
`generate`), sampling leaves the teacher's distribution unchanged, the drafter sees exactly the
accepted context, and the counters add up. Random drafters almost never agree with a teacher, so
"run" teachers and hand-set "copy" drafters (below) make multi-token acceptance happen for real.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3_5TextConfig, Qwen3Config
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from dflash_common.errors import ConfigError
from dflash_train.measuring.speculative import (
    SpecResult,
    extend_until_stop,
    greedy_accept_length,
    mean_accepted_length,
    probs_from_logits,
    rejection_sample,
    speculative_generate,
    teacher_generate,
)
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.spec_config import SpecConfig
from dflash_train.training.model import DFlashDrafter

PROMPTS = ([5, 17, 33, 2, 90, 41], [260, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21])
LAYER_IDS = (1, 3)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are all per-op overhead; two OpenMP threads on a busy 2-core box only spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# Builders


class RecordingDrafter(DFlashDrafter):
    """The real drafter, also keeping the anchor and context keys/values of every block it drafts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = []

    def forward_block(self, context_hidden, block_ids, context_kv=None):
        self.seen.append((int(block_ids[0, 0]), [(k.clone(), v.clone()) for k, v in context_kv]))
        return super().forward_block(context_hidden, block_ids, context_kv=context_kv)


def random_drafter(teacher, block_size: int, mask_token_id: int, seed: int = 0, layer_ids=LAYER_IDS,
                   num_layers: int = 2, cls: type = DFlashDrafter) -> DFlashDrafter:
    cfg = DrafterConfig.from_teacher(teacher.config.to_dict(), layer_ids, mask_token_id,
                                     block_size=block_size, num_hidden_layers=num_layers)
    torch.manual_seed(seed)
    return cls(cfg, teacher.get_input_embeddings().weight, teacher.get_output_embeddings().weight).eval()


RUN_VOCAB, RUN_HIDDEN = 32, 64
RUN_MASK = RUN_VOCAB - 1


def run_teacher(arch: str, sigma: float, seed: int = 0):
    """A teacher whose greedy output is runs of one repeated token, broken by its attention.

    Orthonormal embeddings and LM head = 2 x embeddings make "repeat the last token" the default;
    random layers of scale sigma add context-dependent noise that ends runs at unpredictable
    points, so the output still depends on a correct KV cache. The MASK row is zero.
    """
    common = dict(vocab_size=RUN_VOCAB, hidden_size=RUN_HIDDEN, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=16, intermediate_size=128, tie_word_embeddings=False,
                  initializer_range=sigma, max_position_embeddings=512)
    if arch == "qwen3":
        config = Qwen3Config(**common)
    elif arch == "qwen3_sliding":
        # A window shorter than prompt + output: cropping must work past the window.
        config = Qwen3Config(**common, use_sliding_window=True, sliding_window=6,
                             layer_types=["sliding_attention", "full_attention"] * 2)
    else:
        config = Qwen3_5TextConfig(
            **common, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    torch.manual_seed(seed)
    teacher = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(RUN_HIDDEN, RUN_HIDDEN, generator=gen))[0][:RUN_VOCAB]
    with torch.no_grad():
        embed = basis.clone()
        embed[RUN_MASK] = 0
        teacher.get_input_embeddings().weight.copy_(embed)
        teacher.get_output_embeddings().weight.copy_(2.0 * basis)
    return teacher


def copy_drafter(teacher, block_size: int, cls: type = DFlashDrafter) -> DFlashDrafter:
    """A one-layer drafter whose weights make every block position predict the anchor token again.

    q = 0 gives uniform attention; the MASK embedding is zero and the context features are scaled
    down to 0.05 (hidden_norm weight), so the anchor's value dominates; v = o = identity carry it to
    every position, where the teacher's LM head reads it back as the anchor. The context keys stay
    random and position-dependent, so a wrong context is still visible in them.
    """
    drafter = random_drafter(teacher, block_size, RUN_MASK, num_layers=1, cls=cls)
    with torch.no_grad():
        drafter.hidden_norm.weight.fill_(0.05)
        attention = drafter.layers[0].self_attn
        attention.q_proj.weight.zero_()
        attention.v_proj.weight.copy_(torch.eye(RUN_HIDDEN))
        attention.o_proj.weight.copy_(torch.eye(RUN_HIDDEN))
        drafter.layers[0].mlp.down_proj.weight.zero_()
    return drafter


def hf_greedy(teacher, prompt: list[int], max_new_tokens: int, stop: tuple[int, ...] = ()) -> list[int]:
    """transformers' own greedy generate: the independent reference."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                              eos_token_id=list(stop) or None)
    # generate falls back to the model's own eos id when none is given; only `stop` may stop it.
    saved, teacher.generation_config.eos_token_id = teacher.generation_config.eos_token_id, None
    try:
        ids = torch.tensor([prompt])
        # An explicit mask: otherwise a prompt token equal to pad_token_id would be masked out.
        out = teacher.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    finally:
        teacher.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


def check_counters(result: SpecResult, cfg: SpecConfig, block_size: int) -> int:
    """Counters add up; returns how many produced tokens the stop/max cut dropped."""
    assert result.teacher_forwards == len(result.accepted_lengths) == len(result.draft_tokens)
    assert all(1 <= n <= block_size for n in result.accepted_lengths)
    assert all(len(d) == block_size - 1 for d in result.draft_tokens)
    cut = 1 + sum(result.accepted_lengths) - len(result.tokens)  # the prefill's token + every round's
    assert 0 <= cut <= block_size - 1
    if result.accepted_lengths:  # only the last round can be cut, and it keeps at least one token
        assert 1 + sum(result.accepted_lengths[:-1]) < len(result.tokens)
    assert len(result.tokens) <= cfg.max_new_tokens
    assert result.tokens[-1] in cfg.stop_token_ids or len(result.tokens) == cfg.max_new_tokens
    assert not any(t in cfg.stop_token_ids for t in result.tokens[:-1])
    return cut


def teacher_call_lengths(teacher, run) -> list[int]:
    """Tokens fed to the teacher by each of its forwards during `run()`."""
    lengths: list[int] = []
    handle = teacher.register_forward_pre_hook(
        lambda _module, _args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return lengths


# ---------------------------------------------------------------------------------------------
# Configuration and pure decisions


@pytest.mark.parametrize("overrides", [
    dict(max_new_tokens=0), dict(max_new_tokens=2.5), dict(temperature=-0.1), dict(temperature=float("nan")),
    dict(top_p=0.0), dict(top_p=1.5), dict(stop_token_ids=(3, -1)), dict(stop_token_ids=("7",)), dict(seed=-1),
])
def test_spec_config_rejects_bad_values(overrides):
    with pytest.raises(ConfigError):
        SpecConfig(**overrides)


def test_spec_config_normalises_stop_ids():
    assert SpecConfig(stop_token_ids=[4, 9]).stop_token_ids == (4, 9)
    assert SpecConfig().greedy and not SpecConfig(temperature=0.7).greedy


def test_mismatched_inputs_are_refused():
    teacher = run_teacher("qwen3", 0.1)
    drafter = copy_drafter(teacher, 4)
    cfg = SpecConfig(max_new_tokens=4)
    with pytest.raises(ConfigError, match="empty"):
        speculative_generate(teacher, drafter, [], cfg)
    with pytest.raises(ConfigError, match="outside the teacher's vocabulary"):
        speculative_generate(teacher, drafter, [1, RUN_VOCAB], cfg)
    with pytest.raises(ConfigError, match="outside the teacher's vocabulary"):
        teacher_generate(teacher, [-1], cfg)
    other = DFlashDrafter(DrafterConfig.from_teacher(teacher.config.to_dict(), LAYER_IDS, 0, block_size=4,
                                                     num_hidden_layers=1, vocab_size=RUN_VOCAB + 1),
                          torch.zeros(RUN_VOCAB + 1, RUN_HIDDEN), torch.zeros(RUN_VOCAB + 1, RUN_HIDDEN))
    with pytest.raises(ConfigError, match="vocabulary"):
        speculative_generate(teacher, other, [1, 2], cfg)
    deeper = DFlashDrafter(DrafterConfig.from_teacher(teacher.config.to_dict(), (1, 5), 0, block_size=4,
                                                      num_hidden_layers=1, num_target_layers=6),
                           teacher.get_input_embeddings().weight, teacher.get_output_embeddings().weight)
    with pytest.raises(ConfigError, match="taps layers"):
        speculative_generate(teacher, deeper, [1, 2], cfg)
    with pytest.raises(ConfigError, match="no verify forwards"):
        mean_accepted_length([SpecResult(tokens=[3])])


def test_probs_from_logits_matches_transformers_warpers():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.3, 0.9), (0.5, 0.3), (1.0, 1e-6)):
        warped = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
        expected = torch.softmax(warped, dim=-1)
        torch.testing.assert_close(probs_from_logits(logits, temperature, top_p), expected)


def test_greedy_accept_length_counts_the_leading_matches():
    targets = torch.tensor([4, 5, 6, 7])
    assert greedy_accept_length(torch.tensor([4, 5, 6]), targets) == 3
    assert greedy_accept_length(torch.tensor([4, 9, 6]), targets) == 1
    assert greedy_accept_length(torch.tensor([9, 5, 6]), targets) == 0


def test_extend_until_stop_keeps_the_stop_token_and_honours_the_limit():
    tokens = [1]
    assert extend_until_stop(tokens, [2, 9, 3], stop_token_ids=(9,), max_new_tokens=10)
    assert tokens == [1, 2, 9]
    tokens = [1]
    assert extend_until_stop(tokens, [2, 3, 4, 5], stop_token_ids=(9,), max_new_tokens=3)
    assert tokens == [1, 2, 3]
    tokens = [1]
    assert not extend_until_stop(tokens, [2, 3], stop_token_ids=(), max_new_tokens=5)
    assert tokens == [1, 2, 3]


def chi_square_pvalue(counts: Counter, probs: dict, total: int) -> float:
    """Pearson chi-square p-value of observed counts against exact probabilities.

    Cells expecting fewer than 5 observations are pooled into one, as the test requires; an
    observation of a zero-probability outcome is an immediate failure (p = 0).
    """
    if any(probs.get(outcome, 0.0) <= 0 for outcome in counts):
        return 0.0
    cells, small_observed, small_expected = [], 0, 0.0
    for outcome, prob in probs.items():
        expected = prob * total
        if expected >= 5:
            cells.append((counts.get(outcome, 0), expected))
        else:
            small_observed += counts.get(outcome, 0)
            small_expected += expected
    if small_expected > 0:
        cells.append((small_observed, small_expected))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_rejection_sample_emits_the_teacher_distribution_at_every_depth():
    """Given the round reached depth j, the token emitted there follows p[j], whatever q is."""
    gen = torch.Generator().manual_seed(0)
    vocab, drafts_per_block, samples = 6, 3, 12000
    p = torch.softmax(torch.randn(drafts_per_block + 1, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(drafts_per_block, vocab, generator=gen) * 1.5, dim=-1)
    q[1, 2] = 0.0  # a token the drafter never proposes still comes out at p's rate
    q = q / q.sum(-1, keepdim=True)
    depth_counts = [Counter() for _ in range(drafts_per_block + 1)]
    accepted = Counter()
    for _ in range(samples):
        drafts = torch.multinomial(q, 1, generator=gen).squeeze(-1)
        m, token = rejection_sample(p, q, drafts, gen)
        accepted[m] += 1
        emitted = drafts[:m].tolist() + [token]
        for depth, tok in enumerate(emitted):
            depth_counts[depth][tok] += 1
    assert set(accepted) == set(range(drafts_per_block + 1)), accepted  # every path taken
    for depth, counts in enumerate(depth_counts):
        n = sum(counts.values())
        assert n > 300, (depth, n)
        expected = {tok: float(p[depth, tok]) for tok in range(vocab)}
        assert chi_square_pvalue(counts, expected, n) > 1e-3, (depth, counts)
    # The test has power: the drafter's own q at depth 0 is clearly rejected.
    assert chi_square_pvalue(depth_counts[0], {t: float(q[0, t]) for t in range(vocab)}, samples) < 1e-6


# ---------------------------------------------------------------------------------------------
# Greedy: exactly the teacher's output


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_greedy_equals_teacher_with_random_models(teacher_dir, arch):
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir(arch), dtype=torch.float32).eval()
    vocab = teacher.config.vocab_size
    max_new = 20
    # The hybrid teacher runs slow reference kernels on CPU: fewer prompts keep the test short.
    for prompt in PROMPTS if arch == "qwen3" else PROMPTS[:2]:
        reference = hf_greedy(teacher, prompt, max_new)
        cfg = SpecConfig(max_new_tokens=max_new)
        assert teacher_generate(teacher, prompt, cfg).tokens == reference
        # Stop on a token the teacher really produces, late enough that several rounds ran.
        stop = reference[len(reference) // 2]
        stopped = reference[: reference.index(stop) + 1]
        stop_cfg = SpecConfig(max_new_tokens=max_new, stop_token_ids=(stop,))
        assert hf_greedy(teacher, prompt, max_new, (stop,)) == stopped
        assert teacher_generate(teacher, prompt, stop_cfg).tokens == stopped
        for block_size in (2, 4, 8):
            drafter = random_drafter(teacher, block_size, mask_token_id=vocab - 1, seed=block_size)
            result = speculative_generate(teacher, drafter, prompt, cfg)
            assert result.tokens == reference, (prompt, block_size)
            check_counters(result, cfg, block_size)
            result = speculative_generate(teacher, drafter, prompt, stop_cfg)
            assert result.tokens == stopped, (prompt, block_size)
            check_counters(result, stop_cfg, block_size)


@pytest.mark.parametrize("arch,sigma", [("qwen3", 0.14), ("qwen3_sliding", 0.14), ("qwen3_5", 0.08)])
def test_greedy_equals_teacher_with_high_acceptance(arch, sigma):
    """A copy drafter on a run teacher: partial rounds, full blocks with bonus, mid-block cuts."""
    teacher = run_teacher(arch, sigma)
    cases = (([3, 7, 3, 9, 12], 30), ([5, 5, 1], 31), ([20, 2, 17, 4, 4, 9, 0], 29))
    references = []
    for prompt, max_new in cases:
        references.append(hf_greedy(teacher, prompt, max_new))
        assert teacher_generate(teacher, prompt, SpecConfig(max_new_tokens=max_new)).tokens == references[-1]
    lengths: Counter = Counter()
    cuts = 0
    for block_size in (4, 8):
        drafter = copy_drafter(teacher, block_size)
        for (prompt, max_new), reference in zip(cases, references):
            cfg = SpecConfig(max_new_tokens=max_new)
            results = []
            calls = teacher_call_lengths(
                teacher, lambda: results.append(speculative_generate(teacher, drafter, prompt, cfg)))
            result = results[0]
            assert result.tokens == reference, (prompt, block_size, max_new)
            cuts += check_counters(result, cfg, block_size) > 0
            lengths.update((block_size, n) for n in result.accepted_lengths)
            # The prefill, then ONE forward of the whole block per round; a hybrid teacher re-runs
            # the kept tokens after a rejection (not after the last round: nothing is rolled back
            # there), a cropped cache never does.
            expected = [len(prompt)]
            for index, kept in enumerate(result.accepted_lengths):
                expected.append(block_size)
                if arch == "qwen3_5" and kept < block_size and index < len(result.accepted_lengths) - 1:
                    expected.append(kept)
            assert calls == expected, (calls, result.accepted_lengths)
            assert result.rerun_forwards == len(expected) - 1 - result.teacher_forwards
    for block_size in (4, 8):
        seen = {n for b, n in lengths if b == block_size}
        assert block_size in seen, lengths  # full blocks: every draft accepted plus the bonus
        assert seen & set(range(2, block_size)), lengths  # partial acceptance, m >= 1
        assert 1 in seen, lengths  # rejection of the first draft
    assert cuts > 0  # max_new_tokens fell inside a block at least once
    drafter = copy_drafter(teacher, 4)
    tau = mean_accepted_length([speculative_generate(teacher, drafter, p, SpecConfig(max_new_tokens=30))
                                for p, _ in cases])
    assert tau > 1.4, tau  # a random drafter gets 1.0


@pytest.mark.parametrize("arch,sigma", [("qwen3", 0.14), ("qwen3_5", 0.08)])
def test_drafter_sees_exactly_the_accepted_context(arch, sigma):
    """Every round's cached context keys/values equal those of a fresh whole-sequence teacher forward."""
    teacher = run_teacher(arch, sigma)
    drafter = copy_drafter(teacher, 4, cls=RecordingDrafter)
    prompt = [3, 7, 3, 9, 12]
    result = speculative_generate(teacher, drafter, prompt, SpecConfig(max_new_tokens=40))
    lengths = result.accepted_lengths
    assert len(set(lengths)) >= 2 and max(lengths) == 4, lengths  # anchors move by varied steps
    assert len(drafter.seen) == result.teacher_forwards
    sequence = torch.tensor([prompt + result.tokens])
    # The decoder layers' own outputs (hidden_states[-1] would be after the final norm).
    captured = {}
    handles = [teacher.model.layers[i].register_forward_hook(
        lambda _m, _i, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in drafter.cfg.target_layer_ids]
    with torch.no_grad():
        teacher(input_ids=sequence)
        for handle in handles:
            handle.remove()
        features = torch.stack([captured[i] for i in drafter.cfg.target_layer_ids], dim=2)
        anchor = len(prompt)
        for (anchor_token, context), kept in zip(drafter.seen, result.accepted_lengths):
            assert anchor_token == int(sequence[0, anchor])
            expected = drafter.context_kv(features[:, :anchor])
            for (keys, values), (want_keys, want_values) in zip(context, expected):
                torch.testing.assert_close(keys, want_keys, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(values, want_values, rtol=1e-4, atol=1e-6)
            anchor += kept


# ---------------------------------------------------------------------------------------------
# Sampling: the teacher's distribution, exactly

SAMPLE_VOCAB = 12
SAMPLE_PROMPT = [1, 4, 2, 7]


def sampling_teacher():
    """One layer keeps a sample cheap; a wide initialisation makes its distributions uneven."""
    config = Qwen3Config(vocab_size=SAMPLE_VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64, tie_word_embeddings=False,
                         initializer_range=0.5, max_position_embeddings=64)
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(config).eval()


def exact_outcome_probs(teacher, length: int, temperature: float, top_p: float, stop: tuple[int, ...]) -> dict:
    """Probability of every possible output by enumeration, with transformers' own warpers.

    An output is a length-`length` continuation cut after its first stop token.
    """
    prefixes = list(itertools.product(range(SAMPLE_VOCAB), repeat=length - 1))
    ids = torch.tensor([SAMPLE_PROMPT + list(prefix) for prefix in prefixes])
    with torch.no_grad():
        logits = teacher(input_ids=ids).logits[:, len(SAMPLE_PROMPT) - 1:].double()
    flat = logits.reshape(-1, SAMPLE_VOCAB)
    warped = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, flat))
    step_probs = torch.softmax(warped, dim=-1).reshape(len(prefixes), length, SAMPLE_VOCAB)
    row_of = {prefix: row for row, prefix in enumerate(prefixes)}
    probs: dict = Counter()
    for sequence in itertools.product(range(SAMPLE_VOCAB), repeat=length):
        row = row_of[sequence[:-1]]
        prob = 1.0
        for depth, token in enumerate(sequence):
            prob *= float(step_probs[row, depth, token])
        cut = next((i + 1 for i, t in enumerate(sequence) if t in stop), length)
        probs[sequence[:cut]] += prob
    return dict(probs)


@pytest.mark.parametrize("block_size,temperature,top_p,stop,samples", [
    (2, 1.0, 1.0, (), 800),     # one draft per block: bonus tokens land in the output
    (4, 0.8, 0.9, (2,), 800),   # multi-draft chains, nucleus filter, stops inside a block
])
@pytest.mark.fast_cases(1)
def test_sampling_keeps_the_teacher_distribution(block_size, temperature, top_p, stop, samples):
    teacher = sampling_teacher()
    drafter = random_drafter(teacher, block_size, mask_token_id=SAMPLE_VOCAB - 1, seed=1, layer_ids=(0,),
                             num_layers=1)
    length = 3
    exact = exact_outcome_probs(teacher, length, temperature, top_p, stop)
    assert abs(sum(exact.values()) - 1) < 1e-9
    counts: Counter = Counter()
    rounds: Counter = Counter()
    stop_cuts = 0
    for seed in range(samples):
        cfg = SpecConfig(max_new_tokens=length, temperature=temperature, top_p=top_p, stop_token_ids=stop, seed=seed)
        result = speculative_generate(teacher, drafter, SAMPLE_PROMPT, cfg)
        counts[tuple(result.tokens)] += 1
        rounds.update(result.accepted_lengths)
        cut = check_counters(result, cfg, block_size)
        stop_cuts += bool(cut) and len(result.tokens) < length
    pvalue = chi_square_pvalue(counts, exact, samples)
    assert pvalue > 1e-3, (pvalue, counts.most_common(8))
    assert 1 in rounds and block_size in rounds, rounds  # rejections and fully accepted blocks
    if block_size > 2:
        assert rounds.keys() & set(range(2, block_size)), rounds
    if stop:
        assert stop_cuts > 0  # a stop token ended a round early
    # Power: as many samples of a nearby distribution (temperature x1.25) fail the same test.
    wrong = exact_outcome_probs(teacher, length, temperature * 1.25, top_p, stop)
    outcomes = list(wrong)
    draws = torch.multinomial(torch.tensor([wrong[o] for o in outcomes]), samples, replacement=True,
                              generator=torch.Generator().manual_seed(0))
    assert chi_square_pvalue(Counter(outcomes[i] for i in draws.tolist()), exact, samples) < 1e-3


def test_teacher_generate_samples_the_teacher_distribution():
    teacher = sampling_teacher()
    length, samples = 2, 400
    exact = exact_outcome_probs(teacher, length, 1.0, 1.0, ())
    counts = Counter(tuple(teacher_generate(teacher, SAMPLE_PROMPT, SpecConfig(
        max_new_tokens=length, temperature=1.0, seed=seed)).tokens) for seed in range(samples))
    assert chi_square_pvalue(counts, exact, samples) > 1e-3
    result = teacher_generate(teacher, SAMPLE_PROMPT, SpecConfig(max_new_tokens=5, temperature=1.0))
    assert result.accepted_lengths == [1] * 4 and result.teacher_forwards == 4
    assert mean_accepted_length([result]) == 1.0
