"""benchmarks/bench_peer.py (issue 54): the batches it hands speculators' trainer are our loader's, in
speculators' layout, and speculators' step trains on them and exports a drafter ours loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_peer  # noqa: E402
import peer_speculators  # noqa: E402

BLOCK = 4


def _values(cache_url: str, out: Path, steps: int = 3) -> dict:
    settings = bench_peer.PeerSettings(out=out, steps=steps, num_layers=1, block_size=BLOCK, batch_tokens=300)
    return bench_peer.base_config(cache_url, out / "run", 0, settings, {})


def _our_batches(values: dict, steps: int) -> list:
    from dflash_cache import open_cache
    from dflash_train.config import config_from_dict
    from dflash_train.training.data import LoaderState, train_loader
    from dflash_train.training.epoch_plan import EpochPlan

    cfg = config_from_dict(values)
    cache = open_cache(cfg.cache)
    loader = train_loader(cfg.cache, None, cfg.data, LoaderState(manifest_fingerprint=cache.fingerprint, partitions=1),
                          plan=EpochPlan(cache, cfg.data), draft_positions=BLOCK - 1)
    batches = iter(loader)
    return [next(batches) for _ in range(steps)]


def test_peer_batches_hold_our_blocks_tokens_targets_and_states(cache_url, tmp_path):
    values = _values(cache_url, tmp_path)
    folder = bench_peer.write_batches(values, tmp_path / "batches", 3)
    ours = _our_batches(values, 3)
    for step, batch in enumerate(ours):
        peer = torch.load(folder / f"step-{step:06d}.pt")
        anchors = iter(peer["anchors"].tolist())
        docs = peer["document_ids"][0]
        assert peer["anchor_valid"].all()
        for i in range(len(batch.ids)):
            length = int(batch.lengths[i])
            for a in batch.anchors[i][batch.anchors[i] >= 0].tolist():
                g = next(anchors)
                assert int(docs[g]) == i
                for j in range(BLOCK):  # a block's tokens, and the teacher's distribution each slot learns
                    if a + j < length:
                        assert int(peer["input_ids"][0, g + j]) == int(batch.sequence("input_ids", i)[a + j])
                        assert bool(peer["loss_mask"][0, g + j]) == bool(batch.sequence("loss_mask", i)[a + j])
                        assert torch.equal(peer["topk_ids"][0, g + j - 1], batch.sequence("topk_ids", i)[a + j - 1])
                        assert torch.equal(peer["hidden"][0, g + j], batch.sequence("hidden", i)[a + j].float().flatten())
                    else:  # past the sequence: padding, never another sequence's labels
                        assert int(docs[g + j]) == -1 and int(peer["loss_mask"][0, g + j]) == 0
        assert next(anchors, None) is None
        assert int(peer["position_ids"][0, 0]) == 0 and peer["hidden"].shape[-1] == batch.hidden.shape[2] * batch.hidden.shape[3]


def test_dense_targets_put_the_top_k_in_place_and_the_rest_far_below():
    ids, logprobs = torch.tensor([[[2, 0]]]), torch.tensor([[[-0.1, -2.5]]])
    dense = peer_speculators.dense_targets(ids, logprobs, 4)
    far = peer_speculators.NOT_A_TARGET
    assert torch.equal(dense, torch.tensor([[[-2.5, far, -0.1, far]]]))
    assert int(dense.argmax(-1)) == 2  # speculators' ce takes the teacher's top-1
    assert torch.softmax(dense, -1)[0, 0, [1, 3]].max() < 1e-30  # and its kl sees no mass outside the top-k


@pytest.mark.serving
def test_speculators_step_trains_our_batches_and_exports_what_we_load(cache_url, teacher_dir, vllm_python, tmp_path):
    from dflash_train.training.session import drafter_weights

    values = _values(cache_url, tmp_path)
    batches = bench_peer.write_batches(values, tmp_path / "batches", 3)
    init = bench_peer.initial_export(values, tmp_path / "init", causal=True)
    out = tmp_path / "trained"
    done = subprocess.run([vllm_python, str(ROOT / "benchmarks" / "peer_speculators.py"), str(init), teacher_dir("qwen3"),
                           str(batches), "3", str(out)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = json.loads((out / "peer_losses.json").read_text())["losses"]
    assert len(losses) == 3 and all(0 < loss < 50 for loss in losses)
    cfg, weights = drafter_weights(out)
    assert cfg.causal and cfg.block_size == BLOCK
    start = load_file(init / "model.safetensors")
    assert set(weights) == set(start)
    assert any(not torch.equal(weights[k].float(), start[k].float()) for k in start)  # its step moved them
