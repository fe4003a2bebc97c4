"""Learned-optimizer checkpoints in three formats, read and written with NumPy alone.

* ``"learned_optimization"`` (alias ``"lo"``): a directory with ``config.gin`` and the
  flax-msgpack ``params`` (:mod:`xopt.checkpoints.learned_optimization`);
* ``"pylo"``: PyLO's Hugging Face layout, ``config.json`` + ``model.safetensors`` for
  small_fc_lopt's ``MetaMLP``, or ``rnn/`` + ``mlp/`` holding those of VeLO's ``VeLORNN`` and
  ``VeLOMLP`` (:mod:`xopt.checkpoints.pylo`; read its docstring for what PyLO does not store);
* ``"xopt"``: ``config.json`` with the spec's hyperparameters + ``model.safetensors`` with
  canonical names (:mod:`xopt.checkpoints.xopt_format`).

>>> method, hp, theta = load("ckpt_dir")              # any format, detected
>>> save("out", method, hp, theta, format="pylo")     # atomic; strict about θ's keys

Every failure is a :class:`xopt.errors.CheckpointError` naming the file (and the key):
a missing, extra or misshaped key, a corrupt msgpack or safetensors file, a NaN, inf or
out-of-range value in θ or a config, a size beyond :mod:`xopt.checkpoints._files`'s bounds,
an unsupported optimizer class, a directory in no known format; xopt's own format also
verifies the content hash of every tensor and of its config. Nothing is built before the
whole checkpoint is validated. Writes are atomic and durable (a temporary directory beside
the destination, fsynced, renamed into place; leftovers of a killed write are removed by the
next write): the directory appears complete or not at all, and an existing one is untouched
unless the write succeeds. A destination that is a link, not a directory, ``.``, holds the
source, or holds files no checkpoint has is refused (:func:`save`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xopt.checkpoints import _files, pylo, xopt_format
from xopt.checkpoints import learned_optimization as lo
from xopt.errors import CheckpointError, XoptError

__all__ = ["FORMATS", "detect", "load", "save"]

FORMATS = ("learned_optimization", "pylo", "xopt")
_ALIASES = {"lo": "learned_optimization"}


def _format_name(name: str) -> str:
    name = _ALIASES.get(name, name)
    if name not in FORMATS:
        raise CheckpointError(f"unknown checkpoint format {name!r}; known: "
                              f"{', '.join(FORMATS)} (or 'lo')")
    return name


def _dir_of(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if p.is_file() and p.name == lo.PARAMS_FILE:  # opt_from_checkpoint's <dir>/params
        return p.parent
    return p


def detect(path: str | os.PathLike[str]) -> str:
    """The format of the checkpoint at ``path``: ``"learned_optimization"``, ``"pylo"`` or
    ``"xopt"``. A directory in none of them is a :class:`CheckpointError` naming it."""
    d = _dir_of(path)
    if not d.is_dir():
        what = "not a directory" if d.exists() else "no such checkpoint directory"
        raise CheckpointError(f"{path}: {what}")
    if (d / lo.PARAMS_FILE).is_file():
        if not (d / lo.GIN_FILE).is_file():
            raise CheckpointError(f"{d}: has a learned_optimization 'params' file but no "
                                  f"{lo.GIN_FILE} (which names the optimizer class)")
        return "learned_optimization"
    if (d / _files.CONFIG).is_file():
        config = _files.read_json(d / _files.CONFIG)
        if xopt_format.is_xopt_config(config):
            return "xopt"
        if "format" in config:
            raise CheckpointError(f"{d / _files.CONFIG}: key 'format' is "
                                  f"{config['format']!r}; xopt reads {xopt_format.FORMAT!r} "
                                  "(an xopt checkpoint of another version, or a corrupt one)")
        if (d / _files.WEIGHTS).is_file():
            return "pylo"
    if all((d / sub / _files.CONFIG).is_file() for sub in (pylo.RNN_DIR, pylo.MLP_DIR)):
        return "pylo"
    raise CheckpointError(
        f"{d}: in no known checkpoint format (expected learned_optimization's params + "
        f"config.gin, config.json + model.safetensors (PyLO or xopt), or PyLO VeLO's "
        f"{pylo.RNN_DIR}/ and {pylo.MLP_DIR}/)")


def _replace(hp: Any, overrides: Mapping[str, Any], where: Path) -> Any:
    import dataclasses

    if not overrides:
        return hp
    try:
        hp = dataclasses.replace(hp, **overrides)
    except TypeError as e:
        raise CheckpointError(f"{where}: bad hyperparameter override ({e})") from None
    _files.check_arch(f"{where}: overrides", hp)
    return hp


def load_learned_optimization(path: str | os.PathLike[str], **overrides: Any
                              ) -> tuple[str, Any, dict[str, np.ndarray], str, int]:
    """``(method, hp, θ canonical, gen_id, step)`` of a learned_optimization directory."""
    from xopt import specs

    d = _dir_of(path)
    gin_file, params_file = d / lo.GIN_FILE, d / lo.PARAMS_FILE
    cls, kwargs = lo.read_gin(gin_file)
    method, hp = lo.hparams_from_gin(cls, kwargs, str(gin_file))
    hp = _replace(hp, overrides, d)
    theta_orig, gen_id, step = lo.read_params(params_file)
    try:
        theta = specs.get(method).meta.from_original(theta_orig, hp)
    except XoptError as e:
        raise CheckpointError(f"{params_file}: {e}") from None
    return method, hp, {k: np.asarray(v) for k, v in theta.items()}, gen_id, step


def load(path: str | os.PathLike[str], *, decays: Any = None, method: str | None = None,
         **overrides: Any) -> tuple[str, Any, dict[str, np.ndarray]]:
    """``(method, hyperparameters, θ with canonical names as float NumPy arrays)`` of the
    checkpoint at ``path`` (format detected).

    ``overrides`` replace hyperparameter fields (``num_training_steps=1000``); for a PyLO
    checkpoint they supply what PyLO does not store (``step_mult=0.01``), and ``decays`` the
    small_fc_lopt decay offsets PyLO does not store (a mapping, or ``"pylo-defaults"``; see
    :mod:`xopt.checkpoints.pylo`). ``decays`` is an error for the other formats, which hold
    them. ``method`` is the method the checkpoint must hold; for a PyLO ``MetaMLP``, which
    small_fc_lopt and μLO share, it chooses (``"mulo"``; default small_fc_lopt).
    """
    fmt = detect(path)
    d = _dir_of(path)
    out = _load(fmt, d, decays, method, overrides)
    if method is not None and out[0] != method:
        raise CheckpointError(f"{d}: holds a {out[0]} checkpoint, not {method}")
    return out


def _load(fmt: str, d: Path, decays: Any, method: str | None,
          overrides: Mapping[str, Any]) -> tuple[str, Any, dict[str, np.ndarray]]:
    if fmt != "pylo" and decays is not None:
        raise CheckpointError(f"{d}: decays= is only for PyLO checkpoints; this "
                              f"{fmt} checkpoint stores them")
    if fmt == "learned_optimization":
        method, hp, theta, _, _ = load_learned_optimization(d, **overrides)
        return method, hp, theta
    if fmt == "xopt":
        return xopt_format.read(d, **overrides)
    try:
        if (d / _files.CONFIG).is_file():
            config = _files.read_json(d / _files.CONFIG)
            if "lstm_hidden_size" in config or "param_inits" in config:
                raise CheckpointError(
                    f"{d}: a single PyLO VeLO module (VeLORNN or VeLOMLP); VeLO needs a "
                    f"directory holding both as {pylo.RNN_DIR}/ and {pylo.MLP_DIR}/")
            which = method if method in pylo.METAMLP_METHODS else "small_fc_lopt"
            hp, theta = pylo.read_small_fc(d, decays=decays, method=which, **overrides)
            return which, hp, theta
        if decays is not None:
            raise CheckpointError(f"{d}: decays= is for small_fc_lopt (MetaMLP) checkpoints; "
                                  "this is VeLO")
        hp, theta = pylo.read_velo(d, **overrides)
        return "velo", hp, theta
    except CheckpointError:
        raise
    except XoptError as e:
        raise CheckpointError(f"{d}: {e}") from None


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def files(method: str, hp: Any, theta: Mapping[str, Any], format: str = "xopt", *,
          gen_id: str = "", step: int = 0, source: Mapping[str, Any] | None = None
          ) -> dict[str, bytes | str]:
    """``{relative file name: contents}`` of a checkpoint, without writing anything; θ in
    either naming (strict, finite). ``source`` (``{"format", "sha256": {file: digest}}``,
    what :func:`source_digests` gives) is recorded by the xopt format only."""
    from xopt import specs

    fmt = _format_name(format)
    try:
        spec = specs.get(method)
    except XoptError as e:
        raise CheckpointError(str(e)) from None
    if spec.meta is None:
        raise CheckpointError(f"method {method!r} has no meta-parameters to save")
    if not isinstance(hp, spec.hyperparams):
        raise CheckpointError(f"hyperparameters are {type(hp).__name__}, method {method!r} "
                              f"needs {spec.hyperparams.__name__}")
    try:
        canon = spec.meta.coerce({k: _to_numpy(v) for k, v in theta.items()}, hp)
    except XoptError as e:
        raise CheckpointError(f"θ to save: {e}") from None
    canon = {k: np.asarray(v) for k, v in canon.items()}
    _files.check_arch(f"hyperparameters to save ({type(hp).__name__})", hp)
    for k, a in canon.items():
        _files.check_finite("θ to save", k, a)
    if fmt == "xopt":
        return xopt_format.files(method, hp, canon, source)
    if fmt == "learned_optimization":
        original = {k: np.asarray(v) for k, v in spec.meta.to_original(canon, hp).items()}
        return {lo.PARAMS_FILE: lo.params_bytes(original, gen_id, step),
                lo.GIN_FILE: lo.gin_text(method, hp)}
    if method in pylo.METAMLP_METHODS:
        return pylo.small_fc_files(hp, canon)
    return pylo.velo_files(hp, canon)


def save(path: str | os.PathLike[str], method: str, hp: Any, theta: Mapping[str, Any],
         format: str = "xopt", *, overwrite: bool = False, gen_id: str = "",
         step: int = 0, source: Mapping[str, Any] | None = None,
         protect: Sequence[str | os.PathLike[str]] = ()) -> Path:
    """Write a checkpoint directory atomically and durably (everything is built and checked
    first; the directory then appears complete or not at all).

    An existing non-empty ``path`` is an error unless ``overwrite``; with it, ``path`` must
    still be a real directory holding only checkpoint files, neither ``.`` nor a symbolic
    link, and must not contain any of ``protect`` (the source of a port). ``gen_id``/``step``
    go into learned_optimization's ``params``; ``source`` into xopt's ``config.json``.
    Returns the directory."""
    _files.check_destination(path, overwrite=overwrite, sources=protect)
    contents = files(method, hp, theta, format, gen_id=gen_id, step=step, source=source)
    with _files.atomic_dir(path, overwrite=overwrite, sources=protect) as tmp:
        for rel, data in contents.items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            _files.write_file(target, data)
    return Path(path)

