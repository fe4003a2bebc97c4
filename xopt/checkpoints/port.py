"""``xopt port``: convert a learned-optimizer checkpoint between formats, and check the
conversion by behaviour.

:func:`verify` runs the optimizer described by the source and the one described by the
written checkpoint (read back) on the same synthetic trace (seeded gradients and losses on
tensors of rank 0 to 3, NumPy float32, the spec's own step) and compares every parameter
and state tensor at every step bit for bit. Both runs use one implementation, so any
difference comes from θ or the hyperparameters, i.e. from the port; a NaN or inf in either
run counts as a difference (θ is finite, so a non-finite output means the optimizer is not
usable as ported). What the destination format cannot store (PyLO: small_fc_lopt's decay
offsets and the non-architecture hyperparameters) is taken from the source when reading it
back, and the report says so.

The SHA-256 of every source file read is in :attr:`PortResult.source`; an xopt-format
destination records it in its ``config.json``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from xopt import checkpoints as C
from xopt.errors import CheckpointError

#: synthetic trace: parameter shapes (a scalar, a vector, matrices, a rank-3 tensor)
TRACE_SHAPES = {"scalar": (), "bias": (5,), "square": (4, 4), "wide": (3, 7),
                "cube": (2, 3, 4)}
TRACE_STEPS = 5


@dataclasses.dataclass
class PortResult:
    src_format: str
    dst_format: str
    method: str
    dst: Path
    notes: list[str]
    max_abs_diff: float | None = None  # None: not verified
    #: ``{"format": ..., "sha256": {file: digest}}`` of the source files that were read
    source: dict[str, Any] = dataclasses.field(default_factory=dict)


def _not_stored(method: str, hp: Any, theta: Mapping[str, Any], fmt: str
                ) -> tuple[dict[str, Any], list[str]]:
    """Keyword arguments for :func:`C.load` that supply what ``fmt`` does not store."""
    if fmt != "pylo":
        if fmt == "learned_optimization":
            extra = {f.name: getattr(hp, f.name) for f in dataclasses.fields(hp)
                     if f.name in ("num_training_steps", "lr", "weight_decay",
                                   "weight_decay_mode", "max_training_steps")}
            return extra, ["training options (num_training_steps, lr, weight_decay, ...) "
                           "are not part of a learned_optimization checkpoint"]
        return {}, []
    from xopt.checkpoints import learned_optimization as lo

    arch = {"small_fc_lopt": ("hidden_layers", "hidden_size"),
            "mulo": ("hidden_layers", "hidden_size"),
            "velo": ("lstm_hidden_size", "param_inits", "ff_hidden_size",
                     "ff_hidden_layers")}[method]
    kw = {f.name: getattr(hp, f.name) for f in dataclasses.fields(hp) if f.name not in arch}
    notes = ["PyLO stores only the architecture; the other hyperparameters "
             f"({', '.join(n for n in kw if n in lo.CLASSES[lo.METHOD_CLASS[method]][1])}, "
             "training options) must be given when loading it"]
    if method in ("small_fc_lopt", "mulo"):
        kw["method"] = method  # (PyLO's MetaMLP serves both)
        kw["decays"] = {k.split("/")[1]: np.asarray(v) for k, v in theta.items()
                        if k.startswith("decays/")}
        notes.append("PyLO does not store the decay offsets (θ decays/*): pass them to "
                     "AdafacLO_naive (momentum_decays=..., rms_decays=..., "
                     "adafactor_decays=...): "
                     + "; ".join(f"{k}={np.asarray(v).tolist()}" for k, v in kw["decays"].items()))
    return kw, notes


def _run(method: str, hp: Any, theta: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
    from xopt import specs

    spec = specs.get(method)
    if getattr(hp, "num_training_steps", 0) is None:
        hp = dataclasses.replace(hp, num_training_steps=100)
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in TRACE_SHAPES.items()}
    meta = {k: np.asarray(v) for k, v in theta.items()}
    state = spec.init_state(hp, params, xp=np, meta=meta)
    out = []
    for t in range(TRACE_STEPS):
        grads = {k: (0.1 * rng.standard_normal(s)).astype(np.float32)
                 for k, s in TRACE_SHAPES.items()}
        loss = np.float32(2.0 / (t + 1))
        params, state = spec.step(hp, params, state, grads, xp=np, loss=loss, meta=meta)
        out.append({**{f"param/{k}": np.asarray(v) for k, v in params.items()},
                    **{f"state/{k}": np.asarray(v) for k, v in state.items()}})
    return out


def _max_diff(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> float:
    worst = 0.0
    for sa, sb in zip(a, b, strict=True):
        if set(sa) != set(sb):
            return float("inf")
        for k in sa:
            x, y = np.asarray(sa[k], np.float64), np.asarray(sb[k], np.float64)
            if x.shape != y.shape:
                return float("inf")
            if not (np.isfinite(x).all() and np.isfinite(y).all()):
                return float("inf")
            if not (x == y).all():
                worst = max(worst, float(np.max(np.abs(x - y))))
    return worst


def port(src: str | os.PathLike[str], dst: str | os.PathLike[str], to: str = "xopt", *,
         verify: bool = False, overwrite: bool = False, decays: Any = None,
         overrides: Mapping[str, Any] | None = None, method: str | None = None) -> PortResult:
    """Read ``src`` (format detected), write ``dst`` in format ``to`` atomically, and with
    ``verify`` compare the two on a synthetic trace (see the module docstring). ``method``:
    the method ``src`` must hold (for a PyLO ``MetaMLP``: ``"mulo"`` reads it as μLO's).

    ``dst`` is checked first (:func:`xopt.checkpoints.save`'s rules; it may not contain
    ``src``), so a refused destination reads and writes nothing."""
    from xopt.checkpoints import _files

    dst_fmt = C._format_name(to)
    src_dir = C._dir_of(src)
    _files.check_destination(dst, overwrite=overwrite, sources=[src_dir])
    src_fmt = C.detect(src)
    overrides = dict(overrides or {})
    with _files.recording_digests() as digests:
        if src_fmt == "learned_optimization":
            if decays is not None:
                raise CheckpointError(f"{src}: decays= is only for PyLO checkpoints")
            want = method
            method, hp, theta, gen_id, step = C.load_learned_optimization(src, **overrides)
            if want is not None and want != method:
                raise CheckpointError(f"{src}: holds a {method} checkpoint, not {want}")
        else:
            method, hp, theta = C.load(src, decays=decays, method=method, **overrides)
            gen_id, step = "", 0
    source = {"format": src_fmt, "sha256": {
        (p.relative_to(src_dir).as_posix() if p.is_relative_to(src_dir) else str(p)): h
        for p, h in sorted(digests.items())}}
    C.save(dst, method, hp, theta, dst_fmt, overwrite=overwrite, gen_id=gen_id, step=step,
           source=source, protect=[src_dir])
    kw, notes = _not_stored(method, hp, theta, dst_fmt)
    result = PortResult(src_fmt, dst_fmt, method, Path(dst), notes, source=source)
    if verify:
        m2, hp2, theta2 = C.load(dst, **kw)
        if m2 != method:
            result.max_abs_diff = float("inf")
            return result
        with np.errstate(all="ignore"):  # overflow is reported below, not warned about
            ran = _run(method, hp, theta), _run(m2, hp2, theta2)
        for which, steps in zip(("source", "written"), ran, strict=True):
            if not all(np.isfinite(v).all() for step in steps for v in step.values()):
                result.notes.append(f"the synthetic trace gives NaN or inf with the {which} "
                                    "checkpoint's θ (not usable as it stands)")
        result.max_abs_diff = _max_diff(*ran)
        if hp2 != hp:
            result.notes.append(f"hyperparameters differ after the round trip: {hp} vs {hp2}")
            result.max_abs_diff = float("inf")
    return result
