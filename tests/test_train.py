"""Stage 2 end to end: offline equals online, exact resume after SIGKILL, refusals, export."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers import qa_rows, write_jsonl
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from cli.train import app
from dflash_build import BuildConfig, build_cache
from dflash_cache import open_cache
from dflash_corpus import CorpusConfig
from dflash_teacher.teacher import TeacherConfig
from dflash_train.settings.data_config import DataConfig
from dflash_train.settings.loss_config import LossConfig
from dflash_train.settings.model_config import ModelConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.batch import Batch, load_batch
from dflash_train.training.batch_objective import batch_loss
from dflash_train.training.epoch_plan import EpochPlan
from dflash_train.training.session import build_drafter, lr_factor

ROOT = Path(__file__).resolve().parents[1]
LAYERS = (0, 2)



def test_lr_schedule_hand_values():
    assert lr_factor(0, 100, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(10, 100, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(55, 100, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(100, 100, 10, 0.1) == pytest.approx(0.1)


def test_offline_step_equals_online_teacher_step(cache_url, teacher_dir):
    """Loss and gradients from cached features equal those from running the teacher now."""
    cache = open_cache(cache_url)
    cfg = TrainConfig(cache=cache_url, out="unused", model=ModelConfig(num_layers=2, block_size=4),
                      data=DataConfig(batch_tokens=600, anchors="random", num_anchors=4, heldout_fraction=0.0,
                                      layout="padded"))
    refs = EpochPlan(cache, cfg.data).batches(0)[0]
    offline = load_batch(cache, cfg.data, refs, epoch=0).to("cpu")  # padded: the online batch is built per row

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir("qwen3"), dtype=torch.float32).eval()
    width, n = offline.input_ids.shape[1], len(refs)
    hidden = torch.zeros(n, width, len(LAYERS), offline.hidden.shape[-1])
    topk_ids = torch.zeros(n, width, 6, dtype=torch.long)
    topk_logprobs = torch.zeros(n, width, 6)
    for row in range(n):
        t = int(offline.lengths[row])
        with torch.no_grad():
            out = teacher(input_ids=offline.input_ids[row:row + 1, :t], output_hidden_states=True)
        hidden[row, :t] = torch.stack([out.hidden_states[i + 1][0] for i in LAYERS], dim=1)
        values, ids = torch.log_softmax(out.logits[0].float(), -1).topk(6, -1)
        topk_ids[row, :t], topk_logprobs[row, :t] = ids, values
    online = Batch(ids=offline.ids, hidden=hidden, input_ids=offline.input_ids, loss_mask=offline.loss_mask,
                   lengths=offline.lengths, topk_ids=topk_ids, topk_logprobs=topk_logprobs, anchors=offline.anchors)

    results = []
    for batch in (offline, online):
        model = build_drafter(cfg, cache, torch.device("cpu"))
        loss = batch_loss(model, batch, LossConfig())
        loss.loss.backward()
        results.append((loss.loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a > 0
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6)


TRAIN_ARGS = ["--steps", "24", "--num-layers", "1", "--block-size", "4", "--batch-tokens", "400",
              "--heldout-fraction", "0.05", "--save-every", "6", "--log-every", "2", "--eval-sequences", "0",
              "--noise", "cosine", "--noise-start", "0.3", "--quiet"]


def _params(run: Path, step: int) -> dict:
    return safetensors.torch.load_file(str(run / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


def test_exact_resume_after_sigkill(tmp_path, cache_url):
    straight = tmp_path / "straight"
    result = CliRunner().invoke(app, ["run", "--cache", cache_url, "--out", str(straight), *TRAIN_ARGS])
    assert result.exit_code == 0, result.output

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "cli.train", "run", "--cache", cache_url, "--out", str(killed), *TRAIN_ARGS],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = killed / "checkpoints" / "step-000012" / "COMPLETE"
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert marker.exists() and not (killed / "checkpoints" / "step-000024").exists(), "kill must land mid-run"

    resumed = CliRunner().invoke(app, ["run", "--cache", cache_url, "--out", str(killed), "--resume", *TRAIN_ARGS])
    assert resumed.exit_code == 0, resumed.output
    a, b = _params(straight, 24), _params(killed, 24)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bit-identical on CPU
    # the training curve after the resume point is the same too (same batches, noise, lr)
    def curve(run):
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r["loss"], r["lr"]) for r in lines if r["kind"] == "train" and r["step"] > 12}
    assert curve(straight) == curve(killed)
    exported = safetensors.torch.load_file(str(killed / "drafter" / "model.safetensors"))
    assert set(exported) == set(a) and "embed_tokens.weight" not in exported


def test_refusals_one_line(tmp_path, cache_url, tiny_cache):
    run_dir = tmp_path / "run"
    runner = CliRunner()
    args = ["run", "--cache", cache_url, "--out", str(run_dir), "--steps", "2", "--num-layers", "1", "--block-size", "4",
            "--eval-sequences", "0", "--heldout-fraction", "0.05", "--quiet"]
    assert runner.invoke(app, args).exit_code == 0
    again = runner.invoke(app, args)
    assert again.exit_code == 1 and "already holds checkpoints; pass --resume" in again.output
    changed = runner.invoke(app, args[:-1] + ["--resume", "--block-size", "8", "--quiet"])
    assert changed.exit_code == 1 and "model fields differ" in changed.output
    other = tiny_cache(rows=qa_rows(40, seed=9, prefix="t9-"))
    wrong = runner.invoke(app, ["run", "--cache", other, "--out", str(run_dir), "--resume", "--steps", "4", "--quiet"])
    assert wrong.exit_code == 1 and "different cache" in wrong.output and "Traceback" not in wrong.output
    bad = runner.invoke(app, args[:3] + ["--out", str(tmp_path / "r2"), "--block-size", "1"])
    assert bad.exit_code == 1 and "--block-size must be at least 2" in bad.output
    unknown = runner.invoke(app, args[:3] + ["--out", str(tmp_path / "r3"), "--set", "loss.nope=1"])
    assert unknown.exit_code == 1 and "unknown loss field" in unknown.output


def test_export_command_matches_run_export(tmp_path, cache_url):
    run_dir = tmp_path / "run"
    args = ["run", "--cache", cache_url, "--out", str(run_dir), "--steps", "3", "--num-layers", "1", "--block-size", "4",
            "--eval-sequences", "0", "--heldout-fraction", "0.05", "--quiet"]
    assert CliRunner().invoke(app, args).exit_code == 0
    out = CliRunner().invoke(app, ["export", str(run_dir / "checkpoints" / "step-000003"), str(tmp_path / "exp")])
    assert out.exit_code == 0, out.output
    a = safetensors.torch.load_file(str(tmp_path / "exp" / "model.safetensors"))
    b = safetensors.torch.load_file(str(run_dir / "drafter" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
    config = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["target_layer_ids"] == list(LAYERS)
    # the commands that serve the folder just written, with B - 1 speculative tokens for vLLM and B for SGLang
    exp = str(tmp_path / "exp")
    spec = json.dumps({"method": "dflash", "model": exp, "num_speculative_tokens": 3})
    assert f"vllm serve TEACHER --speculative-config '{spec}'" in out.output
    assert f"--speculative-algorithm DFLASH --speculative-draft-model-path {exp} --speculative-num-draft-tokens 4" in out.output


def test_run_refuses_an_old_cache_holding_the_last_layer(tmp_path, teacher_dir, monkeypatch):
    """Caches built before the last layer was refused still exist; training one would make an unservable drafter."""
    import dflash_teacher.tapped_layers as tapped_layers

    with monkeypatch.context() as old_build:  # an older build that accepted the last layer
        old_build.setattr(tapped_layers, "check_servable_layers", lambda *args, **kwargs: None)
        data = write_jsonl(tmp_path / "chat.jsonl", qa_rows(6, seed=2, prefix="old-"))
        build_cache(BuildConfig(out=str(tmp_path / "cache"), corpus=CorpusConfig(data=data),
                                teacher=TeacherConfig(name_or_path=teacher_dir("qwen3"), dtype="float32",
                                                      layers=(1, 3), top_k=4)))
    assert open_cache(str(tmp_path / "cache")).layer_ids == [1, 3]
    result = CliRunner().invoke(app, ["run", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "run"),
                                      "--steps", "1", "--quiet"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "holds layers 1,3: layer 3 is the teacher's last decoder layer" in lines[0]
    assert "rebuild it with --layers in 0..2" in lines[0]
    assert not (tmp_path / "run" / "drafter").exists()


class _Payload:
    """Unpickling this creates a file: what a hostile trainer.pt would do with os.system instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _three_step_run(tmp_path, cache_url) -> Path:
    run_dir = tmp_path / "run"
    args = ["run", "--cache", cache_url, "--out", str(run_dir), "--steps", "3", "--num-layers", "1", "--block-size", "4",
            "--eval-sequences", "0", "--heldout-fraction", "0.05", "--save-every", "3", "--quiet"]
    assert CliRunner().invoke(app, args).exit_code == 0
    return run_dir


