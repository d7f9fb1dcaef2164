"""Our LiLiCorr export loaded by vLLM 0.32's own LiLiCorrForCausalLM and scored by its own
LiLiCorrHead, in the vLLM environment (marked `serving`: DFLASH_VLLM_PYTHON or .venv-vllm).

vLLM's engine cannot serve LiLiCorr on CPU: its V1 model runner (the only one without Triton)
refuses candidate-head drafts, and its LiLiCorr speculator is V2's. So the peer script builds
vLLM's model class itself, in a VllmConfig whose draft config names DFlashDraftModel (the
check V1 applies reads the architecture alone; the model reads every lilicorr_* key from
dflash_config), and:

- loads our export through `LiLiCorrForCausalLM.load_weights`, which refuses a checkpoint
  missing any correlator (or convolution) weight; every tensor of ours must land in vLLM's
  parameter of the same name unchanged;
- takes the candidates as its speculator does (`compute_candidates`: the top-k of the full
  log-softmax of the LM head) and the anchor as `prepare_context_anchor` does
  (`hidden_norm` of the combined tapped states of the last accepted position);
- scores the lattice with its `LiLiCorrHead.forward` and walks it as the V2 speculator's
  `_selector_walk_kernel` does at temperature 0 (predecessor 0 first, the chosen index the next
  predecessor).

Ours must give the same candidates, anchor, scores (tol 1e-4) and drafted tokens, with and without
DFlash2's convolutions in the backbone (vLLM's DFlash2 decoder layers then).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap

import pytest
import torch
from test_lilicorr import _drafter, _stir
from test_speculative import RUN_VOCAB, run_teacher

from dflash_train.measuring.drafting import _walk
from dflash_train.settings.spec_config import SpecConfig
from dflash_train.training.export import export_drafter

pytestmark = pytest.mark.serving

SCRIPT = textwrap.dedent('''
    import json, sys, tempfile
    import torch
    from safetensors.torch import load_file
    from vllm.config import ParallelConfig, ModelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    teacher, drafter, inputs, out = sys.argv[1:5]
    data = torch.load(inputs)
    target = ModelConfig(model=teacher, skip_tokenizer_init=True, dtype="float32")
    spec = SpeculativeConfig(model=drafter, method="dflash", num_speculative_tokens=data["steps"],
                             target_model_config=target, target_parallel_config=ParallelConfig())
    config = VllmConfig(model_config=target, speculative_config=spec)
    current = set_current_vllm_config(config)  # held: the context ends when it is collected
    current.__enter__()
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"file://{tempfile.mktemp()}", backend="gloo")
    initialize_model_parallel(1, 1)
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.lilicorr import LiLiCorrForCausalLM

    model = LiLiCorrForCausalLM(vllm_config=config)
    weights = load_file(drafter + "/model.safetensors")
    model.load_weights(iter(weights.items()))
    params = dict(model.named_parameters())
    # every tensor of ours in vLLM's parameter of the same name (the backbone's are stacked by vLLM)
    unchanged = {name: bool(torch.equal(params["model." + name], value)) for name, value in weights.items()
                 if name.startswith("lilicorr.") or "_conv." in name}
    model.lm_head.weight.data[:data["lm_head"].shape[0]].copy_(data["lm_head"])  # vLLM pads the vocabulary
    # as vLLM's model loader ends (on CPU it picks each layer's matmul here)
    process_weights_after_loading(model, target, torch.device("cpu"))
    with torch.no_grad():
        states = data["states"]
        ids, log_probs = model.compute_candidates(states.flatten(0, 1))
        k = ids.shape[-1]
        ids, log_probs = ids.view(*states.shape[:2], k), log_probs.view(*states.shape[:2], k)
        anchor = model.model.hidden_norm(model.combine_hidden_states(data["taps"]))
        scores = model.model.lilicorr(data["embed"][ids], log_probs, states, anchor,
                                      torch.ones(states.shape[0], dtype=torch.bool))
    tokens = []
    for row in range(states.shape[0]):
        previous, drafted = 0, []
        for step in range(states.shape[1]):
            index = int(scores[row, step, previous].argmax())
            drafted.append(int(ids[row, step, index]))
            previous = index
        tokens.append(drafted)
    torch.save({"unchanged": unchanged, "ids": ids, "log_probs": log_probs, "anchor": anchor, "scores": scores,
                "tokens": torch.tensor(tokens)}, out)
''')


@pytest.mark.parametrize("conv", [False, True], ids=["lilicorr", "lilicorr+conv"])
def test_vllm_loads_our_export_and_scores_and_walks_as_we_do(vllm_python, tmp_path, conv):
    teacher = run_teacher("qwen3", 0.1)
    teacher.save_pretrained(tmp_path / "teacher")
    drafter = _drafter(teacher, block_size=5, conv=conv)
    _stir(drafter)
    export_drafter(drafter, tmp_path / "exp", dtype=torch.float32)
    # the V1 runner's check reads the architecture alone (see the module docstring)
    shutil.copytree(tmp_path / "exp", tmp_path / "peer_exp")
    config = json.loads((tmp_path / "exp" / "config.json").read_text())
    (tmp_path / "peer_exp" / "config.json").write_text(json.dumps({**config, "architectures": ["DFlashDraftModel"]}))

    torch.manual_seed(1)
    requests, steps, hidden = 3, drafter.cfg.block_size - 1, drafter.cfg.hidden_size
    states = torch.randn(requests, steps, hidden)
    taps = torch.randn(requests, drafter.cfg.num_context_layers * hidden)
    with torch.no_grad():
        anchor = drafter.context_features(taps.view(1, requests, drafter.cfg.num_context_layers, hidden))[0]
        ids, scores = drafter.walk(states, anchor)
        drafts = [_walk(drafter, states[r], anchor[r], SpecConfig(), None, torch.device("cpu"))[0] for r in range(requests)]
    torch.save({"states": states, "taps": taps, "steps": steps, "lm_head": teacher.get_output_embeddings().weight.detach(),
                "embed": teacher.get_input_embeddings().weight.detach()}, tmp_path / "inputs.pt")
    (tmp_path / "peer.py").write_text(SCRIPT)
    run = subprocess.run([vllm_python, str(tmp_path / "peer.py"), str(tmp_path / "teacher"), str(tmp_path / "peer_exp"),
                          str(tmp_path / "inputs.pt"), str(tmp_path / "peer.pt")], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    peer = torch.load(tmp_path / "peer.pt")

    assert peer["unchanged"] and all(peer["unchanged"].values()), peer["unchanged"]
    assert any(name.startswith("lilicorr.layers.") for name in peer["unchanged"])
    assert any("_conv." in name for name in peer["unchanged"]) == conv
    assert torch.equal(peer["ids"], ids)
    torch.testing.assert_close(peer["anchor"], anchor, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(peer["scores"], scores, atol=1e-4, rtol=1e-4)
    assert torch.equal(peer["tokens"], torch.stack(drafts))
    assert peer["ids"].max() < RUN_VOCAB
