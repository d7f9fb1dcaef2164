"""The teacher forward of `dflash-cache build --engine vllm`: vLLM's engine, in its own environment.

Everything but the forward stays the build's: the tokenizer, the ids and masks, the teacher's
identity and frozen files, exactly as with the transformers engine. The build process never holds
the whole teacher: it reads the config, the tokenizer and, by name from the safetensors files, the
final norm and LM head (and once the input embedding) (teacher.load_text_head). vLLM runs the teacher (dflash_cache/vllm_extract/worker.py, started with
the python of vLLM's environment) and captures, with its `extract_hidden_states` method, the
tapped layers plus the last decoder layer's output; our connector sends each finished sequence's
states to a socket of this process. The final norm and the LM head then run here in fp32 by the
same code as the transformers engine (Teacher._topk), on the --device given (the GPU vLLM uses,
on GPU nodes), so the top-k log-probs are those of an fp32 head, not of vLLM's sampler.

vLLM's aux hidden-state id L is the *input* of decoder layer L (transformers' hidden_states[L]),
so tap L (the output of layer L) is aux id L + 1 and the last layer's output is aux id
num_hidden_layers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash_cache.settings.engines import VllmArgs
from dflash_cache.teacher import (
    Teacher,
    TeacherConfig,
    TeacherOutput,
    load_text_head,
    load_tokenizer,
    resolve_layers,
)
from dflash_cache.vllm_extract.dflash_frames import frame_header, read_exactly, read_header
from dflash_common.devices import resolve_device
from dflash_common.errors import ConfigError, TeacherError
from dflash_common.vllm_env import find_vllm_python, vllm_environment

WORKER = Path(__file__).with_name("vllm_extract") / "worker.py"
STALL_TIMEOUT_S = 600.0
"""Longest wait for a finished sequence's states once vLLM reported the batch done."""

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def aux_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """vLLM's aux ids for our taps, then the last layer's output (the final norm's input)."""
    return [i + 1 for i in layer_ids] + [num_layers]


def worker_gpus(env: dict[str, str], args: VllmArgs) -> str | None:
    """CUDA_VISIBLE_DEVICES for the engine of a torchrun rank when the launcher did not choose: one
    engine per rank, on GPUs LOCAL_RANK * tp .. LOCAL_RANK * tp + tp - 1 (tp = tensor_parallel_size:
    one GPU per rank by default, the whole node for one rank per node); None outside torchrun."""
    local = env.get("LOCAL_RANK")
    if local in (None, "") or "CUDA_VISIBLE_DEVICES" in env:
        return None
    tp = args.tensor_parallel_size
    return ",".join(str(int(local) * tp + i) for i in range(tp))


class StateReceiver:
    """Listens on a Linux abstract Unix socket (no file) for the connector's frames and keeps each
    request's states until taken. One connection per engine (data-parallel replicas connect
    separately); frames arrive in any order."""

    def __init__(self):
        self.name = f"dflash-hs-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind("\0" + self.name)
        self.server.listen()
        self.states: dict[str, np.ndarray] = {}
        self.error: str | None = None
        self.arrived = threading.Condition()
        threading.Thread(target=self._accept, daemon=True, name="dflash-hs-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._read, args=(conn,), daemon=True, name="dflash-hs-read").start()

    def _read(self, conn: socket.socket) -> None:
        try:
            with conn:
                while (header := read_header(conn.recv_into)) is not None:
                    storage = np.int16 if header["dtype"] in ("bfloat16", "float16") else np.dtype(header["dtype"])
                    states = np.empty(header["shape"], dtype=storage)
                    if not read_exactly(conn.recv_into, memoryview(states).cast("B")):
                        raise EOFError("connection ended inside a frame")
                    with self.arrived:
                        self.states[header["id"]] = states
                        self.arrived.notify_all()
        except (OSError, EOFError, ValueError, KeyError) as err:
            with self.arrived:
                self.error = f"{type(err).__name__}: {err}"
                self.arrived.notify_all()

    def take(self, request_ids: list[str], alive, timeout_s: float = STALL_TIMEOUT_S) -> list[np.ndarray]:
        """The states of these requests, in order, waiting for late ones; raises when the engine
        died or nothing arrived for timeout_s."""
        wanted = set(request_ids)
        last_progress, have = time.monotonic(), 0
        with self.arrived:
            while not wanted <= self.states.keys():
                if self.error:
                    raise TeacherError(f"reading hidden states from vLLM failed ({self.error})")
                now_have = len(wanted & self.states.keys())
                if now_have > have:
                    last_progress, have = time.monotonic(), now_have
                if not alive() or time.monotonic() - last_progress > timeout_s:
                    return []
                self.arrived.wait(1.0)
            return [self.states.pop(i) for i in request_ids]

    def close(self) -> None:
        self.server.close()


class VllmWorker:
    """The vLLM process of a build: started once, fed batches of token ids until closed."""

    def __init__(self, python: Path, setup: dict, env: dict[str, str], log_path: Path):
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, env=env, start_new_session=True)
        self._write(setup)
        ready = self._reply()
        self.vllm_version = ready.get("vllm_version")

    def _write(self, header: dict, payload: bytes = b"") -> None:
        try:
            self.proc.stdin.write(frame_header(header, len(payload)))
            if payload:
                self.proc.stdin.write(payload)
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self.failure() from None

    def _reply(self) -> dict:
        """The worker's next answer, its payload under 'payload'."""
        header = read_header(self.proc.stdout.readinto)
        if header is None:
            raise self.failure()
        payload = bytearray(header.pop("nbytes"))
        if payload and not read_exactly(self.proc.stdout.readinto, memoryview(payload)):
            raise self.failure()
        header["payload"] = bytes(payload)
        return header

    def run(self, sequences: list[np.ndarray]) -> dict:
        """One generate over the sequences; the reply names each sequence's vLLM request."""
        lengths = [len(s) for s in sequences]
        self._write({"lengths": lengths}, np.concatenate(sequences).astype(np.int32).tobytes())
        return self._reply()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def failure(self) -> TeacherError:
        try:
            self.proc.wait(timeout=60)  # its output ended: it is exiting
        except subprocess.TimeoutExpired:
            pass
        return TeacherError(f"vLLM's engine stopped (exit code {self.proc.returncode}: {last_error(self.log_path)}); "
                            f"its log is {self.log_path}")

    def close(self) -> None:
        """End of stdin ends the engine; a worker that does not stop in a minute is killed with
        its process group (the engine's own processes included)."""
        import signal

        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def last_error(log_path: Path) -> str:
    """The last line of a failed engine's log that names an error (its exception, usually)."""
    import re

    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        # EngineDeadError only says "see above": the worker's own error is the one that helps
        if re.search(r"\b(\w+Error|\w+Exception)\b", line) and "EngineDeadError" not in line:
            return line[-300:]
    return lines[-1][-300:] if lines else "no output"


