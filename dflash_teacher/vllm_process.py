"""vLLM's process of a build: extract_worker.py started with the python of vLLM's environment,
fed batches of token ids over its stdin and answering over its stdout (vllm_extract/dflash_frames.py
is the wire format), and the one-line cause a failed engine's log names."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

from dflash_common.errors import ConfigError, TeacherError
from dflash_teacher.vllm_extract.dflash_frames import (
    HEADER_LIMIT,
    WORKER_MAGIC,
    FrameError,
    frame_header,
    read_exactly,
    read_header,
)

WORKER = Path(__file__).with_name("vllm_extract") / "extract_worker.py"
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
        if ready.get("refused"):  # an engine argument vLLM's own list lacks: the worker is exiting
            self.close()
            raise ConfigError(str(ready["refused"]))
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
