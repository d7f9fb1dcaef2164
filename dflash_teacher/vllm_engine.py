"""The teacher forward of `dflash-cache build --engine vllm`: vLLM's engine, in its own environment.

Everything but the forward stays the build's: the tokenizer, the ids and masks, the teacher's
identity and frozen files, exactly as with the transformers engine. The build process never holds
the whole teacher: it reads the config, the tokenizer and, by name from the safetensors files, the
final norm and LM head (and once the input embedding) (teacher.load_text_head). vLLM runs the
teacher (vllm_extract/extract_worker.py, started with the python of vLLM's environment by
vllm_process.VllmWorker) and captures, with its `extract_hidden_states` method, the tapped layers
plus the last decoder layer's output; our connector sends each finished sequence's states to a
socket of this process (state_receiver.StateReceiver). The final norm and the LM head then run
here in fp32 by the same code as the transformers engine (Teacher._topk), on the --device given
(the GPU vLLM uses, on GPU nodes), so the top-k log-probs are those of an fp32 head, not of
vLLM's sampler.

vLLM's aux hidden-state id L is the *input* of decoder layer L (transformers' hidden_states[L]),
so tap L (the output of layer L) is aux id L + 1 and the last layer's output is aux id
num_hidden_layers.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash_common.devices import child_visible_devices, resolve_device
from dflash_common.errors import ConfigError, TeacherError
from dflash_common.vllm_env import cpu_kv_cache_gib, find_vllm_python, vllm_environment
from dflash_teacher.engine_memory import (
    build_working_bytes,
    engine_gpu_share,
    engine_weight_bytes,
    tokens_per_generate,
)
from dflash_teacher.settings.teacher_config import TeacherConfig
from dflash_teacher.settings.vllm_args import VllmArgs
from dflash_teacher.state_receiver import STALL_TIMEOUT_S, StateReceiver
from dflash_teacher.tapped_layers import resolve_layers
from dflash_teacher.teacher import Teacher, TeacherOutput, TextHead, load_text_head, load_tokenizer
from dflash_teacher.vllm_extract.dflash_frames import SECRET_ENV
from dflash_teacher.vllm_process import VllmWorker

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def aux_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """vLLM's aux ids for our taps, then the last layer's output (the final norm's input)."""
    return [i + 1 for i in layer_ids] + [num_layers]


def worker_gpus(env: dict[str, str], args: VllmArgs, cuda_count: int | None = None) -> str | None:
    """CUDA_VISIBLE_DEVICES for the engine of a torchrun rank: one engine per rank, on the rank's
    tensor_parallel_size GPUs (LOCAL_RANK * tp onwards: one GPU per rank by default, the whole node
    for one rank per node), named through the launcher's own CUDA_VISIBLE_DEVICES when it set one
    (SLURM's gres sets it node-wide); None outside torchrun. dflash_common.devices owns the rule,
    which also places the build's LM head on the engine's first GPU."""
    local = env.get("LOCAL_RANK")
    rank = None if local in (None, "") else int(local)
    return child_visible_devices(args.tensor_parallel_size, rank, env.get("CUDA_VISIBLE_DEVICES"), cuda_count)


@dataclass
class VllmTeacher(Teacher):
    """A Teacher whose forward runs in vLLM (one engine for the whole build); see the module doc."""

    worker: VllmWorker | None = None
    receiver: StateReceiver | None = None
    norm: torch.nn.Module | None = None
    log_path: Path | None = None
    engine_seconds: float = 0.0
    """Seconds inside vLLM's generate so far (the benchmark's engine-only time)."""
    engine_waited_seconds: float = 0.0
    """Seconds the engine waited for its next batch after the first (idle between shards)."""
    seconds: dict = field(default_factory=dict)
    """Seconds of the build's parts here: waiting for the engine's reply (wait), taking the states
    after it (receive), the final norm and fp32 head (head); with the engine's own (engine)."""

    pads_batches = False  # vLLM packs sequences; nothing is padded
    holds_whole_model = False  # model is a TextHead: vLLM holds the rest
    shards_in_flight = 2  # the engine runs the next shard while the build receives and writes one

    def batches(self, lengths: np.ndarray) -> list[np.ndarray]:
        # a whole shard per generate call: vLLM's scheduler batches better than any plan here
        return [np.arange(len(lengths))]

    def submit(self, sequences: list[np.ndarray]):
        # the engine may send these states as soon as it has them, before the build asks for them
        self.receiver.expect([len(s) for s in sequences])
        self.worker.send(sequences)
        return lambda: self._receive(sequences)

    def forward(self, sequences: list[np.ndarray]) -> TeacherOutput:
        return self.submit(sequences)()

    @torch.inference_mode()
    def _receive(self, sequences: list[np.ndarray]) -> TeacherOutput:
        started = time.perf_counter()
        reply = self.worker.receive()
        replied = time.perf_counter()
        self.engine_seconds += float(reply["seconds"])
        self.engine_waited_seconds += float(reply.get("waited", 0.0))
        ids = reply["requests"]
        if any(i is None for i in ids):
            raise TeacherError("vLLM returned a sequence without its hidden states (the connector did not run); "
                               f"its log is {self.log_path}")
        states = self.receiver.take(ids, self.worker.alive)
        if len(states) != len(ids):
            raise self.worker.failure() if not self.worker.alive() else TeacherError(
                f"vLLM sent no hidden states for {STALL_TIMEOUT_S:.0f} s; its log is {self.log_path}")
        lengths = torch.tensor([len(s) for s in sequences])
        for seq, got in zip(sequences, states):
            if got.shape[0] != len(seq) or got.shape[1] != len(self.layer_ids) + 1:
                raise TeacherError(f"vLLM sent states of shape {got.shape} for a sequence of {len(seq)} tokens and "
                                   f"{len(self.layer_ids) + 1} captured layers; its log is {self.log_path}")
        dtype = _TORCH[self.cfg.dtype]
        flat = torch.from_numpy(np.concatenate(states))
        flat = flat.view(dtype) if flat.dtype == torch.int16 else flat.to(dtype)  # [N, L + 1, H]
        head_device = self.model.get_output_embeddings().weight.device
        received = time.perf_counter()
        last = self.norm(flat[:, -1].to(head_device))
        out = self.pack(flat[:, :-1], *self._topk(last), lengths)
        for part, seconds in (("wait", replied - started), ("receive", received - replied),
                              ("head", time.perf_counter() - received), ("engine", float(reply["seconds"]))):
            self.seconds[part] = self.seconds.get(part, 0.0) + seconds
        return out

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            if self.worker.proc.returncode == 0 and self.log_path is not None:
                self.log_path.unlink(missing_ok=True)  # kept when the engine failed: it says why
        if self.receiver is not None:
            self.receiver.close()


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                      "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
"""What torchrun tells a build rank. vLLM reads RANK, WORLD_SIZE and MASTER_* as its own
distributed setup: a build rank's engine must start as a world of one."""

VLLM_VERSIONS = ("0.32.0", "0.33.0")
"""vLLM versions [from, to) the connector (vllm_extract/dflash_hs_connector.py) was written and
tested against: it subclasses ExampleHiddenStatesConnector and reads private members of it."""


def worker_environment(args: VllmArgs) -> dict[str, str]:
    """The environment of a build's vLLM process: vLLM's own (dflash_common.vllm_env), the rank's
    GPU under torchrun (worker_gpus), and none of torchrun's variables."""
    env = vllm_environment(cpu_kv_cache_gib())
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # CPU builds: the build's threads share the cores
    gpus = worker_gpus(env, args, torch.cuda.device_count() if torch.cuda.is_available() else None)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    for name in TORCHRUN_VARIABLES:
        env.pop(name, None)
    return env


def version_note(version: str | None) -> str | None:
    """One line when the engine's vLLM is outside VLLM_VERSIONS (None inside)."""
    def key(text: str) -> tuple:
        import re

        return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])

    low, high = VLLM_VERSIONS
    if version and key(low) <= key(version) < key(high):
        return None
    return (f"vLLM {version} is outside the versions the hidden-state connector was written for ({low} <= v < {high}; "
            f"it uses private members of vLLM's ExampleHiddenStatesConnector): install vllm=={low} if the build fails "
            "or its states look wrong")


