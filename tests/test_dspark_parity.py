"""Our exported drafters against speculators' DFlash and DSpark definitions, run in the vLLM environment.

Marked `serving`: it needs the environment of `make serving` (DFLASH_VLLM_PYTHON or .venv-vllm)
with speculators 0.9.0 installed into it (`pip install --no-deps speculators==0.9.0 ...`).

- The heads: the exported weights are loaded into speculators' MarkovHead and ConfidenceHead by
  their export names, fed the same backbone states and previous tokens in float32, and their
  Markov bias, biased logits and confidence must equal ours (tol 1e-4).
- The whole forward: an export (DFlash or DSpark) is loaded into speculators' DFlashDraftModel or
  DSparkDraftModel (config built from our config.json, weights by their export names, the
  verifier's embedding and LM head read by speculators from the teacher's folder) and its own
  training forward runs on the same context hidden states, token ids and anchors (a loss mask
  holding exactly the anchors, so its anchor sampling picks them all). Its forward returns only a
  loss, so the logits (Markov-biased for DSpark) and confidence logits it hands to its loss are
  taken there and must equal ours (tol 1e-4). The loss itself is not compared: speculators
  distils from the verifier's full logits, we from the cache's top-k.
- Sliding-window layers: speculators windows a whole block's context from its anchor (keys at
  `p >= a - window`, the block itself unwindowed), vLLM and we per query (`p > q - window`, as
  tests/test_serving.py checks against vLLM); vLLM's rule wins (docs/design.md). Where the window
  binds the outputs differ, and they equal speculators' once our mask uses its rule.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
import torch
from test_speculative import LAYER_IDS, RUN_MASK, RUN_VOCAB, run_teacher

import dflash_train.training.model
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.dspark_config import DSparkConfig
from dflash_train.training.export import export_drafter
from dflash_train.training.model import DFlashDrafter

pytestmark = pytest.mark.serving

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from safetensors.torch import load_file
    from speculators.models.dspark.model_definitions import ConfidenceHead, MarkovHead

    folder, inputs, out = sys.argv[1:4]
    config = json.load(open(folder + "/config.json"))
    weights = load_file(folder + "/model.safetensors")
    data = torch.load(inputs)
    markov = MarkovHead(verifier_vocab_size=config["vocab_size"], draft_vocab_size=config["vocab_size"],
                        markov_rank=config["markov_rank"], hidden_size=config["hidden_size"],
                        head_type=config["markov_head_type"])
    markov.load_state_dict({k[len("markov_head."):]: v for k, v in weights.items() if k.startswith("markov_head.")})
    dim = config["hidden_size"] + (config["markov_rank"] if config["confidence_head_with_markov"] else 0)
    confidence = ConfidenceHead(dim)
    confidence.load_state_dict({k[len("confidence_head."):]: v for k, v in weights.items()
                                if k.startswith("confidence_head.")})
    hidden, prev = data["hidden"], data["prev"]
    with torch.no_grad():
        prev_emb = markov.prev_embeddings(prev)
        bias = markov.block_bias(prev_token_ids=prev, hidden_states=hidden, prev_emb=prev_emb)
        features = torch.cat([hidden, prev_emb], dim=-1) if config["confidence_head_with_markov"] else hidden
        conf = confidence(features)
        logits = hidden @ data["lm_head"].T + bias
    torch.save({"bias": bias, "confidence": conf, "logits": logits}, out)
''')



@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_exported_dspark_heads_equal_speculators(head_type, vllm_python, tmp_path):
    teacher = run_teacher("qwen3", 0.1)
    cfg = DrafterConfig.from_teacher(teacher.config.to_dict(), LAYER_IDS, RUN_MASK, block_size=4, num_hidden_layers=1,
                                     dspark=DSparkConfig(markov_rank=8, markov_head_type=head_type))
    torch.manual_seed(0)
    lm_head = teacher.get_output_embeddings().weight.detach()
    drafter = DFlashDrafter(cfg, teacher.get_input_embeddings().weight, lm_head).eval()
    with torch.no_grad():  # a trained-looking head: weights well away from their small initial values
        for param in drafter.parameters():
            param.normal_(0, 0.3)
    export_drafter(drafter, tmp_path / "exp", dtype=torch.float32)

    hidden = torch.randn(3, cfg.num_draft_positions, cfg.hidden_size)
    prev = torch.randint(0, RUN_VOCAB, (3, cfg.num_draft_positions))
    torch.save({"hidden": hidden, "prev": prev, "lm_head": lm_head}, tmp_path / "inputs.pt")
    (tmp_path / "peer.py").write_text(SCRIPT)
    run = subprocess.run([vllm_python, str(tmp_path / "peer.py"), str(tmp_path / "exp"), str(tmp_path / "inputs.pt"),
                          str(tmp_path / "peer.pt")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    peer = torch.load(tmp_path / "peer.pt")

    with torch.no_grad():
        prev_embed = drafter.markov_head.embed(prev)
        features = drafter.markov_head.features(prev_embed, hidden)
        ours = {"bias": drafter.markov_head.bias(features), "logits": drafter.logits(hidden, features),
                "confidence": drafter.confidence_head(hidden, prev_embed)}
    for name, value in ours.items():
        torch.testing.assert_close(value, peer[name], atol=1e-4, rtol=1e-4, msg=name)
    assert json.loads((tmp_path / "exp" / "config.json").read_text())["architectures"] == ["DSparkDraftModel"]


FORWARD_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3Config
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    taken = {}

    def take_dflash(logits, *args, **kwargs):  # what the forward hands to its loss
        taken["logits"] = logits
        return torch.zeros(()), {}

    def take_dspark(logits, targets, confidence_logits, *args, **kwargs):
        taken.update(logits=logits, confidence=confidence_logits)
        return torch.zeros(()), {}

    dflash_core.compute_metrics, dspark_core.compute_metrics = take_dflash, take_dspark
    verifier, jobs = sys.argv[1], json.loads(sys.argv[2])
    for folder, inputs, out in jobs:
        taken.clear()
        config = json.load(open(folder + "/config.json"))
        layer = Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "dflash_config")})
        layer._attn_implementation = "sdpa"
        dspark = config["architectures"] == ["DSparkDraftModel"]
        block = config["block_size"]
        sample_from_anchor = config.get("sample_from_anchor", False)
        spec = dict(
            transformer_layer_config=layer, draft_vocab_size=config["vocab_size"], block_size=block,
            aux_hidden_state_layer_ids=config["dflash_config"]["target_layer_ids"],
            mask_token_id=config["dflash_config"]["mask_token_id"], sample_from_anchor=sample_from_anchor,
            speculators_config=SpeculatorsConfig(
                algorithm="dspark" if dspark else "dflash",
                proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block - 1 + sample_from_anchor)],
                default_proposal_method="greedy",
                verifier=VerifierConfig(name_or_path=verifier, architectures=["Qwen3ForCausalLM"])))
        if dspark:
            spec.update({k: config[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                                "confidence_head_with_markov")})
            model = DSparkDraftModel(DSparkSpeculatorConfig(**spec))
        else:
            model = DFlashDraftModel(DFlashSpeculatorConfig(**spec))
        keys = model.load_state_dict(load_file(folder + "/model.safetensors"), strict=False)
        # everything of ours loads by name; what is left is the verifier's, read from its folder next
        assert not keys.unexpected_keys, keys.unexpected_keys
        assert set(keys.missing_keys) <= {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                          "verifier_norm.weight"}, keys.missing_keys
        model.load_verifier_weights()
        model.eval()
        data = torch.load(inputs)
        hidden, ids, anchors = data["hidden"], data["ids"], data["anchors"]
        _, length, layers, width = hidden.shape
        loss_mask = torch.zeros(1, length, dtype=torch.long)
        loss_mask[0, anchors] = 1  # exactly the anchors: its sampler then takes them all
        with torch.no_grad():
            model(hidden.reshape(1, length, layers * width), ids, loss_mask, torch.zeros(1, length, width),
                  torch.zeros(1, length, dtype=torch.long), max_anchors=len(anchors))
        torch.save(dict(taken), out)
''')


def _random_drafter(teacher, **options) -> DFlashDrafter:
    cfg = DrafterConfig.from_teacher(teacher.config.to_dict(), LAYER_IDS, RUN_MASK, block_size=4, num_hidden_layers=2,
                                     **options)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, teacher.get_input_embeddings().weight, teacher.get_output_embeddings().weight).eval()
    with torch.no_grad():  # a trained-looking drafter: weights well away from their small initial values
        for param in drafter.parameters():
            param.normal_(0, 0.3)
    return drafter


def _ours(drafter: DFlashDrafter, data: dict) -> dict:
    """Our logits and confidence logits per block slot, laid out as speculators' forward lays them
    ([1, A * B, V] and [1, A * B]); slot 0 of a DFlash-layout block predicts nothing and is dropped."""
    with torch.no_grad():
        positions, features, confidence = drafter(data["hidden"], data["ids"], data["anchors"].unsqueeze(0), heads=True)
        return {"logits": drafter.logits(positions, features), "confidence": confidence}


def _peer(drafters: dict[str, DFlashDrafter], teacher, data: dict, vllm_python: str, tmp_path) -> dict[str, dict]:
    """speculators' forward outputs for each drafter's export, in one subprocess."""
    teacher.save_pretrained(tmp_path / "teacher")
    torch.save(data, tmp_path / "inputs.pt")
    jobs = []
    for name, drafter in drafters.items():
        export_drafter(drafter, tmp_path / name, dtype=torch.float32)
        jobs.append([str(tmp_path / name), str(tmp_path / "inputs.pt"), str(tmp_path / f"{name}.peer.pt")])
    (tmp_path / "forward.py").write_text(FORWARD_SCRIPT)
    run = subprocess.run([vllm_python, str(tmp_path / "forward.py"), str(tmp_path / "teacher"), json.dumps(jobs)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    peers = {}
    for name, drafter in drafters.items():
        peer = torch.load(tmp_path / f"{name}.peer.pt")
        first, blocks = drafter.cfg.first_slot_predicts, len(data["anchors"])
        slots = slice(1 - first, drafter.cfg.block_size)
        peers[name] = {"logits": peer["logits"].view(blocks, drafter.cfg.block_size, -1)[:, slots],
                       "confidence": (None if peer.get("confidence") is None else
                                      peer["confidence"].view(blocks, drafter.cfg.block_size)[:, slots])}
    return peers


def _inputs(length: int = 24) -> dict:
    torch.manual_seed(1)
    return {"hidden": torch.randn(1, length, len(LAYER_IDS), 64), "ids": torch.randint(0, RUN_VOCAB - 1, (1, length)),
            "anchors": torch.tensor([2, 5, 11, 17])}


def test_exported_drafters_forward_equals_speculators(vllm_python, tmp_path):
    """DFlash (full attention; sliding layers whose window never binds) and DSpark (every Markov
    head with the anchor slot predicting; vanilla and gated without): speculators' whole forward
    equals ours. The rnn head without sample_from_anchor is the next test."""
    teacher = run_teacher("qwen3", 0.1)
    drafters = {
        "dflash": _random_drafter(teacher),
        "dflash-sliding": _random_drafter(teacher, sliding_layers=(0,), sliding_window=64),
        **{f"dspark-{head}": _random_drafter(teacher, dspark=DSparkConfig(markov_rank=8, markov_head_type=head))
           for head in ("vanilla", "gated", "rnn")},
        **{f"dspark-{head}-no-anchor": _random_drafter(teacher, dspark=DSparkConfig(markov_rank=8, markov_head_type=head,
                                                                                   sample_from_anchor=False))
           for head in ("vanilla", "gated")},
        "dspark-no-markov": _random_drafter(teacher, dspark=DSparkConfig(markov_rank=0, confidence_head_with_markov=False)),
    }
    data = _inputs()
    peers = _peer(drafters, teacher, data, vllm_python, tmp_path)
    for name, drafter in drafters.items():
        ours = _ours(drafter, data)
        torch.testing.assert_close(ours["logits"], peers[name]["logits"], atol=1e-4, rtol=1e-4, msg=name)
        if drafter.cfg.dspark is None:
            assert ours["confidence"] is None and peers[name]["confidence"] is None
        else:
            torch.testing.assert_close(ours["confidence"], peers[name]["confidence"], atol=1e-4, rtol=1e-4, msg=name)


def _speculators_window_rule(query_anchor, q_idx, kv_idx, seq_len, block_size, sliding_window, causal=False):
    """speculators 0.9's sliding visibility (dflash/attention.py, causal in the block): context keys
    p with a - window <= p < a for every query of the block anchored at a; the block unwindowed."""
    in_context = kv_idx < seq_len
    block_offset = kv_idx - seq_len
    same_block = torch.div(block_offset, block_size, rounding_mode="floor") == torch.div(q_idx, block_size,
                                                                                          rounding_mode="floor")
    context = in_context & (kv_idx < query_anchor)
    block = ~in_context & same_block
    if sliding_window is not None:
        context = context & (kv_idx >= query_anchor - sliding_window)
        block = block & (block_offset % block_size <= q_idx % block_size)
    return context | block


def test_speculators_sliding_window_rule_is_not_vllms(vllm_python, tmp_path, monkeypatch):
    """With a window that binds (3 < the anchors), speculators' DFlash forward differs from ours, and
    equals ours once our mask takes its window rule: that rule is the whole difference."""
    teacher = run_teacher("qwen3", 0.1)
    drafter = _random_drafter(teacher, sliding_layers=(0, 1), sliding_window=3)
    data = _inputs()
    peer = _peer({"sliding": drafter}, teacher, data, vllm_python, tmp_path)["sliding"]["logits"]
    ours = _ours(drafter, data)["logits"]
    assert (ours - peer).abs().max() > 1e-2
    monkeypatch.setattr(dflash_train.training.model, "_visible", _speculators_window_rule)
    torch.testing.assert_close(_ours(drafter, data)["logits"], peer, atol=1e-4, rtol=1e-4)


def test_speculators_rnn_head_without_sample_from_anchor_steps_from_slot_0(vllm_python, tmp_path):
    """With sample_from_anchor off, speculators runs the rnn Markov state over every block slot,
    slot 0 (which predicts nothing) included, so position 1 sees one more step (the anchor, at
    slot 0's state) than ours, which starts at position 1 as our decoder does. vLLM 0.32 serves
    no rnn head, so no engine settles it; that one step is the whole difference."""
    teacher = run_teacher("qwen3", 0.1)
    drafter = _random_drafter(teacher, dspark=DSparkConfig(markov_rank=8, markov_head_type="rnn",
                                                           sample_from_anchor=False))
    data = _inputs()
    peer = _peer({"rnn": drafter}, teacher, data, vllm_python, tmp_path)["rnn"]
    ours = _ours(drafter, data)
    assert (ours["logits"] - peer["logits"]).abs().max() > 1e-2
    torch.testing.assert_close(ours["confidence"], peer["confidence"], atol=1e-4, rtol=1e-4)  # no rnn state in it
    markov, anchors, ids = drafter.markov_head, data["anchors"], data["ids"][0]
    with torch.no_grad():
        slots = drafter(data["hidden"], data["ids"], anchors.unsqueeze(0))[0]  # [A, B, H]
        _, state = markov.step(markov.embed(ids[anchors]), slots[:, 0], None)  # speculators' extra step
        logits = []
        for j in range(1, drafter.cfg.block_size):
            feature, state = markov.step(markov.embed(ids[anchors + j - 1]), slots[:, j], state)
            logits.append(drafter.logits(slots[:, j], feature))
    torch.testing.assert_close(torch.stack(logits, dim=1), peer["logits"], atol=1e-4, rtol=1e-4)
