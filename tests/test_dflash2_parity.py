"""Our DFlash2 convolution and candidate selector against the peers' own torch code, run in the vLLM
environment (marked `serving`: DFLASH_VLLM_PYTHON or .venv-vllm, vLLM 0.32 + speculators 0.9.0).

An export of ours (float32, every DFlash2 weight stirred well away from its start) is read back in
the peer's interpreter by its export names, and on the same inputs:

- vLLM (`vllm/model_executor/models/qwen3_dflash2.py`): its pure-torch `_grouped_conv` (what
  `DFlashGroupedConv.prepare` / `finish` call off CUDA), driven as `prepare` / `finish` drive it,
  gives our input- and output-side convolutions of both sublayers; its `_score_edges` (what
  `CandidateSelector.forward` returns) scores every (predecessor candidate, candidate) pair of a
  block, and the walk of its V2 speculator (`_selector_walk_kernel` at temperature 0: start at
  predecessor 0, the anchor; take the best candidate; it is the next step's predecessor) drafts the
  tokens our decoder's `_select` drafts, whose scores equal the edges along that path (tol 1e-4).
- speculators 0.9.0 (`speculators.models.dflash2`): its `GroupedDynamicCausalConv` and
  `CandidateSelector` with our weights loaded by name give our convolutions and our teacher-forced
  candidate scores (tol 1e-4).
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest
import torch
from test_speculative import LAYER_IDS, RUN_MASK, RUN_VOCAB, run_teacher

from dflash_train.measuring.drafting import _select
from dflash_train.settings.dflash2_config import DFlash2Config
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.spec_config import SpecConfig
from dflash_train.training.dflash2 import training_candidates, unary_scores
from dflash_train.training.export import export_drafter
from dflash_train.training.model import DFlashDrafter

pytestmark = pytest.mark.serving

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from safetensors.torch import load_file
    from vllm.model_executor.models.qwen3_dflash2 import _grouped_conv, _score_edges
    from speculators.models.dflash2.model_definitions import CandidateSelector, GroupedDynamicCausalConv

    folder, inputs, out = sys.argv[1:4]
    config = json.load(open(folder + "/config.json"))
    draft = config["dflash_config"]
    weights = load_file(folder + "/model.safetensors")
    data = torch.load(inputs)
    hidden_size, block = config["hidden_size"], draft["block_size"]
    taps, group = draft["conv_kernel_size"], draft["conv_group_size"]
    groups = hidden_size // group
    result = {}
    for side in ("attention_conv", "mlp_conv"):
        base = weights[f"layers.0.{side}.base_kernel"]
        projection = weights[f"layers.0.{side}.kernel_projection.weight"]
        x, y = data["x"], data["y"]
        # vLLM: DFlashGroupedConv.prepare / finish around its fallback _grouped_conv
        coefficients = (x @ projection.T).reshape(x.shape[0], 2, taps, groups)
        result[f"vllm_{side}_in"] = _grouped_conv(x, coefficients[:, 0], base[0], block, groups, group, taps)
        result[f"vllm_{side}_out"] = _grouped_conv(y, coefficients[:, 1], base[1], block, groups, group, taps)
        # speculators: the module itself with our weights by name
        conv = GroupedDynamicCausalConv(hidden_size, block_size=block, kernel_size=taps, group_size=group)
        conv.load_state_dict({"base_kernel": base, "kernel_projection.weight": projection})
        with torch.no_grad():
            prepared, kernel = conv.prepare(x.unsqueeze(0))
            result[f"speculators_{side}_in"] = prepared[0]
            result[f"speculators_{side}_out"] = conv.finish(y.unsqueeze(0), kernel)[0]

    states, candidates, unary, anchors = data["states"], data["candidates"], data["unary"], data["anchors"]
    top_k = draft["selector_top_k"]
    hidden = states @ weights["candidate_selector.hidden_projection.weight"].T
    edges = _score_edges(weights["candidate_selector.predecessor_codebook"],
                         weights["candidate_selector.successor_codebook"], candidates, unary, hidden, anchors, top_k)
    # the V2 speculator's walk at temperature 0 (_selector_walk_kernel): predecessor 0 first
    tokens, path = [], []
    for row in range(candidates.shape[0]):
        previous, row_tokens, row_path = 0, [], []
        for step in range(candidates.shape[1]):
            scores = edges[row, step, previous]
            index = int(scores.argmax())
            row_tokens.append(int(candidates[row, step, index]))
            row_path.append(scores)
            previous = index
        tokens.append(row_tokens)
        path.append(torch.stack(row_path))
    result["vllm_edges"], result["vllm_tokens"], result["vllm_path"] = edges, torch.tensor(tokens), torch.stack(path)

    selector = CandidateSelector(vocab_size=config["vocab_size"], hidden_size=hidden_size, rank=draft["selector_rank"],
                                 top_k=top_k)
    selector.load_state_dict({k[len("candidate_selector."):]: v for k, v in weights.items()
                              if k.startswith("candidate_selector.")})
    with torch.no_grad():
        result["speculators_scores"] = selector.score_candidates(data["logits"], states, data["prev"],
                                                                 data["training_candidates"])
    torch.save(result, out)
''')


def _drafter(teacher, block_size: int = 5) -> DFlashDrafter:
    cfg = DrafterConfig.from_teacher(teacher.config.to_dict(), LAYER_IDS, RUN_MASK, block_size=block_size,
                                     num_hidden_layers=1,
                                     dflash2=DFlash2Config(conv_kernel_size=3, conv_group_size=8, selector_rank=8,
                                                           selector_top_k=6))
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, teacher.get_input_embeddings().weight, teacher.get_output_embeddings().weight).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # trained-looking: the convolutions and the selector well away from their start
        for name, param in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                param.add_(torch.randn(param.shape, generator=gen))
    return drafter


def test_convolution_and_selector_equal_vllms_and_speculators(vllm_python, tmp_path):
    teacher = run_teacher("qwen3", 0.1)
    drafter = _drafter(teacher)
    export_drafter(drafter, tmp_path / "exp", dtype=torch.float32)
    settings, selector, block = drafter.cfg.dflash2, drafter.candidate_selector, drafter.cfg.block_size
    torch.manual_seed(1)
    rows, hidden_size = 3 * block, drafter.cfg.hidden_size
    x, y = torch.randn(rows, hidden_size), torch.randn(rows, hidden_size)

    requests, steps = 4, block - 1
    states = torch.randn(requests, steps, hidden_size)
    anchors = torch.randint(0, RUN_VOCAB - 1, (requests,))
    with torch.no_grad():
        logits = drafter.logits(states).float()
        top = logits.topk(settings.selector_top_k, dim=-1)
        unary = unary_scores(top.values, settings)
        ours = {}
        for side in ("attention_conv", "mlp_conv"):
            conv = getattr(drafter.layers[0], side)
            prepared, delta = conv.prepare(x.unsqueeze(0))
            ours[f"{side}_in"], ours[f"{side}_out"] = prepared[0], conv.finish(y.unsqueeze(0), delta)[0]
        drafts, paths = [], []
        for row in range(requests):
            tokens, _, _ = _select(drafter, states[row], int(anchors[row]), SpecConfig(), None, torch.device("cpu"))
            drafts.append(tokens)
            prev = torch.cat((anchors[row:row + 1], tokens[:-1]))
            paths.append(selector.scores(selector.context(states[row], prev), top.indices[row], unary[row]))
        # teacher-forced (training): predecessors are the true tokens, a missing target put last
        true_tokens = torch.randint(0, RUN_VOCAB - 1, (requests, steps))
        prev = torch.cat((anchors[:, None], true_tokens[:, :-1]), dim=1)
        candidates, _, _ = training_candidates(top.indices, true_tokens)
        forced = selector.scores(selector.context(states, prev), candidates, logits.gather(-1, candidates))
    torch.save({"x": x, "y": y, "states": states, "candidates": top.indices, "unary": unary, "anchors": anchors,
                "logits": logits, "prev": prev, "training_candidates": candidates}, tmp_path / "inputs.pt")
    (tmp_path / "peer.py").write_text(SCRIPT)
    run = subprocess.run([vllm_python, str(tmp_path / "peer.py"), str(tmp_path / "exp"), str(tmp_path / "inputs.pt"),
                          str(tmp_path / "peer.pt")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    peer = torch.load(tmp_path / "peer.pt")

    for side in ("attention_conv", "mlp_conv"):
        for end in ("in", "out"):
            for name in ("vllm", "speculators"):
                torch.testing.assert_close(ours[f"{side}_{end}"], peer[f"{name}_{side}_{end}"], atol=1e-4, rtol=1e-4)
    # the walk: the same drafts, scored the same along the path
    assert torch.equal(torch.stack(drafts), peer["vllm_tokens"])
    torch.testing.assert_close(torch.stack(paths), peer["vllm_path"], atol=1e-4, rtol=1e-4)
    # every edge: the scores of step j's candidates given each of step j-1's (the anchor at j = 1)
    for step in range(steps):
        for p in range(settings.selector_top_k):
            before = anchors if step == 0 else top.indices[:, step - 1, p]
            edge = selector.scores(selector.context(states[:, step], before), top.indices[:, step], unary[:, step])
            torch.testing.assert_close(edge.detach(), peer["vllm_edges"][:, step, p], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(forced, peer["speculators_scores"], atol=1e-4, rtol=1e-4)
