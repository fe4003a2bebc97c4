"""Shared file helpers of the checkpoint formats: bounded JSON, safetensors read and written
with NumPy, value and size checks, content hashes, and the destination rules of writes.

Everything here validates before it allocates: declared lengths are checked against the
bytes present, nesting and integer sizes are bounded, numbers must be finite. Every
failure is a :class:`CheckpointError` naming the file (and the key).

safetensors is read and written here rather than with the ``safetensors`` package: the
reader must refuse what that package accepts (extra header fields, non-finite θ), report
the key at fault, and return the header's metadata from bytes (where xopt keeps its content
hashes); the writer's bytes equal the package's (tests/test_checkpoints.py checks both
against it and against PyLO's own files).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import math
import os
import stat
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from xopt import _json
from xopt.errors import CheckpointError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"

#: largest config file (config.json, config.gin) read, in bytes
MAX_CONFIG_BYTES = 1 << 20
#: largest safetensors header (the format's own limit is 100 MB; θ's headers are ~1 KB)
MAX_HEADER_BYTES = 1 << 24
#: deepest nesting of JSON and msgpack containers accepted (θ's configs use 3)
MAX_DEPTH = 32
#: most dimensions of an array, and the largest single dimension
MAX_NDIM = 32
MAX_DIM = 1 << 40
#: largest integer in a config (JSON or gin); larger is corruption, refused as such
MAX_INT = _json.MAX_INT
#: architecture sizes: far above any published learned optimizer (VeLO: an LSTM 512 wide,
#: 256 MLPs of width 4), small enough that shapes are computed without risk
MAX_WIDTH = 1 << 16
MAX_LAYERS = 64
ARCH_LIMITS = {"hidden_size": MAX_WIDTH, "hidden_layers": MAX_LAYERS,
               "lstm_hidden_size": MAX_WIDTH, "param_inits": MAX_WIDTH,
               "ff_hidden_size": MAX_WIDTH, "ff_hidden_layers": MAX_LAYERS}
_F32_MAX = float(np.finfo(np.float32).max)


# -- reading ---------------------------------------------------------------------------------

_DIGESTS: contextvars.ContextVar[dict[Path, str] | None] = contextvars.ContextVar(
    "xopt_checkpoint_digests", default=None)


@contextlib.contextmanager
def recording_digests() -> Iterator[dict[Path, str]]:
    """Within the block, the SHA-256 of every file read through :func:`read_bytes`, by
    path: the hashes of exactly the bytes a load used."""
    digests: dict[Path, str] = {}
    token = _DIGESTS.set(digests)
    try:
        yield digests
    finally:
        _DIGESTS.reset(token)


def read_bytes(path: str | os.PathLike[str], limit: int | None = None) -> bytes:
    """A regular file's bytes; a missing or unreadable file, anything but a regular file
    (a FIFO or device would never end), or one larger than ``limit`` is a
    :class:`CheckpointError` naming it."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # before open: a FIFO's open blocks
            raise CheckpointError(f"{path}: not a regular file")
        with open(path, "rb") as f:
            data = f.read() if limit is None else f.read(limit + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    if limit is not None and len(data) > limit:
        raise CheckpointError(f"{path}: larger than {limit} bytes; not a checkpoint config")
    digests = _DIGESTS.get()
    if digests is not None:
        digests[Path(path)] = hashlib.sha256(data).hexdigest()
    return data


def parse_json(data: bytes, file: str | os.PathLike[str]) -> Any:
    """Strict JSON from bytes (:func:`xopt._json.loads`): UTF-8, nesting at most
    :data:`MAX_DEPTH`, no duplicate keys, finite numbers, integers within :data:`MAX_INT`."""
    return _json.loads(data, str(file), CheckpointError, max_depth_=MAX_DEPTH)


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON object from a config file (bounded size; see :func:`parse_json`)."""
    doc = parse_json(read_bytes(path, MAX_CONFIG_BYTES), path)
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


# -- safetensors -----------------------------------------------------------------------------

#: safetensors dtype names → NumPy (little-endian, as the format stores them)
_ST_DTYPES = {"BOOL": "|b1", "U8": "|u1", "I8": "|i1", "I16": "<i2", "U16": "<u2",
              "F16": "<f2", "I32": "<i4", "U32": "<u4", "F32": "<f4", "F64": "<f8",
              "I64": "<i8", "U64": "<u8"}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
_ST_UNSUPPORTED = {"BF16": "bfloat16, which NumPy cannot hold; convert the file to float32"}
_ST_FIELDS = {"dtype", "shape", "data_offsets"}
METADATA = "__metadata__"


def shape_of(value: Any, where: str) -> tuple[int, ...]:
    if (not isinstance(value, list) or len(value) > MAX_NDIM
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_DIM
                       for s in value)):
        raise CheckpointError(f"{where}: shape {value!r} is not a list of at most {MAX_NDIM} "
                              "non-negative integers")
    return tuple(value)


def parse_safetensors(data: bytes, file: str | os.PathLike[str]
                      ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``({name: array}, metadata)`` of a safetensors file's bytes, checked in full: the
    header's size, JSON, fields, dtypes and shapes, and offsets that tile the data exactly
    (the format's rules). Arrays are little-endian copies in the file's order."""
    file = str(file)
    if len(data) < 8:
        raise CheckpointError(f"{file}: not a safetensors file ({len(data)} bytes, shorter "
                              "than its 8-byte header length)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise CheckpointError(f"{file}: not a safetensors file (header length {n}, file "
                              f"{len(data)} bytes)")
    header = data[8:8 + n]
    if not header.startswith(b"{"):
        raise CheckpointError(f"{file}: not a safetensors file (header is not a JSON object)")
    doc = parse_json(header, f"{file} (header)")
    if not isinstance(doc, dict):
        raise CheckpointError(f"{file}: header is not a JSON object")
    body = memoryview(data)[8 + n:]
    metadata = doc.pop(METADATA, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{file}: header {METADATA!r} is not a map of strings")
    spans = []
    for name, info in doc.items():
        where = f"{file}: tensor {name!r}"
        if not name:
            raise CheckpointError(f"{file}: a tensor has an empty name")
        if not isinstance(info, dict) or set(info) != _ST_FIELDS:
            got = sorted(info) if isinstance(info, dict) else type(info).__name__
            raise CheckpointError(f"{where}: header entry is {got}, expected the fields "
                                  f"{sorted(_ST_FIELDS)}")
        dt = info["dtype"]
        if dt in _ST_UNSUPPORTED:
            raise CheckpointError(f"{where}: dtype {dt} is {_ST_UNSUPPORTED[dt]}")
        if not isinstance(dt, str) or dt not in _ST_DTYPES:
            raise CheckpointError(f"{where}: unsupported dtype {dt!r}")
        shape = shape_of(info["shape"], where)
        offs = info["data_offsets"]
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
                or not 0 <= offs[0] <= offs[1] <= len(body)):
            raise CheckpointError(f"{where}: data_offsets {offs!r} are not [begin, end] "
                                  f"within the {len(body)} data bytes")
        dtype = np.dtype(_ST_DTYPES[dt])
        if offs[1] - offs[0] != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{where}: {dt} of shape {list(shape)} needs "
                                  f"{math.prod(shape) * dtype.itemsize} bytes, data_offsets "
                                  f"give {offs[1] - offs[0]}")
        spans.append((offs[0], offs[1], name, dtype, shape))
    spans.sort()
    pos = 0
    for begin, end, name, _, _ in spans:
        if begin != pos:
            raise CheckpointError(f"{file}: tensor {name!r} starts at byte {begin} of the "
                                  f"data, expected {pos} (the tensors must tile the data)")
        pos = end
    if pos != len(body):
        raise CheckpointError(f"{file}: the tensors cover {pos} of {len(body)} data bytes")
    tensors = {name: np.frombuffer(body[b:e], dtype=dtype).reshape(shape).copy()
               for b, e, name, dtype, shape in spans}
    return tensors, metadata


def read_safetensors_meta(path: str | os.PathLike[str]
                          ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """:func:`parse_safetensors` of a file."""
    return parse_safetensors(read_bytes(path), path)


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """``{name: array}`` of a safetensors file (see :func:`parse_safetensors`)."""
    return read_safetensors_meta(path)[0]


def safetensors_bytes(tensors: Mapping[str, Any],
                      metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes the ``safetensors`` package writes for these tensors: data ordered by
    dtype (widest first) then name, a compact JSON header in that order after
    ``__metadata__`` (keys sorted: the package keeps a hash map's order), padded with spaces
    to a multiple of 8 bytes."""
    arrays = {}
    for k, v in tensors.items():
        a = np.asarray(v)
        if a.dtype.kind == "f":
            a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        if a.dtype.kind != "f" or a.dtype not in _ST_NAMES:
            raise CheckpointError(f"tensor {k!r} has dtype {a.dtype}; checkpoints hold "
                                  "float16, float32 or float64")
        arrays[k] = a
    order = sorted(arrays, key=lambda k: (-arrays[k].dtype.itemsize, k))
    header: dict[str, Any] = {}
    if metadata:
        header[METADATA] = {k: str(metadata[k]) for k in sorted(metadata)}
    pos = 0
    for k in order:
        a = arrays[k]
        header[k] = {"dtype": _ST_NAMES[a.dtype], "shape": list(a.shape),
                     "data_offsets": [pos, pos + a.nbytes]}
        pos += a.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text] + [arrays[k].tobytes() for k in order])


# -- values ----------------------------------------------------------------------------------


def sha256(data: bytes | np.ndarray) -> str:
    """Hex SHA-256 of bytes, or of an array's little-endian C-order bytes (what a
    safetensors file stores for it)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data, dtype=data.dtype.newbyteorder("<")).tobytes()
    return hashlib.sha256(data).hexdigest()


def check_finite(file: str | os.PathLike[str], key: str, a: np.ndarray) -> None:
    """θ must be finite, and within float32's range (the optimizers compute in float32)."""
    if a.dtype.kind != "f" or a.size == 0:
        return
    finite = np.isfinite(a)
    if not finite.all():
        idx = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise CheckpointError(f"{file}: key {key!r} holds {a[idx].item()} at index {idx} "
                              f"({int((~finite).sum())} non-finite values); learned-"
                              "optimizer weights must be finite")
    if a.dtype.itemsize > 4:
        big = np.abs(a) > _F32_MAX
        if big.any():
            idx = tuple(int(i) for i in np.argwhere(big)[0])
            raise CheckpointError(f"{file}: key {key!r} holds {a[idx].item()!r} at index {idx}, "
                                  "beyond float32's range (the optimizers compute in "
                                  "float32)")


def check_keys(file: str | os.PathLike[str], got: Mapping[str, Any],
               shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Strict: every key of ``shapes`` present with that shape, a floating dtype and finite
    values, and no other key. The error names the file and the key."""
    missing = [k for k in shapes if k not in got]
    if missing:
        raise CheckpointError(f"{file}: missing key(s) {', '.join(map(repr, missing))}")
    extra = sorted(k for k in got if k not in shapes)
    if extra:
        raise CheckpointError(f"{file}: unexpected key(s) {', '.join(map(repr, extra))}; "
                              f"expected {', '.join(shapes)}")
    for k, shape in shapes.items():
        a = got[k]
        if tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"{file}: key {k!r} has shape {tuple(a.shape)}, expected "
                                  f"{tuple(shape)}")
        if a.dtype.kind != "f":
            raise CheckpointError(f"{file}: key {k!r} has dtype {a.dtype}, expected floating")
        check_finite(file, k, a)


def config_int(file: str | os.PathLike[str], config: Mapping[str, Any], key: str,
               maximum: int = MAX_INT) -> int:
    if key not in config:
        raise CheckpointError(f"{file}: missing key {key!r}")
    v = config[key]
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= maximum:
        raise CheckpointError(f"{file}: key {key!r} is {v!r}, expected an integer in "
                              f"[0, {maximum}]")
    return v


def check_arch(where: str | os.PathLike[str], values: Mapping[str, Any] | Any) -> None:
    """The architecture sizes among ``values`` (a mapping or hyperparameters) are integers
    within :data:`ARCH_LIMITS`, so that θ's shapes can be computed safely."""
    for name, limit in ARCH_LIMITS.items():
        if isinstance(values, Mapping):
            if name not in values:
                continue
            v = values[name]
        elif hasattr(values, name):
            v = getattr(values, name)
        else:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= limit:
            raise CheckpointError(f"{where}: {name} = {v!r}; expected an integer in "
                                  f"[0, {limit}]")


# -- writing ---------------------------------------------------------------------------------

#: what a checkpoint directory may hold (any format; ``README.md`` is the Hub's model card)
_CHECKPOINT_ENTRIES = {CONFIG, WEIGHTS, "params", "config.gin", "README.md", ".gitattributes"}
_CHECKPOINT_SUBDIRS = ("rnn", "mlp")


def _foreign_entries(d: Path, prefix: str = "") -> list[str]:
    out = []
    for p in sorted(d.iterdir()):
        if not prefix and p.name in _CHECKPOINT_SUBDIRS and p.is_dir() and not p.is_symlink():
            out += _foreign_entries(p, f"{p.name}/")
        elif p.name not in _CHECKPOINT_ENTRIES or not p.is_file() or p.is_symlink():
            out.append(prefix + p.name)
    return out


def check_destination(final: str | os.PathLike[str], *, overwrite: bool,
                      sources: Iterable[str | os.PathLike[str]] = ()) -> Path:
    """Refuse, before anything is read or written, a destination that cannot be replaced
    safely: ``.``/``..``/the working directory or one above it, a symbolic link, a
    non-directory, a directory that is or contains a ``source``, a non-empty directory
    without ``overwrite``, or one holding files no checkpoint has (``overwrite`` replaces
    the whole directory, so those would be lost)."""
    final = Path(final)
    if final.name in ("", ".", ".."):
        raise CheckpointError(f"{final}: not a checkpoint directory name (write to a new "
                              "directory, e.g. ./ckpt)")
    if final.is_symlink():
        raise CheckpointError(f"{final}: is a symbolic link; xopt does not replace links "
                              "(write to the directory it points to, or remove the link)")
    resolved = final.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise CheckpointError(f"{final}: is the working directory or one above it")
    for src in sources:
        s = Path(src).resolve()
        if resolved == s or resolved in s.parents:
            raise CheckpointError(f"{final}: contains the source checkpoint {src}; write to "
                                  "another directory")
    if final.exists():
        if not final.is_dir():
            raise CheckpointError(f"{final}: exists and is not a directory")
        if any(final.iterdir()):
            if not overwrite:
                raise CheckpointError(f"{final}: exists and is not empty (pass overwrite=True "
                                      "/ --overwrite to replace it)")
            foreign = _foreign_entries(final)
            if foreign:
                raise CheckpointError(
                    f"{final}: holds {', '.join(map(repr, foreign[:5]))}"
                    f"{' ...' if len(foreign) > 5 else ''}, which no checkpoint has; "
                    "overwrite replaces the whole directory, so xopt refuses it")
    return final


def write_file(path: Path, data: bytes | str) -> None:
    """Write and fsync one file (inside a temporary directory of :func:`atomic_dir`)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())


def atomic_dir(final: str | os.PathLike[str], *, overwrite: bool = False,
               sources: Iterable[str | os.PathLike[str]] = ()):
    """:func:`check_destination`, then :func:`xopt._atomic.atomic_directory`."""
    from xopt._atomic import atomic_directory

    check_destination(final, overwrite=overwrite, sources=sources)
    return atomic_directory(final)
