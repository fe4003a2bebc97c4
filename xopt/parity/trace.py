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

:func:`load_trace` checks a trace eagerly against its manifest: every array an
optimizer-kind trace must have is present with the declared shape, so a bad trace fails
at load with the file and the key in the message, not halfway through a run. Writing is
atomic: both files are written to temporary names and renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from xopt._atomic import atomic_path
from xopt.errors import TraceError

TRACE_FORMAT = "xopt-trace/1"
_REQUIRED_MANIFEST_KEYS = ("format", "method", "case", "kind", "source", "hyperparameters",
                           "dtype", "params", "steps")


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
            theta.update(_read_meta(self.path.parent / base, info.get("base_sha256")))
        theta.update(_read_meta(self.path.parent / rel, info.get("sha256")))
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
            try:
                self._cache[key] = self._npz[key]
            except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
                raise TraceError(f"{self.npz_path}: array {key!r} is unreadable ({e})") from e
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


def _read_meta(path: Path, sha256: str | None) -> dict[str, np.ndarray]:
    import hashlib

    try:
        data = path.read_bytes()
    except OSError as e:
        raise TraceError(f"{path}: meta-parameter file unreadable ({e})") from e
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise TraceError(f"{path}: SHA-256 does not match the manifest's {sha256}")
    try:
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise TraceError(f"{path}: meta-parameter file unreadable ({e})") from e


def _fail(path: Path, msg: str) -> TraceError:
    return TraceError(f"{path}: {msg}")


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
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(path, f"manifest is not valid JSON ({e})") from e
    if not isinstance(manifest, dict):
        raise _fail(path, "manifest is not a JSON object")
    missing = [k for k in _REQUIRED_MANIFEST_KEYS if k not in manifest]
    if missing:
        raise _fail(path, f"manifest lacks key(s) {', '.join(missing)}")
    if manifest["format"] != TRACE_FORMAT:
        raise _fail(path, f"format is {manifest['format']!r}, expected {TRACE_FORMAT!r}")
    npz_path = path.with_suffix(".npz")
    if not npz_path.is_file():
        raise TraceError(f"{npz_path}: no such trace array file (manifest {path.name})")
    try:
        npz = np.load(npz_path, allow_pickle=False)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise TraceError(f"{npz_path}: not a readable .npz ({e})") from e
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
    m = trace.manifest
    if not isinstance(m["steps"], int) or m["steps"] < 1:
        raise _fail(trace.path, f"'steps' = {m['steps']!r} must be a positive integer")
    if trace.kind != "optimizer":
        # layer traces are validated by their method's harness (a layer may have no
        # parameters: POET's Cayley-Neumann cases record a function's inputs and outputs)
        if not isinstance(m["params"], Mapping):
            raise _fail(trace.path, "'params' must be a mapping name -> shape")
        return
    if not isinstance(m["params"], Mapping) or not m["params"]:
        raise _fail(trace.path, "'params' must be a non-empty mapping name -> shape")
    try:
        dtype = str(np.dtype(m["dtype"]))
    except TypeError as e:
        raise _fail(trace.path, f"'dtype' = {m['dtype']!r} is not a dtype") from e
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

    The manifest is checked for the required keys first; nothing is written if it fails.
    """
    path = Path(path).with_suffix(".json")
    missing = [k for k in _REQUIRED_MANIFEST_KEYS if k not in manifest]
    if missing:
        raise TraceError(f"{path}: manifest lacks key(s) {', '.join(missing)}")
    # Both files are complete before either is renamed; the inner one (the npz) is renamed
    # first, so a reader that finds the new manifest finds the arrays it describes.
    with atomic_path(path) as json_tmp, atomic_path(path.with_suffix(".npz")) as npz_tmp:
        with open(npz_tmp, "wb") as f:
            np.savez_compressed(f, **{k: np.asarray(v) for k, v in arrays.items()})
        with open(json_tmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
    return path

