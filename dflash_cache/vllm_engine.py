"""The teacher forward of `dflash-cache build --engine vllm`: vLLM's engine, in its own environment.

Everything but the forward stays the build's: the tokenizer, the ids and masks, the teacher's
identity and frozen files, exactly as with the transformers engine. The build process never holds
the whole teacher: it reads the config, the tokenizer and, by name from the safetensors files, the
final norm and LM head (and once the input embedding) (teacher.load_text_head). vLLM runs the teacher (dflash_cache/vllm_extract/extract_worker.py, started with
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

import hmac
import logging
import os
import re
import secrets
import select
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_cache.settings.vllm_args import VllmArgs
from dflash_cache.teacher import (
    Teacher,
    TeacherConfig,
    TeacherOutput,
    load_text_head,
    load_tokenizer,
    resolve_layers,
)
from dflash_cache.vllm_extract.dflash_frames import (
    HEADER_LIMIT,
    SECRET_ENV,
    WORKER_MAGIC,
    FrameError,
    frame_header,
    read_exactly,
    read_header,
)
from dflash_common.devices import child_visible_devices, resolve_device
from dflash_common.errors import ConfigError, TeacherError
from dflash_common.vllm_env import cpu_kv_cache_gib, find_vllm_python, vllm_environment

WORKER = Path(__file__).with_name("vllm_extract") / "extract_worker.py"
STALL_TIMEOUT_S = 600.0
"""Longest wait for a finished sequence's states once vLLM reported the batch done."""

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


MAX_CONNECTIONS = 32
"""Connections the state socket serves at once (one per data-parallel engine is what vLLM opens)."""
HELLO_TIMEOUT_S = 30.0
"""How long an admitted peer has to send the build's secret before it is dropped."""
_STATE_DTYPES = {"float32": np.float32, "bfloat16": np.int16, "float16": np.int16}  # 16-bit kept as bits
_LOGGED_REFUSALS = 10
log = logging.getLogger(__name__)


class RefusedFrame(Exception):
    """A connection or frame the state socket does not take (the reason is the message)."""


def descends_from(pid: int, ancestor: int, max_depth: int = 64) -> bool:
    """Whether process `pid` is `ancestor` or one of its descendants (by /proc's parent links)."""
    for _ in range(max_depth):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            return False
        pid = int(stat[stat.rindex(b")") + 2:].split()[1])  # after "pid (comm) state": the parent
    return False


