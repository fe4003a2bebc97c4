"""Golden traces: reading, validating and writing the ``xopt-trace/1`` layout.

A trace is a manifest ``<case>.json`` beside an array file ``<case>.npz`` (see
``FORMAT.md`` in the shared parity folder; the layout is summarised here). Step ``t``
counts updates from 0::

    init/param/<name>            parameters before the first update
    init/state/<path>            optimizer state before the first update (where set)
    step_<t>/grad/<name>         gradient given at update t
    step_<t>/loss                loss given at update t (where recorded)
    step_<t>/param/<name>        parameters after update t
    step_<t>/state/<path>        optimizer state after update t, the original's naming
    step_<t>/aux/<path>          internals (injected randomness, debugging)

:func:`load_trace` checks a trace eagerly: the manifest's JSON strictly (UTF-8, bounded
size and nesting, no duplicate keys, finite numbers) and every field's type and range
(:func:`check_manifest`), then, for an optimizer-kind trace, that every array it must have is
present with the declared shape and dtype; an array whose header declares more data than its
zip member holds is refused before anything is allocated. A bad trace fails at load with a
:class:`TraceError` naming the file and the field or key, not halfway through a run (or with
another exception). Writing is atomic and durable: the manifest is checked first, both files
are written to temporary names, fsynced and renamed into place.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from xopt import _json
from xopt._atomic import atomic_path
from xopt.errors import TraceError

TRACE_FORMAT = "xopt-trace/1"
_REQUIRED_MANIFEST_KEYS = ("format", "method", "case", "kind", "source", "hyperparameters",
                           "dtype", "params", "steps")
KINDS = ("optimizer", "layer")
#: bounds on what a manifest may declare (the bundled traces: ≤ 12 KB, ≤ 30 steps)
MAX_MANIFEST_BYTES = 1 << 24
MAX_STEPS = 10_000_000
MAX_NDIM = 32
MAX_DIM = 1 << 31
#: largest array read from a trace's npz (the bundled ones: ≤ 1 MB)
MAX_ARRAY_BYTES = 1 << 30
#: what reading a corrupt npz can raise (zipfile's and numpy's npy reader's own errors)
_NPZ_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError,
               struct.error, zlib.error, NotImplementedError, KeyError)


def step_prefix(t: int) -> str:
    return f"step_{t:04d}"


@dataclasses.dataclass
class Trace:
    """A loaded trace. Arrays are read from the npz on first access and cached."""

    path: Path
    manifest: dict[str, Any]
    _npz: Any = dataclasses.field(repr=False)
    _cache: dict[str, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)

    # -- manifest fields ---------------------------------------------------------------
    @property
    def method(self) -> str:
        return self.manifest["method"]

    @property
    def case(self) -> str:
        return self.manifest["case"]

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def steps(self) -> int:
        return int(self.manifest["steps"])

    @property
    def params(self) -> dict[str, tuple[int, ...]]:
        """Ordered ``{name: shape}`` of the optimizee parameters."""
        return {k: tuple(v) for k, v in self.manifest["params"].items()}

    @property
    def source_object(self) -> str:
        return str(self.manifest["source"].get("object", ""))

    @property
    def hyperparameters(self) -> dict[str, Any]:
        return self.manifest["hyperparameters"]

    @property
    def name(self) -> str:
        return f"{self.method}/{self.case}"

    @property
    def num_training_steps(self) -> int | None:
        """The horizon a learned optimizer was given at init, where the trace records one."""
        n = self.manifest.get("num_training_steps")
        return None if n is None else int(n)

    def meta_params(self) -> dict[str, np.ndarray] | None:
        """The learned optimizer's weights (``meta_params_file``), in the original's naming.

        A file with ``meta_params.base_file`` holds overrides only; the leaves it lacks come
        from the base file. Each file's SHA-256 is checked against the manifest. None for
        traces of methods without meta-parameters.
        """
        rel = self.manifest.get("meta_params_file")
        if rel is None:
            return None
        info = self.manifest.get("meta_params", {})
        theta: dict[str, np.ndarray] = {}
        base = info.get("base_file")
        if base is not None:
            theta.update(_read_meta(self.path.parent / base, info.get("base_sha256"),
                                    self.path))
        theta.update(_read_meta(self.path.parent / rel, info.get("sha256"), self.path))
        return theta

    @property
    def npz_path(self) -> Path:
        return self.path.with_suffix(".npz")

    # -- arrays -----------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._npz.files)

    def has(self, key: str) -> bool:
        return key in self._npz.files

    def array(self, key: str) -> np.ndarray:
        if key not in self._cache:
            if key not in self._npz.files:
                raise TraceError(f"{self.npz_path}: missing array {key!r}")
            _check_member(self._npz, self.npz_path, key)
            try:
                self._cache[key] = self._npz[key]
            except _NPZ_ERRORS as e:
                raise TraceError(f"{self.npz_path}: array {key!r} is unreadable "
                                 f"({type(e).__name__}: {e})") from None
        return self._cache[key]

    def _group(self, prefix: str) -> dict[str, np.ndarray]:
        n = len(prefix)
        return {k[n:]: self.array(k) for k in self._npz.files if k.startswith(prefix)}

    def init_params(self) -> dict[str, np.ndarray]:
        return {p: self.array(f"init/param/{p}") for p in self.params}

    def init_state(self) -> dict[str, np.ndarray]:
        """``init/state/...`` in the original's naming; empty where the original sets none."""
        return self._group("init/state/")

    def grads(self, t: int) -> dict[str, np.ndarray]:
        return {p: self.array(f"{step_prefix(t)}/grad/{p}") for p in self.params}

    def loss(self, t: int) -> float | None:
        key = f"{step_prefix(t)}/loss"
        return float(self.array(key)) if self.has(key) else None

    def params_after(self, t: int) -> dict[str, np.ndarray]:
        return {p: self.array(f"{step_prefix(t)}/param/{p}") for p in self.params}

    def state_after(self, t: int) -> dict[str, np.ndarray]:
        """``step_<t>/state/...`` in the original's naming."""
        return self._group(f"{step_prefix(t)}/state/")

    def aux(self, t: int) -> dict[str, np.ndarray]:
        return self._group(f"{step_prefix(t)}/aux/")

    def close(self) -> None:
        self._npz.close()


