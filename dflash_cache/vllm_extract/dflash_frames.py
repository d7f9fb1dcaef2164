"""The wire format between the build and its vLLM side: a frame is a 4-byte little-endian length,
that many bytes of JSON header, then `header["nbytes"]` bytes of payload (raw array bytes, absent
when 0). Imports nothing but the standard library: both environments read and write it."""

from __future__ import annotations

import json
import struct

LENGTH = struct.Struct("<I")


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


def read_header(read_into) -> dict | None:
    """The next frame's header, or None when the stream ended cleanly between frames."""
    length = bytearray(LENGTH.size)
    if not read_exactly(read_into, memoryview(length)):
        return None
    text = bytearray(LENGTH.unpack(length)[0])
    if not read_exactly(read_into, memoryview(text)):
        raise EOFError("stream ended inside a frame header")
    return json.loads(text)
