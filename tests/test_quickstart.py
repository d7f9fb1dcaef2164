"""The shipped example: its teacher and corpus, and a drafter that learns from them."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from helpers import write_jsonl

from dflash_build import BuildConfig, build_cache
from dflash_corpus import CorpusConfig
from dflash_teacher.teacher import TeacherConfig
from dflash_train.settings.data_config import DataConfig
from dflash_train.settings.model_config import ModelConfig
from dflash_train.settings.noise_config import NoiseConfig
from dflash_train.settings.optim_config import OptimConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.trainer import train

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def example_cache(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("quickstart")
    with open(EXAMPLES / "data" / "chat.jsonl") as f:
        rows = [json.loads(line) for line in itertools.islice(f, 500)]
    data = write_jsonl(root / "chat.jsonl", rows)
    build_cache(BuildConfig(out=str(root / "cache"), corpus=CorpusConfig(data=data),
                            teacher=TeacherConfig(name_or_path=str(EXAMPLES / "teacher"), dtype="float32",
                                                  num_tapped_layers=3, top_k=16)))
    return str(root / "cache")


def test_example_files_are_shipped():
    assert (EXAMPLES / "teacher" / "config.json").exists() and (EXAMPLES / "teacher" / "model.safetensors").exists()
    assert sum(1 for _ in open(EXAMPLES / "data" / "chat.jsonl")) >= 2000
    assert (EXAMPLES / "data" / "heldout_prompts.jsonl").exists()


@pytest.mark.slow  # ~5 minutes on 2 cores; `make test-all` runs it, `make demo` shows the same at full size
def test_trained_drafter_beats_untrained_on_heldout(tmp_path, example_cache):
    cfg = TrainConfig(cache=example_cache, out=str(tmp_path / "run"), steps=150, eval_sequences=60,
                      model=ModelConfig(num_layers=2, block_size=8), noise=NoiseConfig(schedule="off"),
                      data=DataConfig(batch_tokens=1200, anchors="random", num_anchors=8, heldout_fraction=0.1),
                      optim=OptimConfig(lr=2e-3), log_every=50, save_every=150)
    result = train(cfg)
    before, after = result.before["tau"], result.after["tau"]
    # an untrained drafter accepts next to nothing; a few CPU-seconds of training clearly help
    assert after > before + 0.3, (before, after)
    assert result.after["tau_greedy"] > result.before["tau_greedy"] + 0.3
