"""The CUDA paths' logic that a CPU can show: device choice per rank, the process group's device,
fp32 log-probs from a bf16 teacher, the drafter built on the meta device, the attention kernel."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from helpers import build_teacher, peak_rss_kib
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_common.devices import select_device
from dflash_common.errors import ConfigError
from dflash_teacher.teacher import TeacherConfig, fp32_logits, load_teacher
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.training.distributed import process_group_options
from dflash_train.training.model import DFlashDrafter, attention_backend


def make_cfg() -> DrafterConfig:
    return DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=64, vocab_size=96, mask_token_id=95, target_layer_ids=(1, 3),
                         num_target_layers=5, num_hidden_layers=2, block_size=4, max_position_embeddings=256)


def make_model(cfg: DrafterConfig, backend: str = "sdpa") -> DFlashDrafter:
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.1
    torch.manual_seed(0)
    return DFlashDrafter.build(cfg, embed, head, "cpu", backend).eval()


def make_batch(cfg: DrafterConfig, lengths=(20, 13, 9)) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(len(lengths), max(lengths), cfg.num_context_layers, cfg.hidden_size, generator=gen)
    ids = torch.randint(0, cfg.vocab_size - 1, (len(lengths), max(lengths)), generator=gen)
    return hidden, ids


def test_cuda_and_auto_take_the_local_rank_gpu_and_cuda_n_is_kept():
    assert select_device("cuda", cuda_count=8, rank_on_node=3) == torch.device("cuda", 3)
    assert select_device("auto", cuda_count=8, rank_on_node=5) == torch.device("cuda", 5)
    assert select_device("auto", cuda_count=2, rank_on_node=None) == torch.device("cuda", 0)
    assert select_device("cuda:6", cuda_count=8, rank_on_node=3) == torch.device("cuda", 6)
    assert select_device("auto", cuda_count=0, rank_on_node=3) == torch.device("cpu")
    assert select_device("cpu", cuda_count=8, rank_on_node=3) == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK 4.*2 GPU\(s\)"):
        select_device("cuda", cuda_count=2, rank_on_node=4)
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        select_device("cuda", cuda_count=0, rank_on_node=None)
    with pytest.raises(ConfigError, match="not supported"):
        select_device("tpu", cuda_count=0, rank_on_node=None)


def test_the_ranks_gpus_follow_the_launchers_list_and_one_gpu_per_rank_is_gpu_0():
    from dflash_common.devices import rank_gpus

    # CUDA_VISIBLE_DEVICES node-wide (SLURM gres): the rank's slice of what the process sees
    assert rank_gpus(1, 1, "0,1", 2) == [1]
    assert rank_gpus(2, 1, "4,5,6,7", 4) == [2, 3]
    assert rank_gpus(2, 0, None, 8) == [0, 1] and rank_gpus(1, None, None, 8) == [0]
    # a launcher that gives each rank its own GPU(s): they are GPU 0.. of every rank
    assert rank_gpus(1, 3, "3", 1) == [0]
    assert rank_gpus(2, 3, "GPU-a,GPU-b", 2) == [0, 1]
    assert select_device("cuda", cuda_count=1, rank_on_node=3, visible="3") == torch.device("cuda", 0)
    assert select_device("auto", cuda_count=1, rank_on_node=1, visible="GPU-77b0") == torch.device("cuda", 0)
    # tensor parallel engines: the head goes to the rank's first GPU, not cuda:LOCAL_RANK
    assert select_device("auto", cuda_count=8, rank_on_node=1, per_rank=2) == torch.device("cuda", 2)
    assert select_device("cuda", cuda_count=8, rank_on_node=3, visible="0,1,2,3,4,5,6,7", per_rank=4 // 2) == torch.device("cuda", 6)
    assert select_device("cuda:1", cuda_count=2, rank_on_node=3, visible="6,7", per_rank=2) == torch.device("cuda", 1)
    # too few: one line naming the rank, what it needs and what it sees
    with pytest.raises(ConfigError, match=r"LOCAL_RANK 2 needs GPU 2 but CUDA_VISIBLE_DEVICES=0,1 has 2 GPU\(s\); start at most 2"):
        select_device("cuda", cuda_count=2, rank_on_node=2, visible="0,1")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK 1 needs GPUs 2..3 \(2 a rank\) but this machine has 3"):
        select_device("auto", cuda_count=3, rank_on_node=1, per_rank=2)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK 1 needs GPU 1 but this machine has 1"):
        select_device("cuda", cuda_count=1, rank_on_node=1)  # no list: not a launcher's per-rank GPU


def test_the_process_group_is_bound_to_the_ranks_gpu():
    assert process_group_options(torch.device("cuda", 3)) == {"backend": "nccl", "device_id": torch.device("cuda", 3)}
    assert process_group_options(torch.device("cpu")) == {"backend": "gloo"}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_one_torchrun_rank_is_a_process_group_and_wrapped_with_wrap_single_rank(monkeypatch):
    """Issue 42: the GPU check's ddp part ran one rank, which trains unwrapped, so it tested no
    process group, DDP or FSDP2. --wrap-single-rank makes one torchrun process a group of one and
    wraps its drafter: DDP's bf16 hook rounds its gradients (they come back bf16 values), FSDP2
    shards it and the state-dict gather returns the whole drafter."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dflash_train.training.checkpoint import full_model_state
    from dflash_train.training.distributed import data_parallel, init_distributed, is_sharded, shutdown

    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(name, value)
    cfg = make_cfg()
    hidden, ids = make_batch(cfg)
    anchors = torch.tensor([[2, 9], [3, 6], [1, 4]])
    cpu = torch.device("cpu")
    plain = make_model(cfg).train()
    info = init_distributed(cpu)  # the default: one process trains unwrapped
    assert not info.active and not dist.is_initialized() and data_parallel(plain, info, "ddp", cpu) is plain

    info = init_distributed(cpu, wrap_single_rank=True)
    try:
        assert info.active and info.world_size == 1 and dist.is_initialized()
        ddp = data_parallel(make_model(cfg).train(), info, "ddp", cpu, "bf16")
        assert isinstance(ddp, DistributedDataParallel)
        ddp(hidden, ids, anchors).float().pow(2).mean().backward()
        grads = [p.grad for p in ddp.module.parameters() if p.grad is not None]
        assert grads and all(torch.equal(g, g.to(torch.bfloat16).float()) for g in grads)  # through the bf16 hook
        sharded = make_model(cfg).train()
        expected = {k: v.clone() for k, v in sharded.state_dict().items()}
        assert data_parallel(sharded, info, "fsdp", cpu, "bf16") is sharded and is_sharded(sharded)
        sharded(hidden, ids, anchors).float().pow(2).mean().backward()
        gathered = full_model_state(sharded)
        assert set(expected) <= set(gathered)
        for name, value in expected.items():
            torch.testing.assert_close(gathered[name], value, msg=name)
        del ddp
    finally:
        shutdown(info)
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(ConfigError, match=r"--wrap-single-rank needs torchrun"):
        init_distributed(cpu, wrap_single_rank=True)