def test_a_pickle_payload_in_trainer_pt_never_runs(tmp_path, cache_url):
    run_dir = _three_step_run(tmp_path, cache_url)
    step = run_dir / "checkpoints" / "step-000003"
    marker = tmp_path / "pwned"
    state = torch.load(step / "trainer.pt", weights_only=True)
    torch.save({**state, "extra": _Payload(marker)}, step / "trainer.pt")
    commands = {
        "export": ["export", str(step), str(tmp_path / "exp")],
        "eval": ["eval", "--checkpoint", str(step), "--cache", cache_url, "--heldout-fraction", "0.05", "--quiet",
                 "--out", str(tmp_path / "eval.json")],
        "resume": ["run", "--cache", cache_url, "--out", str(run_dir), "--resume", "--steps", "4", "--num-layers", "1",
                   "--block-size", "4", "--eval-sequences", "0", "--heldout-fraction", "0.05", "--quiet"],
    }
    for name, args in commands.items():
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1, (name, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "could run code" in lines[0] and "trainer.pt" in lines[0], (name, result.output)
        assert not marker.exists(), name


def test_a_checkpoint_saved_on_a_gpu_loads_and_exports_on_cpu(tmp_path, cache_url, monkeypatch):
    """trainer.pt written on CUDA carries cuda:0 location tags; a CPU node must still read it."""
    run_dir = _three_step_run(tmp_path, cache_url)
    step = run_dir / "checkpoints" / "step-000003"
    state = torch.load(step / "trainer.pt", weights_only=True)
    with monkeypatch.context() as gpu:
        gpu.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(state, step / "trainer.pt")
    with pytest.raises(RuntimeError, match="CUDA"):  # what a plain torch.load does on this machine
        torch.load(step / "trainer.pt", weights_only=True)
    out = CliRunner().invoke(app, ["export", str(step), str(tmp_path / "exp")])
    assert out.exit_code == 0, out.output
    resumed = CliRunner().invoke(app, ["run", "--cache", cache_url, "--out", str(run_dir), "--resume", "--steps", "4",
                                       "--num-layers", "1", "--block-size", "4", "--eval-sequences", "0",
                                       "--heldout-fraction", "0.05", "--save-every", "3", "--quiet"])
    assert resumed.exit_code == 0, resumed.output


@pytest.mark.parametrize("objective", [["--loss-terms", '{"ce": 0.1, "tv": 0.9}', "--weighting", "dpace"],
                                       pytest.param(["--loss", "onpolicy_kl", "--onpolicy-decay", "0.3", "--weighting",
                                                     "streak"], marks=pytest.mark.slow),
                                       pytest.param(["--loss", "lk_hybrid", "--lk-eta", "2", "--weighting", "decay"],
                                                    marks=pytest.mark.slow)])
def test_acceptance_objectives_train_log_their_terms_and_resume_exactly(tmp_path, cache_url, objective):
    import shutil

    straight = tmp_path / "straight"
    args = ["run", "--cache", cache_url, "--steps", "4", "--num-layers", "1", "--block-size", "4", "--batch-tokens", "400",
            "--heldout-fraction", "0.05", "--save-every", "2", "--log-every", "1",
            "--eval-sequences", "0", "--quiet", *objective]
    result = CliRunner().invoke(app, [*args, "--out", str(straight)])
    assert result.exit_code == 0, result.output
    records = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 4 and all(math.isfinite(r["loss"]) for r in train)
    if "--loss-terms" in objective:  # each term of a sum is logged on its own, and they make the loss
        for r in train:
            assert r["loss"] == pytest.approx(0.1 * r["loss_ce"] + 0.9 * r["loss_tv"], rel=1e-5)
    else:
        assert not any(k.startswith("loss_") for k in train[0])
    saved = json.loads((straight / "config.json").read_text())["loss"]
    assert saved["weighting"] == objective[objective.index("--weighting") + 1]
    # a run cut after step 2 resumes to the same weights, bit for bit
    cut = tmp_path / "cut"
    shutil.copytree(straight, cut)
    shutil.rmtree(cut / "checkpoints" / "step-000004")
    resumed = CliRunner().invoke(app, [*args, "--out", str(cut), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    a, b = _params(straight, 4), _params(cut, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the objective is part of what a resume must keep
    changed = CliRunner().invoke(app, [*args, "--out", str(cut), "--resume", "--steps", "6", "--dpace-smoothing", "0.9"])
    assert changed.exit_code == 1 and "loss.dpace_smoothing differs" in changed.output


def test_init_from_starts_a_new_run_from_a_runs_weights(tmp_path, cache_url):
    """--init-from: a second phase with its own loss and schedule starts from the first run's weights
    (an export or a checkpoint folder), its optimizer fresh; a drafter of another shape is refused."""
    runner = CliRunner()
    common = ["--num-layers", "1", "--block-size", "4", "--heldout-fraction", "0.05", "--eval-sequences", "4",
              "--save-every", "3", "--quiet"]
    first = tmp_path / "first"
    assert runner.invoke(app, ["run", "--cache", cache_url, "--out", str(first), "--steps", "3", "--lr", "3e-3",
                               *common]).exit_code == 0
    after = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    untrained, after = [r for r in after if r.get("kind") == "eval"]
    assert abs(untrained["tau"] - after["tau"]) > 0.01  # so an equal tau below is the first run's weights
    for source in (first / "drafter", first / "checkpoints" / "step-000003"):
        second = tmp_path / f"second-{source.name}"
        result = runner.invoke(app, ["run", "--cache", cache_url, "--out", str(second), "--steps", "2",
                                     "--init-from", str(source), "--loss", "onpolicy_kl", *common])
        assert result.exit_code == 0, result.output
        config = json.loads((second / "config.json").read_text())
        assert config["init_from"] == str(source) and config["loss"]["kind"] == "onpolicy_kl"
        before = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
        before = [r for r in before if r.get("kind") == "eval"][0]
        # the held-out evaluation before the second run's first step is the first run's after its last
        # (the checkpoint's fp32 weights exactly; the export holds them in bf16)
        exact = source.name.startswith("step-")
        assert before["step"] == 0 and before["tau"] == pytest.approx(after["tau"], abs=1e-9 if exact else 1e-3)
        # a fresh schedule: the second run warms up from its own step 0
        train_lines = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()
                       if json.loads(line).get("kind") == "train"]
        assert train_lines[-1]["step"] == 2
    wrong = runner.invoke(app, ["run", "--cache", cache_url, "--out", str(tmp_path / "wrong"), "--steps", "2",
                                "--init-from", str(first / "drafter"), "--num-layers", "2", "--block-size", "4",
                                "--eval-sequences", "0", "--quiet"])
    assert wrong.exit_code == 1 and len(wrong.output.strip().splitlines()) == 1, wrong.output
    assert "is not a drafter of this run's shape: it lacks layers.1." in wrong.output
    missing = runner.invoke(app, ["run", "--cache", cache_url, "--out", str(tmp_path / "missing"), "--steps", "2",
                                  "--init-from", str(tmp_path), "--eval-sequences", "0", "--quiet"])
    assert missing.exit_code == 1 and "is neither a checkpoint folder" in missing.output, missing.output