def engine_setup(cfg: TeacherConfig, args: VllmArgs, max_length: int, text_config, gpu_share: float | None = None) -> dict:
    """The engine part of extract_worker.py's setup frame: the teacher's folder, dtype and LLM(...) options
    (what the benchmark's bare prefill runs with too); `gpu_share`, when given, is vLLM's
    gpu_memory_utilization (engine_share)."""
    folder = Path(cfg.name_or_path).expanduser()
    return {"model": str(folder.resolve()) if folder.exists() else cfg.name_or_path, "dtype": cfg.dtype,
            "engine_args": {**args.engine_args(max_length, getattr(text_config, "max_position_embeddings", None)),
                            **({"gpu_memory_utilization": gpu_share} if gpu_share is not None else {}),
                            **({"revision": cfg.revision} if cfg.revision else {}),
                            "trust_remote_code": cfg.trust_remote_code}}


def engine_share(cfg: TeacherConfig, args: VllmArgs, head: TextHead, device: torch.device, tokens: int) -> float | None:
    """vLLM's gpu_memory_utilization when the engine's first GPU is `device` and holds `head`:
    what leaves the head and the build's working set over generates of `tokens` tokens outside
    vLLM (dflash_teacher.engine_memory); off CUDA the given one (vLLM's CPU backend sizes its KV
    cache from VLLM_CPU_KVCACHE_SPACE instead)."""
    if device.type != "cuda":
        return args.gpu_memory_utilization
    weight = head.lm_head.weight
    vocab, hidden = weight.shape
    working = build_working_bytes(tokens, hidden, vocab, cfg.logits_chunk, cfg.top_k, weight.element_size())
    weights = engine_weight_bytes(head.stored_shapes(), weight.element_size(), args.tensor_parallel_size,
                                  bool(args.passed_through.get("language_model_only")))
    card = torch.cuda.get_device_properties(device).total_memory
    return engine_gpu_share(card, weight.numel() * weight.element_size(), working, weights, args.gpu_memory_utilization)