class StateReceiver:
    """Listens on a Linux abstract Unix socket (no file) for the connector's frames and keeps each
    request's states until taken. One connection per engine (data-parallel replicas connect
    separately); frames arrive in any order.

    The socket's name is visible to every local user (/proc/net/unix), so it admits only the
    engine this build started: a peer (SO_PEERCRED) of the build's uid inside the worker's process
    tree (`engine_pid`, set once the worker runs), at most `max_connections` at once, whose first
    frame is the build's random `secret`. Each frame's header is checked before its payload is
    allocated: [rows, layers, hidden] of this teacher, a float dtype, the byte count those make,
    rows of a sequence the build sent (`expect`) and not yet received, an id not seen before. A
    connection that fails any check is dropped and logged; only a failure of the engine's own
    (authenticated) connection stops the build."""

    def __init__(self, layers: int, hidden: int, max_connections: int = MAX_CONNECTIONS,
                 hello_timeout_s: float = HELLO_TIMEOUT_S):
        self.name = f"dflash-hs-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.secret = secrets.token_hex(32)
        self.layers, self.hidden = layers, hidden
        self.max_connections, self.hello_timeout_s = max_connections, hello_timeout_s
        self.engine_pid: int | None = None
        self.expected: Counter[int] = Counter()  # rows -> sequences sent whose states have not arrived
        self.refusals = 0
        self.refused: list[str] = []  # the first reasons (logged too)
        self.connections = 0
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind("\0" + self.name)
        self.server.listen()
        self.states: dict[str, np.ndarray] = {}
        self.error: str | None = None
        self.arrived = threading.Condition()
        self._acceptor = threading.Thread(target=self._accept, daemon=True, name="dflash-hs-accept")
        self._acceptor.start()

    def expect(self, lengths: list[int]) -> None:
        """Sequences of these lengths were sent to the engine: their states may now arrive."""
        with self.arrived:
            self.expected.update(int(n) for n in lengths)

    def _refuse(self, reason: str) -> None:
        with self.arrived:
            self.refusals += 1
            count = self.refusals
            if count <= _LOGGED_REFUSALS:
                self.refused.append(reason)
        if count <= _LOGGED_REFUSALS:
            log.warning("refused a connection to the build's state socket: %s%s", reason,
                        "; further refusals are only counted" if count == _LOGGED_REFUSALS else "")

    def _peer_refusal(self, conn: socket.socket) -> str | None:
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if uid != os.getuid():
            return f"process {pid} runs as uid {uid}, not the build's uid {os.getuid()}"
        if self.engine_pid is None or not descends_from(pid, self.engine_pid):
            return f"process {pid} is not a process of the build's vLLM engine (worker pid {self.engine_pid})"
        if self.connections >= self.max_connections:
            return f"process {pid} opened more than {self.max_connections} connections at once"
        return None

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed
            try:
                reason = self._peer_refusal(conn)
            except OSError as err:
                reason = f"its credentials cannot be read ({err})"
            if reason is not None:
                self._refuse(reason)
                conn.close()
                continue
            with self.arrived:
                self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True, name="dflash-hs-read").start()

    def _admit(self, header: dict) -> tuple[str, np.ndarray]:
        """The empty array a frame's payload goes into, once its header passed every check."""
        key, shape, dtype = header.get("id"), header.get("shape"), header.get("dtype")
        if not (isinstance(key, str) and 0 < len(key) <= 256):
            raise RefusedFrame(f"a frame without a request id ({str(key)[:40]!r})")
        if dtype not in _STATE_DTYPES:
            raise RefusedFrame(f"frame {key[:40]!r} has dtype {str(dtype)[:40]!r}; only float32, bfloat16, float16 are sent")
        if not (isinstance(shape, list) and len(shape) == 3 and all(type(n) is int for n in shape)
                and shape[0] > 0 and shape[1:] == [self.layers, self.hidden]):
            raise RefusedFrame(f"frame {key[:40]!r} has shape {str(shape)[:60]}; [rows, {self.layers}, {self.hidden}] expected")
        storage = np.dtype(_STATE_DTYPES[dtype])
        if header["nbytes"] != shape[0] * shape[1] * shape[2] * storage.itemsize:
            raise RefusedFrame(f"frame {key[:40]!r} announces {header['nbytes']} bytes for shape {shape} of {dtype}")
        with self.arrived:
            if key in self.states:
                raise RefusedFrame(f"frame {key[:40]!r} was already received")
            if self.expected[shape[0]] <= 0:
                raise RefusedFrame(f"frame {key[:40]!r} has {shape[0]} rows, the length of no sequence the build sent")
            self.expected[shape[0]] -= 1
        return key, np.empty(shape, dtype=storage)

    def _read(self, conn: socket.socket) -> None:
        authenticated = False
        with conn:  # closed after the reason is recorded: whoever sees it closed sees why
            try:
                conn.settimeout(self.hello_timeout_s)
                hello = read_header(conn.recv_into)
                if hello is None:
                    return
                if not hmac.compare_digest(str(hello.get("secret", "")).encode(), self.secret.encode()):
                    raise RefusedFrame("its first frame is not the build's secret")
                authenticated = True
                conn.settimeout(None)
                while (header := read_header(conn.recv_into)) is not None:
                    key, states = self._admit(header)
                    if not read_exactly(conn.recv_into, memoryview(states).cast("B")):
                        raise EOFError("connection ended inside a frame")
                    with self.arrived:
                        self.states[key] = states
                        self.arrived.notify_all()
            except (OSError, EOFError, ValueError, RefusedFrame) as err:
                reason = str(err) if isinstance(err, RefusedFrame) else f"{type(err).__name__}: {err}"
                if authenticated:  # the engine's own connection broke: the build cannot go on
                    with self.arrived:
                        self.error = reason
                        self.arrived.notify_all()
                else:
                    self._refuse(reason)
            finally:
                with self.arrived:
                    self.connections -= 1

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
        # on Linux, closing a listening socket does not wake a thread blocked in accept(): shut it
        # down first, or every build leaves its accept thread behind
        try:
            self.server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already
        self.server.close()
        self._acceptor.join(5.0)
        if self.refusals > _LOGGED_REFUSALS:
            log.warning("the build's state socket refused %d connections in all", self.refusals)


