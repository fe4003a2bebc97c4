"""The msgpack subset of flax's checkpoints, read strictly and written byte-exactly.

Written here rather than with the ``msgpack`` package because a checkpoint reader must be
stricter than a general decoder: msgpack-python keeps the last of two equal map keys,
accepts non-string keys and nests up to 1024 levels, and its errors are of many types.
This decoder bounds nesting (:data:`xopt.checkpoints._files.MAX_DEPTH`), checks every
declared length against the bytes left before taking it, refuses duplicate and non-string
map keys, invalid UTF-8, unused type bytes and trailing data, and raises only
:class:`MsgpackError` with the byte offset. The encoder writes what msgpack-python's
``packb(..., use_bin_type=True)`` writes (the smallest form of every value), so
learned_optimization's files round-trip byte for byte; tests compare both with the
package.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from xopt.checkpoints._files import MAX_DEPTH


class ExtType(NamedTuple):
    """A msgpack extension value (flax: code 1 is a NumPy array)."""

    code: int
    data: bytes


class MsgpackError(ValueError):
    """Malformed or unsupported msgpack; the message gives the byte offset."""


_FIXED = {0xca: ">f", 0xcb: ">d", 0xcc: ">B", 0xcd: ">H", 0xce: ">I", 0xcf: ">Q",
          0xd0: ">b", 0xd1: ">h", 0xd2: ">i", 0xd3: ">q"}
_LEN = {1: ">B", 2: ">H", 4: ">I"}


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.pos = 0

    def fail(self, msg: str, at: int | None = None) -> MsgpackError:
        return MsgpackError(f"{msg} at byte {self.pos if at is None else at}")

    def take(self, n: int, what: str) -> memoryview:
        if n > len(self.data) - self.pos:
            raise self.fail(f"{what} declares {n} bytes but {len(self.data) - self.pos} "
                            "remain")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, n: int, what: str) -> int:
        # every element takes at least one byte: a larger count cannot be honest
        if n > len(self.data) - self.pos:
            raise self.fail(f"{what} declares {n} elements but {len(self.data) - self.pos} "
                            "bytes remain")
        return n

    def string(self, n: int) -> str:
        start = self.pos
        raw = self.take(n, "string")
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"string is not UTF-8 ({e.reason})", start) from None

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise self.fail(f"containers nested deeper than {MAX_DEPTH} levels")
        start = self.pos
        b = self.unpack(">B", "type byte")
        if b <= 0x7f:
            return b
        if b >= 0xe0:
            return b - 0x100
        if 0x80 <= b <= 0x8f:
            return self.map(b & 0x0f, depth)
        if 0x90 <= b <= 0x9f:
            return self.array(b & 0x0f, depth)
        if 0xa0 <= b <= 0xbf:
            return self.string(b & 0x1f)
        if b == 0xc0:
            return None
        if b in (0xc2, 0xc3):
            return b == 0xc3
        if b in _FIXED:
            return self.unpack(_FIXED[b], "number")
        if b in (0xc4, 0xc5, 0xc6):
            n = self.unpack(_LEN[1 << (b - 0xc4)], "bin length")
            return bytes(self.take(n, "bin"))
        if b in (0xd9, 0xda, 0xdb):
            return self.string(self.unpack(_LEN[1 << (b - 0xd9)], "str length"))
        if b in (0xdc, 0xdd):
            return self.array(self.unpack(_LEN[2 << (b - 0xdc)], "array length"), depth)
        if b in (0xde, 0xdf):
            return self.map(self.unpack(_LEN[2 << (b - 0xde)], "map length"), depth)
        if 0xd4 <= b <= 0xd8:
            n = 1 << (b - 0xd4)
            code = self.unpack(">b", "ext type")
            return ExtType(code, bytes(self.take(n, "ext")))
        if b in (0xc7, 0xc8, 0xc9):
            n = self.unpack(_LEN[1 << (b - 0xc7)], "ext length")
            code = self.unpack(">b", "ext type")
            return ExtType(code, bytes(self.take(n, "ext")))
        raise self.fail(f"byte 0x{b:02x} is not a msgpack type", start)

    def array(self, n: int, depth: int) -> list[Any]:
        return [self.value(depth + 1) for _ in range(self.count(n, "array"))]

    def map(self, n: int, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for _ in range(self.count(n, "map")):
            at = self.pos
            key = self.value(depth + 1)
            if not isinstance(key, str):
                raise self.fail(f"map key is a {type(key).__name__}, not a string", at)
            if key in out:
                raise self.fail(f"map key {key!r} appears twice", at)
            out[key] = self.value(depth + 1)
        return out


def unpackb(data: bytes) -> Any:
    """Decode one msgpack value that fills ``data`` exactly; maps become dicts with string
    keys, arrays lists, extension values :class:`ExtType`."""
    r = _Reader(data)
    out = r.value(0)
    if r.pos != len(data):
        raise r.fail(f"{len(data) - r.pos} bytes of trailing data")
    return out


def _head(out: list[bytes], n: int, fix: tuple[int, int] | None, codes: tuple[int, ...],
          what: str) -> None:
    """The smallest header for a length ``n``: a fix-form byte, else 8/16/32-bit."""
    if fix is not None and n <= fix[1]:
        out.append(bytes([fix[0] | n]))
        return
    for code, fmt, limit in zip(codes, (">B", ">H", ">I")[3 - len(codes):],
                                (0xff, 0xffff, 0xffffffff)[3 - len(codes):], strict=True):
        if n <= limit:
            out.append(bytes([code]) + struct.pack(fmt, n))
            return
    raise MsgpackError(f"{what} of length {n} is too long for msgpack")


def _pack(obj: Any, out: list[bytes]) -> None:
    if obj is None:
        out.append(b"\xc0")
    elif obj is True or obj is False:
        out.append(b"\xc3" if obj else b"\xc2")
    elif isinstance(obj, int):
        if 0 <= obj <= 0x7f or -32 <= obj < 0:
            out.append(struct.pack(">b" if obj < 0 else ">B", obj))
        elif obj >= 0:
            for code, fmt, limit in ((0xcc, ">B", 0xff), (0xcd, ">H", 0xffff),
                                     (0xce, ">I", 0xffffffff), (0xcf, ">Q", (1 << 64) - 1)):
                if obj <= limit:
                    out.append(bytes([code]) + struct.pack(fmt, obj))
                    break
            else:
                raise MsgpackError(f"integer {obj} is too large for msgpack")
        else:
            for code, fmt, limit in ((0xd0, ">b", 1 << 7), (0xd1, ">h", 1 << 15),
                                     (0xd2, ">i", 1 << 31), (0xd3, ">q", 1 << 63)):
                if obj >= -limit:
                    out.append(bytes([code]) + struct.pack(fmt, obj))
                    break
            else:
                raise MsgpackError(f"integer {obj} is too small for msgpack")
    elif isinstance(obj, float):
        out.append(b"\xcb" + struct.pack(">d", obj))
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        _head(out, len(raw), (0xa0, 31), (0xd9, 0xda, 0xdb), "string")
        out.append(raw)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        raw = bytes(obj)
        _head(out, len(raw), None, (0xc4, 0xc5, 0xc6), "bin")
        out.append(raw)
    elif isinstance(obj, ExtType):
        n = len(obj.data)
        fixext = {1: 0xd4, 2: 0xd5, 4: 0xd6, 8: 0xd7, 16: 0xd8}
        if n in fixext:
            out.append(bytes([fixext[n]]))
        else:
            _head(out, n, None, (0xc7, 0xc8, 0xc9), "ext")
        out.append(struct.pack(">b", obj.code) + obj.data)
    elif isinstance(obj, (list, tuple)):
        _head(out, len(obj), (0x90, 15), (0xdc, 0xdd), "array")
        for x in obj:
            _pack(x, out)
    elif isinstance(obj, dict):
        _head(out, len(obj), (0x80, 15), (0xde, 0xdf), "map")
        for k, v in obj.items():
            _pack(k, out)
            _pack(v, out)
    else:
        raise MsgpackError(f"cannot pack a {type(obj).__name__}")


def packb(obj: Any) -> bytes:
    """Encode ``obj`` (None, bool, int, float, str, bytes, list/tuple, dict, ExtType)."""
    out: list[bytes] = []
    _pack(obj, out)
    return b"".join(out)
