"""Shared file helpers of the checkpoint formats: strict safetensors and JSON reading, key
checks, and atomic directory writes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from xopt.errors import CheckpointError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """``{name: array}`` of a safetensors file; corruption is a :class:`CheckpointError`
    naming the file (never safetensors' own exception)."""
    from safetensors.numpy import load

    data = read_bytes(path)
    try:
        tensors = load(data)
    except Exception as e:  # noqa: BLE001 - SafetensorError, ValueError, TypeError, ...
        raise CheckpointError(f"{path}: not a valid safetensors file "
                              f"({type(e).__name__}: {e})") from None
    return {k: np.array(v) for k, v in tensors.items()}


def safetensors_bytes(tensors: Mapping[str, Any]) -> bytes:
    from safetensors.numpy import save

    return save({k: np.ascontiguousarray(np.asarray(v)) for k, v in tensors.items()})


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    data = read_bytes(path)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def check_keys(file: str | os.PathLike[str], got: Mapping[str, Any],
               shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Strict: every key of ``shapes`` present with that shape and a floating dtype, and no
    other key. The error names the file and the key."""
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


def config_int(file: str | os.PathLike[str], config: Mapping[str, Any], key: str) -> int:
    if key not in config:
        raise CheckpointError(f"{file}: missing key {key!r}")
    v = config[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise CheckpointError(f"{file}: key {key!r} is {v!r}, expected a non-negative integer")
    return v


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike[str], *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``final``; on success it becomes ``final``.

    A failure leaves nothing behind and ``final`` as it was. An existing ``final`` is an
    error unless ``overwrite``; then it is replaced (moved aside, the new one renamed in,
    the old one deleted), so a reader sees the old directory or the new one.
    """
    final = Path(final)
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"{final}: exists and is not a directory")
    if final.exists() and not overwrite and any(final.iterdir()):
        raise CheckpointError(f"{final}: exists and is not empty (pass overwrite=True to "
                              "replace it)")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        yield tmp
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old",
                                        dir=final.parent))
            os.rmdir(old)
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(old, final)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_file(path: Path, data: bytes | str) -> None:
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(path, mode, **({} if isinstance(data, bytes) else {"encoding": "utf-8"})) as f:
        f.write(data)