HANDSHAKE_TIMEOUT_S = 120.0
"""How long the worker has to write its first bytes (extract_worker.py does so before importing vLLM)."""
GROUP_GRACE_S = 10.0
"""After a worker that exited cleanly, how long its engine's last processes get to end on their own."""


class VllmWorker:
    """The vLLM process of a build: started once, fed batches of token ids until closed.

    It runs in a session (and process group) of its own that holds every process of the engine,
    and extract_worker.py makes each of them die with its parent (PR_SET_PDEATHSIG). A watcher thread here
    ends the whole group as soon as the worker exits, so a worker killed mid-build takes its
    engine with it (the engine's processes would otherwise stay, holding memory and GPUs, and keep
    its output pipe open so the build would wait for a reply forever). Start it from a thread that
    lives as long as the build (its main thread): the kernel's parent-death signal fires when the
    *thread* that started a process ends."""

    def __init__(self, python: Path, setup: dict, env: dict[str, str], log_path: Path):
        self.python, self.log_path = python, log_path
        self.logprobs = int(setup.get("prompt_logprobs") or 0)
        self.sent = 0
        self.in_flight: deque[tuple[int, int, int]] = deque()  # (batch, sequences, tokens) sent, not answered
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, env=env, start_new_session=True)
        threading.Thread(target=self._end_group_after_exit, daemon=True, name="dflash-vllm-watch").start()
        self._handshake()
        self._write(setup)
        ready = self._reply()
        self.vllm_version = ready.get("vllm_version")

    def _end_group_after_exit(self) -> None:
        code = self.proc.wait()
        deadline = time.monotonic() + (GROUP_GRACE_S if code == 0 else 0.0)
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return  # the group ended on its own
            time.sleep(0.1)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _handshake(self) -> None:
        """extract_worker.py's first bytes; anything else (a --vllm-python that is not a python, or that
        prints) is refused before a byte of it is read as a frame."""
        got = bytearray(len(WORKER_MAGIC))
        if not select.select([self.proc.stdout], [], [], HANDSHAKE_TIMEOUT_S)[0]:
            self.kill()
            raise TeacherError(f"vLLM python {self.python} wrote nothing in {HANDSHAKE_TIMEOUT_S:.0f} s; pass --vllm-python "
                               "(or set DFLASH_VLLM_PYTHON to) the python of an environment with vLLM, such as "
                               ".venv-vllm/bin/python")
        try:
            ended = not read_exactly(self.proc.stdout.readinto, memoryview(got))
        except EOFError:
            ended = True
        if ended:
            raise self.failure()
        if bytes(got) != WORKER_MAGIC:
            self.kill()
            raise TeacherError(f"vLLM python {self.python} did not answer as dflash's vLLM worker (its output began "
                               f"{bytes(got)!r}); pass --vllm-python (or set DFLASH_VLLM_PYTHON to) the python of an "
                               "environment with vLLM, such as .venv-vllm/bin/python")

    def _write(self, header: dict, payload: bytes = b"") -> None:
        try:
            self.proc.stdin.write(frame_header(header, len(payload)))
            if payload:
                self.proc.stdin.write(payload)
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self.failure() from None

    def _reply(self, sequences: int = 0, tokens: int = 0) -> dict:
        """The worker's next answer, its payload under 'payload'; bounded by what an answer about
        `sequences` sequences of `tokens` tokens in all can hold."""
        limit = HEADER_LIMIT + 128 * sequences
        try:
            header = read_header(self.proc.stdout.readinto, limit=limit)
            if header is None:
                raise self.failure()
            if header["nbytes"] > tokens * self.logprobs * 8:
                raise FrameError(f"a payload of {header['nbytes']} bytes for {tokens} tokens")
            payload = bytearray(header.pop("nbytes"))
            if payload and not read_exactly(self.proc.stdout.readinto, memoryview(payload)):
                raise self.failure()
        except (FrameError, EOFError) as err:
            self.kill()
            raise TeacherError(f"vLLM's worker answered out of protocol ({err}); its log is {self.log_path}") from None
        header["payload"] = bytes(payload)
        return header

    def send(self, sequences: list[np.ndarray]) -> None:
        """Queue one generate over the sequences; the worker runs batches one after another, in the
        order sent, and answers each in that order (receive). It reads batches while it generates,
        so the next one is waiting there when a generate ends."""
        lengths = [len(s) for s in sequences]
        self._write({"lengths": lengths, "batch": self.sent}, np.concatenate(sequences).astype(np.int32).tobytes())
        self.in_flight.append((self.sent, len(lengths), sum(lengths)))
        self.sent += 1

    def receive(self) -> dict:
        """The answer to the oldest batch sent and not yet received: each sequence's vLLM request,
        the generate's seconds and the seconds the engine waited for the batch."""
        batch, sequences, tokens = self.in_flight.popleft()
        reply = self._reply(sequences, tokens)
        if reply.get("batch") != batch or len(reply.get("requests", ())) != sequences:
            self.kill()
            raise TeacherError(f"vLLM's worker answered batch {reply.get('batch')!r} with {len(reply.get('requests', ()))} "
                               f"request(s) where batch {batch} of {sequences} sequence(s) was due; its log is {self.log_path}")
        return reply

    def run(self, sequences: list[np.ndarray]) -> dict:
        """One generate over the sequences, waited for; the reply names each sequence's vLLM request."""
        self.send(sequences)
        return self.receive()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """The worker and every process of its engine, now."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def failure(self) -> TeacherError:
        try:
            self.proc.wait(timeout=60)  # its output ended: it is exiting
        except subprocess.TimeoutExpired:
            self.kill()
        code = self.proc.returncode
        cause = (f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
                 else f"exit code {code}: {last_error(self.log_path)}")
        return TeacherError(f"vLLM's engine stopped ({cause}); its log is {self.log_path}")

    def close(self) -> None:
        """End of stdin ends the engine; a worker that does not stop in a minute is killed with
        its process group (the engine's own processes included)."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()


_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?(?P<level>[A-Z]+) \d\d-\d\d [\d:]+ \[[^\]]*\] ")
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(?P<name>\w+(?:Error|Exception)|KeyboardInterrupt|SystemExit)(?::|$)")


