"""The build's vLLM engine, run by the python of a vLLM environment: `python extract_worker.py`.

Imports nothing from dflash (vLLM pins its own torch and transformers). Protocol, in frames
(dflash_frames): the build writes the setup frame on stdin (engine arguments, the layers to
capture as vLLM's aux ids, the socket to send states to), this process answers {"ready": ...} on
stdout once the engine is up (or {"refused": line} when vLLM's EngineArgs lacks an engine
argument given, dflash_engine_keys), then each frame on stdin is one batch of token-id sequences
(payload: int32 ids back to back; header: their lengths), run as one `generate` of a single
token, and is answered with its batch number, the vLLM request id of each sequence in order (the
connector, dflash_hs_connector, sends each request's states to the socket under that id), the
engine's seconds and the seconds it waited for the batch. Batches are read on a thread while the
engine runs and run one generate each, in order: the build sends the next shard before it takes
the previous one's states, so the engine does not wait between shards, and a shard's requests
never share an engine step with another shard's (its states are the same however fast the build
is). An end of stdin ends the engine; batches not yet started are dropped. vLLM logs to stdout,
so the protocol keeps a private copy of the original stdout and everything else printed goes to
stderr (the build's log file); the first bytes on it are WORKER_MAGIC, so the build knows it
talks to this script and not to a program that merely prints.

No process of the engine outlives its parent: this process and every process vLLM starts from
it (spawned ones import this file; forked ones run the fork hook) ask the kernel for SIGKILL when
their parent dies (PR_SET_PDEATHSIG), and forked children let go of the protocol's pipe, which only
this process may hold open. The build also kills the whole process group when this process exits.

With `capture: false` in the setup the engine runs without capturing states (the benchmark's
bare prefill: the same engine and options, nothing sent). With `prompt_logprobs: k` in the setup,
each answer also carries vLLM's own top-k log-probs per position (ids then log-probs, [tokens, k]
each) for the benchmark that compares them with our fp32 LM head.
"""

from __future__ import annotations

import array
import ctypes
import os
import queue
import signal
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_PR_SET_PDEATHSIG = 1
_protocol_fd: int | None = None


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (the kernel's PR_SET_PDEATHSIG; Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request: nothing will signal
        os._exit(1)


def _in_forked_child() -> None:
    _die_with_parent()
    if _protocol_fd is not None:  # only this process answers the build; a child keeping it open would hang it
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, _protocol_fd, inheritable=False)  # not closed: the number stays taken, never reused
        os.close(null)


_die_with_parent()  # here and in every process vLLM spawns (they import this file as __mp_main__)
os.register_at_fork(after_in_child=_in_forked_child)


def _send(out, header: dict, payload: bytes = b"") -> None:
    from dflash_frames import frame_header

    out.write(frame_header(header, len(payload)))
    if payload:
        out.write(payload)
    out.flush()


def _read(stream) -> tuple[dict | None, bytes]:
    from dflash_frames import read_exactly, read_header

    header = read_header(stream.readinto)
    if header is None:
        return None, b""
    payload = bytearray(header["nbytes"])
    if payload and not read_exactly(stream.readinto, memoryview(payload)):
        raise EOFError("stdin ended inside a batch")
    return header, bytes(payload)


def _engine(setup: dict):
    from vllm import LLM

    args = dict(setup["engine_args"])
    args.update(
        model=setup["model"], tokenizer=setup["model"], dtype=setup["dtype"], seed=0,
        skip_tokenizer_init=True,  # token ids in, states out: no text either way
    )
    if setup.get("capture", True):  # off only for the benchmark's bare prefill
        args.update(
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": setup["aux_layer_ids"]}}},
            kv_transfer_config={"kv_connector": "DFlashHiddenStatesConnector", "kv_role": "kv_producer",
                                "kv_connector_module_path": "dflash_hs_connector",
                                "kv_connector_extra_config": {"dflash_socket": setup["socket"]}},
        )
    if setup.get("prompt_logprobs"):
        args["max_logprobs"] = setup["prompt_logprobs"]
    return LLM(**args)


