"""The wire format between the build and its vLLM side: a frame is a 4-byte little-endian length,
that many bytes of JSON header, then `header["nbytes"]` bytes of payload (raw array bytes, absent
when 0). Imports nothing but the standard library: both environments read and write it.

Every read is bounded by its reader: a header longer than `limit` bytes, or one that is not a JSON
object, is refused before anything is allocated for it, so a peer that is not ours (a stray
program given as --vllm-python, a local process connecting to the state socket) cannot make the
build allocate what its first bytes claim."""

from __future__ import annotations

import json
import struct

LENGTH = struct.Struct("<I")
HEADER_LIMIT = 4096
"""Longest header a reader accepts unless it says otherwise (the state frames' are ~100 bytes)."""
WORKER_MAGIC = b"DFLASH-VLLM-WORKER/1\n"
"""First bytes extract_worker.py writes on its protocol stream: what the build reads before any frame."""
SECRET_ENV = "DFLASH_HS_SECRET"
"""Environment variable carrying the build's random secret to the connector (never argv: argv is
readable by every user in /proc; a process's environment only by its own user)."""


class FrameError(ValueError):
    """Bytes that are not a frame of this format (or one larger than the reader allows)."""


def frame_header(header: dict, nbytes: int = 0) -> bytes:
    text = json.dumps({**header, "nbytes": int(nbytes)}).encode()
    return LENGTH.pack(len(text)) + text


def read_exactly(read_into, view: memoryview) -> bool:
    """Fill `view` with `read_into` (a socket's recv_into or a file's readinto); False at a clean
    end of stream before the first byte, EOFError when it ends in the middle."""
    got = 0
    while got < len(view):
        n = read_into(view[got:])
        if not n:
            if got == 0:
                return False
            raise EOFError(f"stream ended {len(view) - got} bytes short of a frame")
        got += n
    return True


def read_header(read_into, limit: int = HEADER_LIMIT) -> dict | None:
    """The next frame's header (a JSON object with an integer `nbytes` >= 0), or None when the
    stream ended cleanly between frames; FrameError for anything else, before reading past it."""
    length = bytearray(LENGTH.size)
    if not read_exactly(read_into, memoryview(length)):
        return None
    size = LENGTH.unpack(length)[0]
    if size > limit:
        raise FrameError(f"a frame header of {size} bytes (at most {limit} expected; first bytes {bytes(length)!r})")
    text = bytearray(size)
    if not read_exactly(read_into, memoryview(text)):
        raise EOFError("stream ended inside a frame header")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise FrameError(f"a frame header that is not JSON ({type(err).__name__})") from None
    nbytes = header.get("nbytes") if isinstance(header, dict) else None
    if type(nbytes) is not int or nbytes < 0:
        raise FrameError("a frame header that is not an object with a byte count")
    return header