def _check_member(npz: Any, path: Path, key: str) -> None:
    """The npy header of ``key`` declares no more data than its zip member holds (and at
    most :data:`MAX_ARRAY_BYTES`), so loading it allocates only what is there."""
    try:
        info = npz.zip.getinfo(f"{key}.npy")
        with npz.zip.open(info) as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"npy format version {version}")
    except _NPZ_ERRORS as e:
        raise TraceError(f"{path}: array {key!r} is unreadable ({type(e).__name__}: {e})"
                         ) from None
    if dtype.hasobject:
        raise TraceError(f"{path}: array {key!r} holds Python objects; traces hold numbers")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > min(info.file_size, MAX_ARRAY_BYTES):
        raise TraceError(f"{path}: array {key!r} declares shape {shape} of {dtype} "
                         f"({nbytes} bytes) but its entry holds {info.file_size} bytes")


def _read_meta(path: Path, sha256: str | None, manifest: Path) -> dict[str, np.ndarray]:
    import hashlib

    where = f"{path}: meta-parameter file (of {manifest})"
    try:
        if not path.is_file() or path.stat().st_size > MAX_ARRAY_BYTES:
            raise TraceError(f"{where} is not a regular file of at most {MAX_ARRAY_BYTES} "
                             "bytes")
        data = path.read_bytes()
    except OSError as e:
        raise TraceError(f"{where} unreadable ({e.strerror or e})") from None
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise TraceError(f"{where}: SHA-256 does not match the manifest's {sha256}")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            for k in z.files:
                _check_member(z, path, k)
            return {k: z[k] for k in z.files}
    except _NPZ_ERRORS as e:
        raise TraceError(f"{where} unreadable ({type(e).__name__}: {e})") from None