@pytest.fixture(scope="module")
def loud_bf16_teacher(tmp_path_factory, tokenizer_dir):
    """A bf16 teacher whose logits reach |16-32|, where bf16 logits are 0.125 apart."""
    path = tmp_path_factory.mktemp("loud_teacher")
    build_teacher(path, "qwen3", AutoTokenizer.from_pretrained(tokenizer_dir), dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    model.save_pretrained(path)
    return str(path)


def test_stored_logprobs_of_a_bf16_teacher_match_an_fp32_head_within_1e3(loud_bf16_teacher):
    teacher = load_teacher(TeacherConfig(name_or_path=loud_bf16_teacher, dtype="bfloat16", device="cpu",
                                         layers=(0, 1), top_k=16, logits_chunk=5))
    ids = torch.tensor([teacher.tokenizer("The cat sees the answer, and the dog reads it twice.")["input_ids"]])
    with torch.no_grad():
        last = teacher.model.model(input_ids=ids).last_hidden_state[0]
    weight = teacher.model.lm_head.weight
    reference = torch.log_softmax(last.float() @ weight.float().T, dim=-1)
    assert reference.abs().max() > 16  # the regime where bf16 logits lose the signal
    topk_ids, topk_logprobs = teacher._topk(last)
    torch.testing.assert_close(topk_logprobs, reference.gather(1, topk_ids), atol=1e-3, rtol=0)
    # what the stored values were before: bf16 logits, then float
    rounded = torch.log_softmax((last @ weight.T).float(), dim=-1)
    assert (rounded.gather(1, topk_ids) - reference.gather(1, topk_ids)).abs().max() > 1e-3


def test_fp32_logits_slices_the_vocabulary_without_changing_the_result():
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(7, 32, generator=gen).bfloat16()
    weight = torch.randn(1000, 32, generator=gen).bfloat16()
    bias = torch.randn(1000, generator=gen)
    exact = states.float() @ weight.float().T + bias
    torch.testing.assert_close(fp32_logits(states, weight, bias, vocab_chunk=96), exact, atol=1e-5, rtol=1e-6)
    assert fp32_logits(states, weight).dtype == torch.float32


def test_a_production_width_drafter_builds_on_the_meta_device_without_host_memory():
    """5 layers at hidden 5120, 24/4 heads of 256, MLP 17408, vocab 248,320: 1.8B parameters and
    a 10 GB fp32 head, ~22 GB if built on the host. Measured in a fresh process."""
    script = textwrap.dedent("""
        import resource, torch
        from dflash_train.training.model import DFlashDrafter, DrafterConfig
        before = peak_rss_kib()
        cfg = DrafterConfig(hidden_size=5120, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                            intermediate_size=17408, vocab_size=248320, mask_token_id=248077,
                            target_layer_ids=(1, 16, 31, 46, 61), num_target_layers=64, num_hidden_layers=5)
        head = torch.empty(248320, 5120, device="meta")
        model = DFlashDrafter.build(cfg, head, head, "meta")
        params = sum(p.numel() for p in model.parameters())
        peak = peak_rss_kib()
        print(params, (peak - before) / 1024)
    """)
    script = inspect.getsource(peak_rss_kib) + script
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    params, grown_mib = int(out[0]), float(out[1])
    assert params > 1.7e9
    assert grown_mib < 200, f"building on meta grew host memory by {grown_mib:.0f} MiB"


def test_build_on_a_device_is_seeded_and_loads_a_state_exactly():
    cfg = make_cfg()
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen).bfloat16()
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
    torch.manual_seed(3)
    first = DFlashDrafter.build(cfg, embed, head, "cpu")
    torch.manual_seed(3)
    second = DFlashDrafter.build(cfg, embed, head, "cpu")
    torch.manual_seed(4)
    other = DFlashDrafter.build(cfg, embed, head, "cpu")
    for name, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[name]), name
    assert not torch.equal(first.fc.weight, other.fc.weight)
    assert first.embed_weight.dtype == torch.bfloat16 and first.lm_head_weight.dtype == torch.float32
    loaded = DFlashDrafter.build(cfg, embed, head, "cpu", state=first.state_dict())
    hidden, ids = make_batch(cfg)
    anchors = torch.tensor([[0, 5], [3, -1], [1, 2]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(hidden, ids, anchors), first(hidden, ids, anchors), atol=0, rtol=0)


def test_attention_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert attention_backend("auto", cpu) == "sdpa" and attention_backend("auto", cuda) == "flex"
    assert attention_backend("sdpa", cuda) == "sdpa" and attention_backend("flex", cuda) == "flex"
    assert attention_backend("flex", cpu, training=False) == "flex"
    with pytest.raises(ConfigError, match="flex cannot train on cpu.*use sdpa or auto"):
        attention_backend("flex", cpu)
    with pytest.raises(ConfigError, match="unknown"):
        attention_backend("xformers", cpu)


def test_flex_under_bf16_autocast_gets_one_dtype_and_equals_sdpa(monkeypatch):
    """Under autocast the q/k norms return fp32 and v is bf16; compiled flex_attention on CUDA
    refuses that mix (eager CPU flex accepts it, so the dtypes it is handed are checked)."""
    import dflash_train.training.model as model_module

    seen, flex_attend = [], model_module._flex_attend

    def recording(*args, **kwargs):
        attend = flex_attend(*args, **kwargs)

        def checked(q, k, v):
            seen.append((q.dtype, k.dtype, v.dtype))
            return attend(q, k, v)
        return checked

    monkeypatch.setattr(model_module, "_flex_attend", recording)
    cfg = make_cfg()
    sdpa, flex = make_model(cfg), make_model(cfg, backend="flex")
    hidden, ids = make_batch(cfg)
    anchors = torch.tensor([[0, 5], [3, -1], [1, 2]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention on CPU warns that it is unfused
        got, want = flex(hidden, ids, anchors), sdpa(hidden, ids, anchors)
    assert seen and all(dtypes == (torch.bfloat16,) * 3 for dtypes in seen), seen
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