def _topk_rows(entries, k: int, ids: array.array, logprobs: array.array) -> None:
    """vLLM's per-position dicts {token: Logprob} -> the k best by rank (a dict may also hold the
    actual next token outside the top k)."""
    for entry in entries:
        best = sorted(entry.items(), key=lambda item: item[1].rank)[:k]
        ids.extend(token for token, _ in best)
        logprobs.extend(lp.logprob for _, lp in best)


def main() -> None:
    global _protocol_fd
    from dflash_frames import WORKER_MAGIC

    _protocol_fd = os.dup(1)
    protocol = os.fdopen(_protocol_fd, "wb")
    protocol.write(WORKER_MAGIC)
    protocol.flush()
    os.dup2(2, 1)  # vLLM's prints and its workers' output go to the log, never into the protocol
    sys.stdout = sys.stderr
    # the connector is loaded by module name, in this process and in the engine's
    sys.path.insert(0, HERE)
    os.environ["PYTHONPATH"] = HERE + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    stdin = sys.stdin.buffer
    setup, _ = _read(stdin)
    if setup is None:
        return
    import vllm
    from dflash_engine_keys import unknown_engine_arg, vllm_engine_arg_names
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # before the engine starts: a key vLLM does not know is one line to the build, not a traceback
    refused = unknown_engine_arg(list(setup["engine_args"]), vllm_engine_arg_names(), vllm.__version__)
    if refused:
        _send(protocol, {"refused": refused})
        return
    llm = _engine(setup)
    k = setup.get("prompt_logprobs") or 0
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                            **({"prompt_logprobs": k, "logprobs": k} if k else {}))
    _send(protocol, {"ready": True, "vllm_version": vllm.__version__})
    batches = _BatchReader(stdin)
    try:
        idle_since = None
        while (item := batches.next()) is not None:
            batch, payload = item
            flat = array.array("i")
            flat.frombytes(payload)
            prompts, start = [], 0
            for n in batch["lengths"]:
                prompts.append(TokensPrompt(prompt_token_ids=flat[start:start + n].tolist()))
                start += n
            began = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - began
            reply = {"batch": batch.get("batch"), "seconds": seconds,
                     "waited": began - idle_since if idle_since is not None else 0.0,
                     "requests": [(out.kv_transfer_params or {}).get("dflash_request") for out in outputs]}
            extra = b""
            if k:
                ids, logprobs = array.array("i"), array.array("f")
                for out in outputs:  # position t predicts t+1: prompt entries 1.., then the sampled token's
                    _topk_rows(list(out.prompt_logprobs[1:]) + [out.outputs[0].logprobs[0]], k, ids, logprobs)
                reply["logprobs_seconds"] = time.perf_counter() - began - seconds
                extra = ids.tobytes() + logprobs.tobytes()
            idle_since = time.perf_counter()
            _send(protocol, reply, extra)
    finally:
        llm.llm_engine.engine_core.shutdown()


class _BatchReader:
    """Reads the build's batches from stdin on a thread of its own, so the next batch is here when
    a generate ends (the build sends it while that generate runs). At the end of stdin the
    batches not yet started are dropped: the build has stopped waiting for them."""

    def __init__(self, stdin):
        self._stdin = stdin
        self._batches: queue.Queue = queue.Queue()
        self._ended = threading.Event()
        self._error: BaseException | None = None
        threading.Thread(target=self._read_all, daemon=True, name="dflash-batches").start()

    def _read_all(self) -> None:
        try:
            while (item := _read(self._stdin))[0] is not None:
                self._batches.put(item)
        except BaseException as err:  # raised in the engine's thread
            self._error = err
        self._ended.set()
        self._batches.put(None)

    def next(self) -> tuple[dict, bytes] | None:
        """The next batch, waiting for it; None once stdin ended."""
        item = self._batches.get()
        if self._error is not None:
            raise self._error
        return None if self._ended.is_set() else item


if __name__ == "__main__":  # vLLM starts its engine in spawned processes that import this file
    main()
