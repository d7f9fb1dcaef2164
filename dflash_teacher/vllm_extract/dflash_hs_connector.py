"""A hidden-states KV connector that hands each finished request's states to the build over a
socket, leaving no files: vLLM loads it by name (`kv_connector_module_path`) in its model-runner
process, next to the `extract_hidden_states` speculative method, which writes the captured layers
into a cache-only KV layer. When a request finishes, its rows are gathered from that layer and sent
as one frame (dflash_frames) to the Unix socket named in `kv_connector_extra_config["dflash_socket"]`
(a Linux abstract address: no file to clean up), keyed by vLLM's request id. Its first frame is
the build's secret (from the environment, SECRET_ENV): the build admits only connections from its
engine's processes that know it.

vLLM's own ExampleHiddenStatesConnector writes safetensors files through pinned memory and CUDA
streams, which CPU builds lack; this one copies on a side stream into pinned memory where there is
CUDA and makes a plain copy elsewhere. Only tensor-parallel rank 0 sends (the states are
replicated across ranks); each data-parallel engine connects on its own.
"""

from __future__ import annotations

import os
import socket
import threading
from functools import partial

import torch
from dflash_frames import SECRET_ENV, frame_header
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _CopiedAlready:
    """What get_finished polls for a CPU copy: done when made (CUDA copies poll a CUDA event)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class DFlashHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._address = self._kv_transfer_config.get_from_extra_config("dflash_socket", None)
        self._secret = os.environ.get(SECRET_ENV, "")
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()  # frames from the writer threads must not interleave

    def wait_for_save(self) -> None:
        pass  # the parent makes lock files here for readers of its files; nothing is written to files

    def request_finished(self, request, block_ids):
        delay, params = super().request_finished(request, block_ids)
        # the request id travels back with the output, so the build can match states to sequences
        return delay, ({"dflash_request": request.request_id} if params is not None else None)

    def _send(self, req_id: str, states: torch.Tensor, copied) -> None:
        copied.synchronize()
        dtype = str(states.dtype).removeprefix("torch.")
        raw = states.view(torch.int16) if states.dtype in (torch.bfloat16, torch.float16) else states
        data = memoryview(raw.contiguous().numpy()).cast("B")
        head = frame_header({"id": req_id, "shape": list(states.shape), "dtype": dtype}, len(data))
        with self._send_lock:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._sock.connect("\0" + self._address)
                self._sock.sendall(frame_header({"secret": self._secret}))
            self._sock.sendall(head)
            self._sock.sendall(data)

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        if self._kv_cache.is_cuda:
            # off the forward's stream, into pinned memory; the writer thread waits on the event
            stream = self._get_copy_stream()
            ready = torch.cuda.Event()
            ready.record()
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                on_device = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device, non_blocking=True),
                                                  num_tokens)
                states = torch.empty_like(on_device, device="cpu", pin_memory=True)
                states.copy_(on_device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        else:
            # advanced indexing already copies; the blocks may be reused once get_finished reports it
            states = extract_from_kv_cache(self._kv_cache, slots, num_tokens)
            copied = _CopiedAlready()
        future = self._executor.submit(self._send, pending.req_id, states, copied)
        self._req_copy_events[pending.req_id] = copied
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