def last_error(log_path: Path) -> str:
    """The cause a failed engine's log names: the last exception line of a traceback that is not a
    warning (vLLM logs expected start-up failures as warnings with tracebacks, such as "Tokenizer
    not available when skip_tokenizer_init=True", and EngineDeadError only says "see above"), else
    its last ERROR line, else its last line."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    errors = []
    for line in lines:
        prefix = _LOG_PREFIX.match(line)
        level = prefix["level"] if prefix else ""
        message = line[prefix.end():] if prefix else line
        if level in ("", "ERROR", "CRITICAL") and (found := _EXCEPTION_LINE.match(message)) \
                and found["name"] != "EngineDeadError":
            errors.append((2, line))
        elif level in ("ERROR", "CRITICAL"):
            errors.append((1, line))
    for rank in (2, 1):
        chosen = [line for r, line in errors if r == rank]
        if chosen:
            return chosen[-1][-300:]
    return lines[-1][-300:] if lines else "no output"


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
        reply = self.worker.receive()
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


def engine_setup(cfg: TeacherConfig, args: VllmArgs, max_length: int, text_config) -> dict:
    """The engine part of extract_worker.py's setup frame: the teacher's folder, dtype and LLM(...) options
    (what the benchmark's bare prefill runs with too)."""
    folder = Path(cfg.name_or_path).expanduser()
    return {"model": str(folder.resolve()) if folder.exists() else cfg.name_or_path, "dtype": cfg.dtype,
            "engine_args": {**args.engine_args(max_length, getattr(text_config, "max_position_embeddings", None)),
                            **({"revision": cfg.revision} if cfg.revision else {}),
                            "trust_remote_code": cfg.trust_remote_code}}


def load_vllm_teacher(cfg: TeacherConfig, args: VllmArgs, max_length: int, python: str | None = None,
                      prompt_logprobs: int = 0) -> VllmTeacher:
    """The teacher's config, tokenizer, final norm and LM head, read by name from its files (the
    head and norm on --device; never the whole model), and a vLLM engine running the same folder. `prompt_logprobs` > 0 asks vLLM for its
    own top-k too (the benchmark's comparison; the build does not use them)."""
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
    tokenizer = load_tokenizer(cfg)
    aux_ids = aux_layer_ids(layer_ids, num_layers)
    receiver = StateReceiver(layers=len(aux_ids), hidden=int(text_config.hidden_size))
    handle, log_name = tempfile.mkstemp(prefix="dflash-vllm-build-", suffix=".log")
    os.close(handle)
    setup = {**engine_setup(cfg, args, max_length, text_config), "aux_layer_ids": aux_ids, "socket": receiver.name,
             "prompt_logprobs": prompt_logprobs}
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