def _fail(path: Path, msg: str) -> TraceError:
    return TraceError(f"{path}: {msg}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_path(path: Path, field: str, v: Any) -> None:
    if not isinstance(v, str) or not v or "\x00" in v:
        raise _fail(path, f"{field!r} = {v!r} must be a file path (relative to the "
                          "manifest's folder, or absolute)")


def _check_sha(path: Path, field: str, v: Any) -> None:
    if not isinstance(v, str) or not re.fullmatch(r"[0-9a-f]{64}", v):
        raise _fail(path, f"{field!r} = {v!r} is not a SHA-256 hex digest")


def check_manifest(path: str | os.PathLike[str], m: Any) -> None:
    """Every field of a manifest (FORMAT.md) of the right type and range; the error
    names the file and the field."""
    path = Path(path)
    if not isinstance(m, dict):
        raise _fail(path, f"manifest is a JSON {type(m).__name__}, not an object")
    missing = [k for k in _REQUIRED_MANIFEST_KEYS if k not in m]
    if missing:
        raise _fail(path, f"manifest lacks key(s) {', '.join(missing)}")
    if m["format"] != TRACE_FORMAT:
        raise _fail(path, f"format is {m['format']!r}, expected {TRACE_FORMAT!r}")
    for key in ("method", "case"):
        if not isinstance(m[key], str) or not m[key]:
            raise _fail(path, f"{key!r} = {m[key]!r} must be a non-empty string")
    if m["kind"] not in KINDS:
        raise _fail(path, f"'kind' = {m['kind']!r} must be one of {', '.join(KINDS)}")
    src = m["source"]
    if not isinstance(src, dict):
        raise _fail(path, f"'source' = {src!r} must be an object (repo, commit, object, ...)")
    for key in ("repo", "commit", "object", "device"):
        if key in src and not isinstance(src[key], str):
            raise _fail(path, f"'source.{key}' = {src[key]!r} must be a string")
    if "versions" in src and not isinstance(src["versions"], dict):
        raise _fail(path, f"'source.versions' = {src['versions']!r} must be an object")
    if not isinstance(m["hyperparameters"], dict):
        raise _fail(path, f"'hyperparameters' = {m['hyperparameters']!r} must be an object "
                          "(the original's argument names and values)")
    dtype = m["dtype"]
    try:
        ok = isinstance(dtype, str) and np.dtype(dtype).kind == "f"
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise _fail(path, f"'dtype' = {dtype!r} must name a floating NumPy dtype "
                          "('float32')")
    params = m["params"]
    if not isinstance(params, dict):
        raise _fail(path, f"'params' = {params!r} must be an object name -> shape")
    for name, shape in params.items():
        if (not name or not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(_is_int(s) and 0 <= s <= MAX_DIM for s in shape)):
            raise _fail(path, f"'params' entry {name!r} = {shape!r} must be a shape (a list "
                              f"of at most {MAX_NDIM} non-negative integers)")
    steps = m["steps"]
    if not _is_int(steps) or not 1 <= steps <= MAX_STEPS:
        raise _fail(path, f"'steps' = {steps!r} must be a positive integer (at most "
                          f"{MAX_STEPS})")
    n = m.get("num_training_steps")
    if n is not None and (not _is_int(n) or n < 1):
        raise _fail(path, f"'num_training_steps' = {n!r} must be a positive integer")
    if "meta_params_file" in m:
        _check_path(path, "meta_params_file", m["meta_params_file"])
    if "meta_params" in m:
        info = m["meta_params"]
        if not isinstance(info, dict):
            raise _fail(path, f"'meta_params' = {info!r} must be an object")
        if "base_file" in info:
            _check_path(path, "meta_params.base_file", info["base_file"])
        for key in ("sha256", "base_sha256"):
            if key in info:
                _check_sha(path, f"meta_params.{key}", info[key])
    for key in ("inputs", "outputs"):
        v = m.get(key, [])
        if isinstance(v, list):
            if not all(isinstance(x, str) for x in v):
                raise _fail(path, f"{key!r} must list strings")
        elif not isinstance(v, dict):
            raise _fail(path, f"{key!r} = {v!r} must be a list or an object")
    for key in ("aux", "tolerance_hint", "effective_decays"):
        if key in m and not isinstance(m[key], dict):
            raise _fail(path, f"{key!r} = {m[key]!r} must be an object")


def load_trace(path: str | os.PathLike[str], *, validate: bool = True) -> Trace:
    """Load ``<case>.json`` (or its ``.npz``) and check it against its manifest.

    Raises :class:`TraceError` naming the file and key for: a missing or unreadable file,
    a manifest without a required key or of another format, a parameter whose ``init``,
    ``grad`` or ``param`` array is missing at some step or has a shape other than the
    manifest's, an array of a dtype other than the manifest's.
    """
    path = Path(path)
    if path.suffix == ".npz":
        path = path.with_suffix(".json")
    if not path.is_file():
        raise TraceError(f"{path}: no such trace manifest")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise _fail(path, f"manifest unreadable ({e.strerror or e})") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise _fail(path, f"manifest larger than {MAX_MANIFEST_BYTES} bytes")
    manifest = _json.loads(data, f"{path}: manifest", TraceError)
    check_manifest(path, manifest)
    npz_path = path.with_suffix(".npz")
    if not npz_path.is_file():
        raise TraceError(f"{npz_path}: no such trace array file (manifest {path.name})")
    try:
        npz = np.load(npz_path, allow_pickle=False)
    except _NPZ_ERRORS as e:
        raise TraceError(f"{npz_path}: not a readable .npz ({type(e).__name__}: {e})") from None
    trace = Trace(path=path, manifest=manifest, _npz=npz)
    if validate:
        try:
            _validate(trace)
        except TraceError:
            npz.close()
            raise
    return trace


def _check_array(trace: Trace, key: str, shape: tuple[int, ...], dtype: str | None) -> None:
    arr = trace.array(key)
    if tuple(arr.shape) != tuple(shape):
        raise TraceError(
            f"{trace.npz_path}: array {key!r} has shape {tuple(arr.shape)}, "
            f"manifest says {tuple(shape)}"
        )
    if dtype is not None and arr.dtype != np.dtype(dtype):
        raise TraceError(f"{trace.npz_path}: array {key!r} has dtype {arr.dtype}, "
                         f"manifest says {dtype}")


def _validate(trace: Trace) -> None:
    m = trace.manifest  # types and ranges checked by check_manifest
    if trace.kind != "optimizer":
        # layer traces are validated by their method's harness (a layer may have no
        # parameters: POET's Cayley-Neumann cases record a function's inputs and outputs)
        return
    if not m["params"]:
        raise _fail(trace.path, "'params' must be a non-empty mapping name -> shape")
    dtype = str(np.dtype(m["dtype"]))
    inputs = m.get("inputs", {})
    for p, shape in trace.params.items():
        _check_array(trace, f"init/param/{p}", shape, dtype)
    for t in range(trace.steps):
        pre = step_prefix(t)
        for p, shape in trace.params.items():
            _check_array(trace, f"{pre}/grad/{p}", shape, dtype)
            _check_array(trace, f"{pre}/param/{p}", shape, dtype)
        if "loss" in inputs and not trace.has(f"{pre}/loss"):
            raise TraceError(f"{trace.npz_path}: missing array {pre + '/loss'!r}")


# -- writing ----------------------------------------------------------------------------------


def write_trace(path: str | os.PathLike[str], manifest: Mapping[str, Any],
                arrays: Mapping[str, np.ndarray]) -> Path:
    """Write ``<case>.json`` and ``<case>.npz`` atomically; returns the manifest's path.

    The manifest is checked first (:func:`check_manifest`); nothing is written if it fails.
    """
    path = Path(path).with_suffix(".json")
    check_manifest(path, dict(manifest) if isinstance(manifest, Mapping) else manifest)
    # Both files are complete before either is renamed; the inner one (the npz) is renamed
    # first, so a reader that finds the new manifest finds the arrays it describes.
    with atomic_path(path) as json_tmp, atomic_path(path.with_suffix(".npz")) as npz_tmp:
        with open(npz_tmp, "wb") as f:
            np.savez_compressed(f, **{k: np.asarray(v) for k, v in arrays.items()})
        with open(json_tmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
    return path

