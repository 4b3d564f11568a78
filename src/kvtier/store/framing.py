"""Frames on the store's control socket: a 4-byte big-endian length, then one msgpack map.

Never pickle: a frame decodes to plain maps, lists, ints, bytes and strings only
(``strict_map_key=False`` only so that int keys survive). A frame may carry file
descriptors as SCM_RIGHTS ancillary data on its first ``sendmsg`` (the pool's memfd).
Frames over :data:`MAX_FRAME` bytes are a protocol error (a peer cannot make us buffer
without bound).
"""

from __future__ import annotations

import array
import socket
import struct
from typing import Any

import msgpack

MAX_FRAME = 64 * 2**20
MAX_FDS = 4
_HEADER = struct.Struct(">I")


class ProtocolError(ConnectionError):
    """The peer sent something that is not a frame of this protocol, or went away."""


def encode(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(body)} bytes over the {MAX_FRAME} limit")
    return _HEADER.pack(len(body)) + body


def send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send one frame (blocking), with ``fds`` as SCM_RIGHTS on its first bytes."""
    data = encode(msg)
    if fds:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sent = sock.sendmsg([data], anc)
        data = data[sent:]
    if data:
        sock.sendall(data)


def decode(body: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types on garbage
        raise ProtocolError(f"undecodable frame: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a frame must be a map")
    return msg


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Receive one frame (blocking) and any descriptors sent with it."""
    fds: list[int] = []
    header = _recv_exact(sock, _HEADER.size, fds)
    (n,) = _HEADER.unpack(header)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes over the {MAX_FRAME} limit")
    return decode(_recv_exact(sock, n, fds)), fds


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = bytearray()
    space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    while len(buf) < n:
        data, anc, _flags, _addr = sock.recvmsg(n - len(buf), space)
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
                fds.extend(a)
        if not data:
            raise ProtocolError("the peer closed the connection")
        buf += data
    return bytes(buf)


class FrameBuffer:
    """Incremental decoding for a non-blocking reader (the store's event loop)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self._buf)
            if n > MAX_FRAME:
                raise ProtocolError(f"frame of {n} bytes over the {MAX_FRAME} limit")
            if len(self._buf) < _HEADER.size + n:
                break
            body = bytes(self._buf[_HEADER.size : _HEADER.size + n])
            del self._buf[: _HEADER.size + n]
            out.append(decode(body))
        return out
