"""The engine pipe's framing: a stream socket carrying MessagePack messages (`messages`), each
as one frame.

Wire format (this module's own): a frame is a 4-byte big-endian unsigned payload length, then
that many bytes of MessagePack, one message. Nothing else travels on the socket.

Contract: `Frames` turns bytes as they arrive, split anywhere, into whole decoded messages
(the HTTP side's asyncio protocol feeds it); `encode` frames a message in one buffer; `Pipe` is
the engine side's blocking end: `send` writes a frame whole, `ready` says without blocking
whether a message waits, `receive` blocks for at least one and returns every whole one that
arrived (None once the other side closed).
"""

from __future__ import annotations

import select
import socket
import struct
from typing import Any

import msgspec

HEADER = struct.Struct("!I")
MAX_FRAME = (1 << 32) - 1
READ_BYTES = 1 << 16


class Encoder:
    """Messages to frames, each encoded once straight after its header (one msgpack encoder a
    side, reused)."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()

    def encode(self, msg: Any) -> bytes:
        buf = bytearray(HEADER.size)
        self._enc.encode_into(msg, buf, HEADER.size)
        n = len(buf) - HEADER.size
        if n > MAX_FRAME:
            raise ValueError(f"a message of {n} bytes does not fit one frame (at most {MAX_FRAME})")
        HEADER.pack_into(buf, 0, n)
        return bytes(buf)


class Frames:
    """Bytes in, whole messages of type `kind` out, whatever the split."""

    def __init__(self, kind: Any) -> None:
        self._dec = msgspec.msgpack.Decoder(kind)
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        buf = self._buf
        buf += data
        out, at, end = [], 0, len(buf)
        while end - at >= HEADER.size:
            (n,) = HEADER.unpack_from(buf, at)
            if end - at - HEADER.size < n:
                break
            start = at + HEADER.size
            out.append(self._dec.decode(memoryview(buf)[start:start + n]))
            at = start + n
        if at:
            del buf[:at]
        return out

    @property
    def pending(self) -> int:
        """Bytes of a message not yet whole."""
        return len(self._buf)


class Pipe:
    """One blocking end of the socket (the engine's): frames out whole, messages of `kind` in."""

    def __init__(self, sock: socket.socket, kind: Any) -> None:
        sock.setblocking(True)
        self.sock, self.frames, self.encoder = sock, Frames(kind), Encoder()
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    def send(self, msg: Any) -> None:
        self.sock.sendall(self.encoder.encode(msg))

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether bytes wait to be read (a message, or the other side's end), waiting for them
        up to `timeout_s`."""
        return bool(self._poll.poll(timeout_s * 1e3))

    def receive(self) -> list[Any] | None:
        """Every whole message that arrived, blocking for the first; None at end of file."""
        while True:
            try:
                data = self.sock.recv(READ_BYTES)
            except OSError:
                return None
            if not data:
                return None
            msgs = self.frames.feed(data)
            if msgs:
                return msgs