def load_vllm_teacher(cfg: TeacherConfig, args: VllmArgs, max_length: int, python: str | None = None,
                      prompt_logprobs: int = 0, shard_tokens: Callable[[int, int], int] | None = None) -> VllmTeacher:
    """The teacher's config, tokenizer, final norm and LM head, read by name from its files (the
    head and norm on --device; never the whole model), and a vLLM engine running the same folder. `prompt_logprobs` > 0 asks vLLM for its
    own top-k too (the benchmark's comparison; the build does not use them). `shard_tokens(taps,
    hidden)` is the tokens of the build's shards, which bound a generate and so the build's GPU
    working set beside the engine; None: generates of one generate_tokens shard."""
    executable = find_vllm_python(python)  # before loading anything
    # checks LOCAL_RANK, which worker_environment reads; the head goes to the engine's first GPU
    device = resolve_device(cfg.device, per_rank=args.tensor_parallel_size)
    env = worker_environment(args)  # checks VLLM_CPU_KVCACHE_SPACE before the teacher loads
    head, identity = load_text_head(cfg, device)
    text_config = head.config.get_text_config()
    num_layers = int(text_config.num_hidden_layers)
    if cfg.top_k > head.lm_head.weight.shape[0]:
        raise ConfigError(f"--top-k {cfg.top_k} exceeds the teacher's vocabulary; use a smaller k")
    layer_ids = resolve_layers(cfg, num_layers)
    # what the head and the build's working set leave vLLM of its first GPU, refused in one line before vLLM starts
    per_shard = args.generate_tokens if shard_tokens is None else shard_tokens(len(layer_ids), int(text_config.hidden_size))
    share = engine_share(cfg, args, head, device, tokens_per_generate(args.generate_tokens, per_shard, max_length))
    tokenizer = load_tokenizer(cfg)
    aux_ids = aux_layer_ids(layer_ids, num_layers)
    receiver = StateReceiver(layers=len(aux_ids), hidden=int(text_config.hidden_size))
    handle, log_name = tempfile.mkstemp(prefix="dflash-vllm-build-", suffix=".log")
    os.close(handle)
    setup = {**engine_setup(cfg, args, max_length, text_config, share), "aux_layer_ids": aux_ids,
             "socket": receiver.name, "prompt_logprobs": prompt_logprobs}
    env[SECRET_ENV] = receiver.secret  # the connector's proof that it is ours (never argv: any user reads that)
    try:
        worker = VllmWorker(executable, setup, env, Path(log_name))
        receiver.engine_pid = worker.proc.pid
    except BaseException:
        receiver.close()
        raise
    note = version_note(worker.vllm_version)
    return VllmTeacher(cfg=cfg, model=head, notes=[note] if note else [], tokenizer=tokenizer, layer_ids=layer_ids, device=device, identity=identity,
                       worker=worker, receiver=receiver, norm=head.norm, log_path=Path(log_name))
