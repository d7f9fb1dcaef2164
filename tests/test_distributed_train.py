"""DDP and FSDP2 training under real torchrun processes: equal to one process, resumable across
world sizes and strategies."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from typer.testing import CliRunner

from cli.train import app
from dflash_cache import open_cache
from dflash_train.settings.data_config import DataConfig
from dflash_train.settings.model_config import ModelConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.distributed import shard_drafter
from dflash_train.training.epoch_plan import EpochPlan
from dflash_train.training.session import build_drafter

# real torchrun processes (~1 minute): `make test-slow`, which CI runs after `make test`
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("dflash-train"))
# 100-token batches of 36-58-token sequences: rank batches of one sequence and of two (unequal
# shares of the global batch's positions); a clip below the gradient norm, so clipping acts on
# every step. The one-process reference plans over two partitions (--data-partitions 2), so it
# trains on the same global batches as two ranks.
ARGS = ["--steps", "6", "--num-layers", "1", "--block-size", "4", "--batch-tokens", "100", "--block-tokens", "40",
        "--heldout-fraction", "0.05", "--save-every", "3", "--log-every", "1", "--eval-sequences", "8",
        "--noise", "cosine", "--grad-clip", "0.003", "--quiet"]


def _torchrun(*args, ranks: int = 2):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--no-python",
                           CLI, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]


def _one_process(*args):
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:06d}"


def _params(run: Path, step: int) -> dict:
    return safetensors.torch.load_file(str(_step(run, step) / "model.safetensors"))


def _trainer(run: Path, step: int) -> dict:
    return torch.load(_step(run, step) / "trainer.pt", weights_only=False)


def _close(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        # atol 1e-5: Adam turns a rounding-level difference in a near-zero gradient (the ranks sum
        # their shares in another order) into a step of its own; one of 2,048 weights moved 2.3e-6
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


def _resumed(source: Path, dest: Path) -> Path:
    """A copy of a finished run with its last checkpoint removed, to resume from step 3."""
    shutil.copytree(source, dest)
    shutil.rmtree(_step(dest, 6))
    return dest


def _assert_continues(single: Path, resumed: Path):
    """The resumed run ends where the uninterrupted one does: same weights, and the loader has
    consumed the same global batches (none skipped or repeated)."""
    _close(_params(single, 6), _params(resumed, 6))
    assert _trainer(resumed, 6)["loader"] == _trainer(single, 6)["loader"]


def _metrics(run: Path, kind: str) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("kind") == kind]


def _same_train_metrics(single: Path, run: Path):
    """Rank 0 logs the whole global batch (all ranks' positions), as one process does."""
    ours, theirs = _metrics(run, "train"), _metrics(single, "train")
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(1, 7))
    for a, b in zip(ours, theirs):
        assert a["positions"] == b["positions"] > 0
        for key in ("loss", "tau"):
            assert a[key] == pytest.approx(b[key], rel=1e-3), (a["step"], key)  # weights agree to ~1e-4
        assert a["alpha"] == pytest.approx(b["alpha"], rel=1e-3, abs=1e-5)


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache_url):
    run = tmp_path_factory.mktemp("single") / "run"
    _one_process("run", "--cache", cache_url, "--out", str(run), "--data-partitions", "2", *ARGS)
    return run


def test_planned_batches_give_the_ranks_unequal_shares(cache_url):  # noqa: F811
    """The runs below cover rank batches of one and of two sequences, at one step on different
    ranks (guards ARGS against a changed cache)."""
    plan = EpochPlan(open_cache(cache_url), DataConfig(batch_tokens=100, heldout_fraction=0.05))
    sizes = [[len(batch) for batch in plan.rank_batches(0, 2, rank, 2)[:6]] for rank in (0, 1)]
    assert any(a != b for a, b in zip(*sizes)) and {1, 2} <= set(sizes[0] + sizes[1]), sizes


