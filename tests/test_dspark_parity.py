"""Our exported DSpark heads against speculators' DSpark definitions, run in the vLLM environment.

Marked `serving`: it needs the environment of `make serving` (DFLASH_VLLM_PYTHON or .venv-vllm)
with speculators 0.9.0 installed into it (`pip install --no-deps speculators==0.9.0 ...`). The
exported weights are loaded into speculators' MarkovHead and ConfidenceHead by their export
names, fed the same backbone states and previous tokens in float32, and their Markov bias,
biased logits and confidence must equal ours (tol 1e-4). The backbone itself is the DFlash
one, checked against vLLM by tests/test_serving.py.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
import torch
from test_speculative import LAYER_IDS, RUN_MASK, RUN_VOCAB, run_teacher

from dflash_train.dspark import DSparkConfig
from dflash_train.export import export_drafter
from dflash_train.model import DFlashDrafter, DrafterConfig

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
