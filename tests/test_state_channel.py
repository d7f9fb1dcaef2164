"""The build's state channel (`build --engine vllm`) against hostile local processes, and the
engine's other inputs a user can get wrong (a --vllm-python that only prints, environment values).

The receiver is real (its abstract Unix socket, its threads) and so are its peers: this process
plays the engine where a test needs one (its pid is what the receiver admits), a child process
plays a local process that is not the engine, and a child under uid `nobody` another user. Every
refused connection must be dropped without stopping the build and without allocating what its
bytes claim (tracemalloc's peak over the attack stays under a megabyte: numpy and bytearray
allocations are traced), and the engine's own frames must still arrive afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest
from helpers import peak_rss_kib, qa_rows, write_jsonl
from typer.testing import CliRunner

from cli.cache import app as cache_app
from dflash_common.errors import TeacherError
from dflash_teacher.state_receiver import StateReceiver, descends_from
from dflash_teacher.vllm_extract.dflash_frames import frame_header
from dflash_teacher.vllm_process import last_error

LAYERS, HIDDEN = 3, 8
SMALL = 1 << 20  # an attack may cost the receiver this much memory at most


@pytest.fixture
def receiver():
    made = StateReceiver(layers=LAYERS, hidden=HIDDEN, max_connections=4, hello_timeout_s=1.0)
    made.engine_pid = os.getpid()  # this process plays the engine
    yield made
    made.close()


def _connect(receiver: StateReceiver) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect("\0" + receiver.name)
    return conn


def _dropped(conn: socket.socket) -> bool:
    """Whether the receiver closed this connection (within the socket's timeout)."""
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _frame(key: str, rows: int, value: float = 1.0) -> tuple[bytes, np.ndarray]:
    states = np.full((rows, LAYERS, HIDDEN), value, np.float32)
    return frame_header({"id": key, "shape": list(states.shape), "dtype": "float32"}, states.nbytes) + states.tobytes(), states


def _engine_delivers(receiver: StateReceiver, key: str = "real-1", rows: int = 5) -> None:
    """The engine's frame still arrives and is taken whole."""
    data, states = _frame(key, rows, 3.0)
    receiver.expect([rows])
    with _connect(receiver) as conn:
        conn.sendall(frame_header({"secret": receiver.secret}) + data)
        got = receiver.take([key], alive=lambda: True, timeout_s=30)
    np.testing.assert_array_equal(got[0], states)


def _header(header: dict) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<I", len(text)) + text


WITHOUT_SECRET = {
    "9 bytes of non-JSON": (b"\x05\x00\x00\x00hello", "not JSON"),
    "a 4 GiB length prefix": (b"\xff\xff\xff\xff", "a frame header of 4294967295 bytes"),
    "JSON nested 2,000 deep": (_header({"x": None})[:4] and struct.pack("<I", 4000) + b"[" * 2000 + b"]" * 2000, "not JSON"),
    "shape [-1]": (_header({"id": "1-abc", "shape": [-1], "dtype": "float32", "nbytes": 0}), "not the build's secret"),
    "a frame under a guessed id": (_frame("1-0a1b2c3d", 5)[0], "not the build's secret"),
    "a wrong secret": (frame_header({"secret": "0" * 64}) + _frame("1-0a1b2c3d", 5)[0], "not the build's secret"),
    "4 GiB announced": (_header({"id": "2", "shape": [1 << 27, LAYERS, HIDDEN], "dtype": "float32", "nbytes": 1 << 32}),
                        "not the build's secret"),
}


@pytest.mark.parametrize("name", list(WITHOUT_SECRET))
def test_a_peer_without_the_secret_is_dropped_and_the_build_goes_on(receiver, name):
    """9 bytes of non-JSON (or shape [-1]) ended a real build; a 4-byte length prefix made it
    allocate and zero 4 GiB per connection; frames under any id were kept forever."""
    payload, reason = WITHOUT_SECRET[name]
    receiver.expect([5])
    tracemalloc.start()
    try:
        with _connect(receiver) as conn:
            conn.sendall(payload)
            assert _dropped(conn)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < SMALL, peak
    deadline = time.monotonic() + 10
    while not receiver.refused and time.monotonic() < deadline:
        time.sleep(0.01)
    assert receiver.error is None and receiver.states == {}
    assert len(receiver.refused) == 1 and reason in receiver.refused[0], receiver.refused
    _engine_delivers(receiver)  # the sequence of 5 rows expected before the attack was not taken by it


ENGINE_FAULTS = {
    "shape [-1]": ({"id": "a", "shape": [-1], "dtype": "float32", "nbytes": 0}, "has shape [-1]"),
    "a wrong hidden size": ({"id": "a", "shape": [5, LAYERS, HIDDEN + 1], "dtype": "float32", "nbytes": 5 * LAYERS * 9 * 4},
                            f"[rows, {LAYERS}, {HIDDEN}] expected"),
    "4 GiB announced for its shape": ({"id": "a", "shape": [5, LAYERS, HIDDEN], "dtype": "float32", "nbytes": 1 << 32},
                                      "announces 4294967296 bytes"),
    "rows of no sequence sent": ({"id": "a", "shape": [1 << 27, LAYERS, HIDDEN], "dtype": "float32",
                                  "nbytes": (1 << 27) * LAYERS * HIDDEN * 4}, "the length of no sequence the build sent"),
    "an object dtype": ({"id": "a", "shape": [5, LAYERS, HIDDEN], "dtype": "object", "nbytes": 0}, "has dtype 'object'"),
    "an id that is not a string": ({"id": ["a"], "shape": [5, LAYERS, HIDDEN], "dtype": "float32", "nbytes": 480},
                                   "without a request id"),
    "a boolean row count": ({"id": "a", "shape": [True, LAYERS, HIDDEN], "dtype": "float32", "nbytes": 96}, "has shape"),
}


@pytest.mark.parametrize("name", list(ENGINE_FAULTS))
def test_a_bad_header_is_refused_before_its_payload_is_allocated(receiver, name):
    """Even from a peer that knows the secret (the engine itself, gone wrong), a header is checked
    against the sequences the build sent before anything is allocated for it; the build stops
    with the reason instead of waiting."""
    header, reason = ENGINE_FAULTS[name]
    receiver.expect([5])
    tracemalloc.start()
    try:
        with _connect(receiver) as conn:
            conn.sendall(frame_header({"secret": receiver.secret}) + _header(header))
            assert _dropped(conn)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < SMALL, peak
    with pytest.raises(TeacherError, match="reading hidden states from vLLM failed") as caught:
        receiver.take(["a"], alive=lambda: True, timeout_s=30)
    assert reason in str(caught.value), caught.value
    assert receiver.states == {}


def test_a_second_frame_of_an_id_or_a_length_not_sent_is_refused(receiver):
    """Frames under ids never asked for were kept forever: a frame needs a sequence of its length
    the build sent and has not received yet."""
    receiver.expect([5])
    first, _ = _frame("x", 5)
    with _connect(receiver) as conn:
        conn.sendall(frame_header({"secret": receiver.secret}) + first + _frame("y", 5)[0])
        assert _dropped(conn)
    assert list(receiver.states) == ["x"]
    assert "the length of no sequence the build sent" in receiver.error


def test_two_shards_in_flight_arrive_in_any_order_and_nothing_else_is_taken(receiver):
    """The build sends the next shard to the engine before it takes the previous shard's states
    (ShardQueue keeps 2 in flight): the frames of both shards come interleaved, each shard is
    taken whole while the other's wait, and a frame beyond the two shards' sequences is still
    refused."""
    shard_a, shard_b = {"a1": 5, "a2": 3}, {"b1": 5, "b2": 4}
    receiver.expect(list(shard_a.values()))
    receiver.expect(list(shard_b.values()))
    frames = {key: _frame(key, rows, float(i)) for i, (key, rows) in enumerate({**shard_a, **shard_b}.items())}
    with _connect(receiver) as conn:
        conn.sendall(frame_header({"secret": receiver.secret}))
        for key in ("b1", "a2", "b2", "a1"):  # shard b's first sequence before all of shard a's
            conn.sendall(frames[key][0])
        got = receiver.take(list(shard_a), alive=lambda: True, timeout_s=30)
        for key, states in zip(shard_a, got):
            np.testing.assert_array_equal(states, frames[key][1])
        assert set(receiver.states) == set(shard_b)  # shard b's states wait for their turn
        conn.sendall(_frame("c", 5)[0])  # a third sequence of 5 rows: the build sent two
        assert _dropped(conn)
    assert "the length of no sequence the build sent" in receiver.error
    got = receiver.take(list(shard_b), alive=lambda: True, timeout_s=30)  # already here: taken
    for key, states in zip(shard_b, got):
        np.testing.assert_array_equal(states, frames[key][1])
    assert receiver.states == {}


def test_connections_beyond_the_cap_or_from_other_processes_get_no_thread(receiver):
    """Every connection got a thread, unbounded."""
    def readers() -> int:
        return sum(t.name == "dflash-hs-read" for t in threading.enumerate())

    # from this process (admitted), but silent: at most max_connections wait, for hello_timeout_s
    held = [_connect(receiver) for _ in range(40)]
    time.sleep(0.3)
    assert readers() <= receiver.max_connections
    assert sum(_dropped(conn) for conn in held) == 40  # the over-cap at once, the rest at their timeout
    for conn in held:
        conn.close()
    assert receiver.refusals == 40 and len(receiver.refused) == 10  # logged 10 times, then counted
    # from a process outside the engine's tree: refused at accept, before any thread or read
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        receiver.engine_pid = sleeper.pid
        assert descends_from(sleeper.pid, os.getpid()) and not descends_from(os.getpid(), sleeper.pid)
        for _ in range(200):
            with _connect(receiver) as conn:
                try:
                    conn.sendall(frame_header({"secret": receiver.secret}))
                except (BrokenPipeError, ConnectionResetError):
                    pass  # closed at once
                assert _dropped(conn)
        assert readers() == 0 and receiver.refusals == 240
    finally:
        sleeper.kill()
        sleeper.wait()
    receiver.engine_pid = os.getpid()
    _engine_delivers(receiver)



def test_closing_the_receiver_ends_its_accept_thread():
    """Each build left its accept thread blocked in accept() for good (closing a listening socket
    does not wake it on Linux): a long-lived process running builds gathered them."""
    def acceptors() -> int:
        return sum(t.name == "dflash-hs-accept" for t in threading.enumerate())

    before = acceptors()
    made = [StateReceiver(layers=LAYERS, hidden=HIDDEN) for _ in range(3)]
    assert acceptors() == before + 3
    for receiver in made:
        receiver.close()
    assert acceptors() == before


NOBODY = r"""
import socket, sys
name, secret, frame = sys.argv[1], sys.argv[2], bytes.fromhex(sys.stdin.read())
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.settimeout(10)
conn.connect("\0" + name)
try:
    conn.sendall(frame)
    print("dropped" if conn.recv(1) == b"" else "open")
except (BrokenPipeError, ConnectionResetError):
    print("dropped")
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become uid nobody")
def test_a_process_of_another_user_is_refused_even_with_the_secret(receiver):
    """The socket's name is in /proc/net/unix for every user: a process of another uid must be
    refused even with the secret (as if it had leaked) and a well-formed frame."""
    receiver.expect([5])
    data, _ = _frame("1-0a1b2c3d", 5)
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    found = subprocess.run([python, "-c", NOBODY, receiver.name, "unused"], user="nobody", cwd="/",
                           input=(frame_header({"secret": receiver.secret}) + data).hex(),
                           capture_output=True, text=True, timeout=60)
    assert found.stdout.strip() == "dropped", found
    assert receiver.states == {} and receiver.error is None
    assert len(receiver.refused) == 1 and "runs as uid 65534, not the build's uid 0" in receiver.refused[0]
    _engine_delivers(receiver)  # its sequence of 5 rows is still the engine's to send


# --- the engine's other inputs -----------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("channel") / "chat.jsonl", qa_rows(4, seed=1, prefix="c-"))


def _build(teacher_dir, corpus, out, *extra, env=None):
    return CliRunner().invoke(cache_app, ["build", "--teacher", teacher_dir("qwen3"), "--data", corpus, "--out", str(out),
                                          "--layers", "0", "--engine", "vllm", "--quiet", *extra], env=env)


@pytest.mark.parametrize("program,expected", [("cat", "did not answer as dflash's vLLM worker (its output began b'\"\"\"The"),
                                              ("yes", "did not answer as dflash's vLLM worker (its output began b'/"),
                                              ("silent", "wrote nothing in 2 s")])
def test_a_vllm_python_that_only_prints_is_refused_in_one_line(teacher_dir, corpus, tmp_path, monkeypatch, program, expected):
    """Its output was read as frames: 1.4-4.1 GB allocated, then a traceback (and one that
    printed nothing was waited for forever)."""

    from dflash_teacher import vllm_process

    monkeypatch.setattr(vllm_process, "HANDSHAKE_TIMEOUT_S", 2.0)
    python = shutil.which(program) if program != "silent" else tmp_path / "silent"
    if program == "silent":
        python.write_text("#!/bin/sh\nexec sleep 600\n")
        python.chmod(0o755)
    before = peak_rss_kib(reset=True)
    result = _build(teacher_dir, corpus, tmp_path / "out", "--vllm-python", str(python))
    grown_mib = (peak_rss_kib() - before) / 1024
    assert result.exit_code == 1, (result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines
    assert "pass --vllm-python (or set DFLASH_VLLM_PYTHON to) the python of an environment with vLLM" in lines[0]
    assert grown_mib < 500, grown_mib


@pytest.mark.parametrize("name,value,expected", [
    ("VLLM_CPU_KVCACHE_SPACE", "abc", "VLLM_CPU_KVCACHE_SPACE='abc' is not an integer >= 1 (GiB of vLLM's CPU KV cache)"),
    ("VLLM_CPU_KVCACHE_SPACE", "0", "VLLM_CPU_KVCACHE_SPACE='0' is not an integer >= 1"),
    ("RANK", "abc", "RANK='abc' is not an integer >= 0 (this process's rank, set by torchrun)"),
    ("WORLD_SIZE", "1" * 5000, "WORLD_SIZE='1111111111"),
    ("LOCAL_RANK", "x", "LOCAL_RANK='x' is not an integer >= 0"),
])
def test_environment_values_are_checked_in_one_line(teacher_dir, corpus, tmp_path, name, value, expected):
    """`VLLM_CPU_KVCACHE_SPACE=abc` and `RANK=abc` were tracebacks."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    result = _build(teacher_dir, corpus, tmp_path / "out", "--vllm-python", str(fake), "--device", "auto", env={name: value})
    assert result.exit_code == 1, (result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines


def test_the_engine_s_error_line_is_its_exception_not_a_start_up_warning(tmp_path):
    """Every engine failure was reported as "Tokenizer not available when skip_tokenizer_init=True",
    a traceback vLLM logs as a WARNING at every start (lines as vLLM 0.32 writes them)."""
    warning = "(MainProcess pid=7311) WARNING 12-03 10:29:20 [base.py:380] "
    error = "(Worker pid=8219) ERROR 12-03 10:29:20 [multiproc_executor.py:1063] "
    log = tmp_path / "engine.log"
    log.write_text("\n".join([
        warning + "Chat template warmup failed", warning + "Traceback (most recent call last):",
        warning + '    raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")',
        warning + "ValueError: Tokenizer not available when `skip_tokenizer_init=True`",
        error + "WorkerProc hit an exception.", error + "Traceback (most recent call last):",
        error + "AssertionError: CPU GDN attention requires BF16.",
        "(EngineCore pid=7981) ERROR 12-03 10:29:21 [core.py:1] EngineCore encountered a fatal error.",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace above.",
        warning + "ValueError: Tokenizer not available when `skip_tokenizer_init=True`"]) + "\n")
    assert last_error(log) == error + "AssertionError: CPU GDN attention requires BF16."
    log.write_text(warning + "ValueError: Tokenizer not available when `skip_tokenizer_init=True`\n"
                   "(EngineCore pid=1) INFO 12-03 10:29:20 [core.py:1] starting\n")
    assert last_error(log) == "(EngineCore pid=1) INFO 12-03 10:29:20 [core.py:1] starting"  # no error: the last line