def test_ddp_equals_one_process_and_resumes_across_world_sizes(tmp_path, cache_url, single):  # noqa: F811
    # two ranks, same global batches: the same parameters after every checkpoint
    ddp = tmp_path / "ddp"
    _torchrun("run", "--cache", cache_url, "--out", str(ddp), *ARGS)
    _close(_params(single, 3), _params(ddp, 3))
    _close(_params(single, 6), _params(ddp, 6))
    assert (ddp / "drafter" / "model.safetensors").exists()
    _same_train_metrics(single, ddp)

    # a two-rank run resumed by one process continues the same global sequence order
    two_then_one = _resumed(ddp, tmp_path / "two_then_one")
    _one_process("run", "--cache", cache_url, "--out", str(two_then_one), "--resume", *ARGS)
    _assert_continues(single, two_then_one)

    # and the reverse: a one-process run resumed by two ranks
    one_then_two = _resumed(single, tmp_path / "one_then_two")
    _torchrun("run", "--cache", cache_url, "--out", str(one_then_two), "--resume", *ARGS)
    _assert_continues(single, one_then_two)


def test_fsdp_equals_one_process_and_resumes_across_world_sizes_and_strategies(tmp_path, cache_url, single):  # noqa: F811
    fsdp = tmp_path / "fsdp"
    _torchrun("run", "--cache", cache_url, "--out", str(fsdp), "--strategy", "fsdp", *ARGS)
    _close(_params(single, 3), _params(fsdp, 3))
    _close(_params(single, 6), _params(fsdp, 6))
    _same_train_metrics(single, fsdp)
    # clipping saw the global gradient norm (over both ranks' shards), and it clipped
    norms = [r["grad_norm"] for r in _metrics(single, "train")]
    assert [r["grad_norm"] for r in _metrics(fsdp, "train")] == pytest.approx(norms, rel=1e-4) and min(norms) > 0.003
    # held-out evaluation before and after training (every rank runs the sharded forward)
    evals = [_metrics(run, "eval") for run in (single, fsdp)]
    assert [r["step"] for r in evals[0]] == [r["step"] for r in evals[1]] == [0, 6]
    for key in ("loss", "tau"):
        assert [r[key] for r in evals[1]] == pytest.approx([r[key] for r in evals[0]], rel=1e-4)
    # the checkpoint holds the whole optimizer state in one process's layout
    ours, theirs = _trainer(fsdp, 3)["optimizer"], _trainer(single, 3)["optimizer"]
    assert ours["param_groups"] == theirs["param_groups"] and ours["state"].keys() == theirs["state"].keys()
    for index, state in theirs["state"].items():
        _close(ours["state"][index], state)
    # the export is the drafter's unsharded weights, as from one process
    exported = [safetensors.torch.load_file(str(run / "drafter" / "model.safetensors")) for run in (single, fsdp)]
    assert exported[0].keys() == exported[1].keys()
    for name in exported[0]:
        torch.testing.assert_close(exported[1][name].float(), exported[0][name].float(), rtol=1e-2, atol=1e-3)

    # an FSDP checkpoint resumed by one process
    fsdp_then_one = _resumed(fsdp, tmp_path / "fsdp_then_one")
    _one_process("run", "--cache", cache_url, "--out", str(fsdp_then_one), "--resume", *ARGS)
    _assert_continues(single, fsdp_then_one)

    # a one-process (the DDP layout) checkpoint resumed by two FSDP ranks, which shard it again
    one_then_fsdp = _resumed(single, tmp_path / "one_then_fsdp")
    _torchrun("run", "--cache", cache_url, "--out", str(one_then_fsdp), "--resume", "--strategy", "fsdp", *ARGS)
    _assert_continues(single, one_then_fsdp)


