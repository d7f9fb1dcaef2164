"""The build's end of vLLM's hidden-state channel: a socket the connector in vLLM's process
(vllm_extract/dflash_hs_connector.py) sends each finished sequence's states to, admitting only the
engine this build started and checking every frame before its payload is allocated."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np

from dflash_common.errors import TeacherError
from dflash_teacher.vllm_extract.dflash_frames import read_exactly, read_header

STALL_TIMEOUT_S = 600.0
"""Longest wait for a finished sequence's states once vLLM reported the batch done."""

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