@dataclass
class VllmTeacher(Teacher):
    """A Teacher whose forward runs in vLLM (one engine for the whole build); see the module doc."""

    worker: VllmWorker | None = None
    receiver: StateReceiver | None = None
    norm: torch.nn.Module | None = None
    log_path: Path | None = None
    engine_seconds: float = 0.0
    notes: list = field(default_factory=list)
    """Lines for the user about this engine (a vLLM version outside VLLM_VERSIONS)."""
    """Seconds inside vLLM's generate so far (the benchmark's engine-only time)."""

    pads_batches = False  # vLLM packs sequences; nothing is padded
    holds_whole_model = False  # model is a TextHead: vLLM holds the rest

    def batches(self, lengths: np.ndarray) -> list[np.ndarray]:
        # a whole shard per generate call: vLLM's scheduler batches better than any plan here
        return [np.arange(len(lengths))]

    @torch.inference_mode()
    def forward(self, sequences: list[np.ndarray]) -> TeacherOutput:
        reply = self.worker.run(sequences)
        self.engine_seconds += float(reply["seconds"])
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
        last = self.norm(flat[:, -1].to(head_device))
        return self.pack(flat[:, :-1], *self._topk(last), lengths)

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
    env = vllm_environment(int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # CPU builds: the build's threads share the cores
    gpus = worker_gpus(env, args)
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


def load_vllm_teacher(cfg: TeacherConfig, args: VllmArgs, max_length: int, python: str | None = None,
                      prompt_logprobs: int = 0) -> VllmTeacher:
    """The transformers teacher on the CPU (identity, frozen files, final norm and LM head, moved to
    --device), and a vLLM engine running the same folder. `prompt_logprobs` > 0 asks vLLM for its
    own top-k too (the benchmark's comparison; the build does not use them)."""
    executable = find_vllm_python(python)  # before loading anything
    device = resolve_device(cfg.device)
    head, identity = load_text_head(cfg, device)
    text_config = head.config.get_text_config()
    num_layers = int(text_config.num_hidden_layers)
    if cfg.top_k > head.lm_head.weight.shape[0]:
        raise ConfigError(f"--top-k {cfg.top_k} exceeds the teacher's vocabulary; use a smaller k")
    layer_ids = resolve_layers(cfg, num_layers)
    tokenizer = load_tokenizer(cfg)
    receiver = StateReceiver()
    handle, log_name = tempfile.mkstemp(prefix="dflash-vllm-build-", suffix=".log")
    os.close(handle)
    env = worker_environment(args)
    folder = Path(cfg.name_or_path).expanduser()
    setup = {"model": str(folder.resolve()) if folder.exists() else cfg.name_or_path, "dtype": cfg.dtype,
             "aux_layer_ids": aux_layer_ids(layer_ids, num_layers), "socket": receiver.name,
             "engine_args": {**args.engine_args(max_length, getattr(text_config, "max_position_embeddings", None)), **({"revision": cfg.revision} if cfg.revision else {}),
                             "trust_remote_code": cfg.trust_remote_code},
             "prompt_logprobs": prompt_logprobs}
    try:
        worker = VllmWorker(executable, setup, env, Path(log_name))
    except BaseException:
        receiver.close()
        raise
    note = version_note(worker.vllm_version)
    return VllmTeacher(cfg=cfg, model=head, notes=[note] if note else [], tokenizer=tokenizer, layer_ids=layer_ids, device=device, identity=identity,
                       worker=worker, receiver=receiver, norm=head.norm, log_path=Path(log_name))