def test_two_ranks_resumed_on_one_train_a_micro_batch_per_partition(tmp_path, cache_url):  # noqa: F811
    """A two-rank run resumed under torchrun on one rank: that rank owns both partitions and trains
    each one's batch as its own micro-batch (no forward over --batch-tokens, where one merged batch
    was up to twice that), scaled so the step's gradient is the merged batch's: the same loader
    state and weights as the two-rank run, and its losses step for step."""
    two = tmp_path / "two"
    _torchrun("run", "--cache", cache_url, "--out", str(two), *ARGS)
    resumed = _resumed(two, tmp_path / "two_then_one")
    _torchrun("run", "--cache", cache_url, "--out", str(resumed), "--resume", *ARGS, ranks=1)
    after = _metrics(resumed, "train")[-3:]  # metrics.jsonl is the copied run's, continued
    assert [r["step"] for r in after] == [4, 5, 6]
    assert all(0 < r["micro_batch_tokens"] <= 100 for r in after), [r["micro_batch_tokens"] for r in after]
    assert max(r["micro_batch_tokens"] for r in _metrics(two, "train")) <= 100
    for a, b in zip(after, _metrics(two, "train")[3:]):
        assert a["positions"] == b["positions"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
    _assert_continues(two, resumed)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_accumulation_equals_one_process_and_bf16_reduction_trains(tmp_path, cache_url, strategy):  # noqa: F811
    """--grad-accum 2 on two ranks (gradients reduced once per step: no_sync, FSDP2's gradient
    sync off until the last micro-batch) ends where one process does; --grad-reduce-dtype bf16
    trains to nearly the same loss."""
    args = [*ARGS, "--grad-accum", "2"]
    single = tmp_path / "single"
    _one_process("run", "--cache", cache_url, "--out", str(single), "--data-partitions", "2", *args)
    two = tmp_path / "two"
    _torchrun("run", "--cache", cache_url, "--out", str(two), "--strategy", strategy, *args)
    _close(_params(single, 6), _params(two, 6))
    _same_train_metrics(single, two)
    half = tmp_path / "bf16"
    _torchrun("run", "--cache", cache_url, "--out", str(half), "--strategy", strategy, "--grad-reduce-dtype", "bf16", *args)
    assert json.loads((half / "config.json").read_text())["grad_reduce_dtype"] == "bf16"
    losses = [[r["loss"] for r in _metrics(run, "train")] for run in (single, half)]
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)


def test_fsdp_units_gather_in_time_and_leave_the_teacher_pieces_frozen(tmp_path, cache_url):  # noqa: F811
    """On a one-rank mesh in this process: sharded, the drafter computes the unsharded loss and
    gradients (its context path uses k/v projections outside any layer's forward)."""
    cfg = TrainConfig(cache=cache_url, out=str(tmp_path), model=ModelConfig(num_layers=2, block_size=4))
    plain, model = (build_drafter(cfg, open_cache(cache_url), torch.device("cpu")) for _ in range(2))
    c = plain.cfg
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, c.num_context_layers, c.hidden_size, generator=generator)
    ids = torch.randint(0, c.vocab_size, (2, 12), generator=generator)
    anchors = torch.tensor([[1, 6], [3, -1]])
    expected = plain(hidden, ids, anchors).pow(2).mean()
    expected.backward()

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        shard_drafter(model, init_device_mesh("cpu", (1,)))
        names = [name for name, _ in model.named_parameters()]
        assert names == [name for name, _ in plain.named_parameters()]
        assert all(isinstance(p, DTensor) for p in model.parameters())
        for name in ("embed_weight", "lm_head_weight"):
            buffer = getattr(model, name)
            assert not isinstance(buffer, DTensor) and not buffer.requires_grad
            assert torch.equal(buffer, getattr(plain, name))
        loss = model(hidden, ids, anchors).pow(2).mean()
        loss.backward()
        torch.testing.assert_close(loss, expected)
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)
    finally:
        dist.destroy_process_group()


def test_unknown_strategy_is_one_line(tmp_path):
    result = CliRunner().invoke(app, ["run", "--cache", str(tmp_path / "no-cache"), "--out", str(tmp_path / "run"),
                                      "--strategy", "zero3", "--quiet"])
    assert result.exit_code == 1
    assert result.output.strip() == "error: --strategy must be one of ddp, fsdp, got 'zero3'; use ddp, or fsdp for drafters too large to replicate on every rank"
