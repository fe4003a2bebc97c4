"""xopt's own checkpoint layout: ``config.json`` + ``model.safetensors``, with content hashes.

``config.json`` is ``{"format": "xopt-checkpoint/2", "method": ..., "spec": <the
hyperparameters' JSON, format "xopt-spec/1">}``, plus, when the checkpoint was ported,
``"source": {"format": ..., "sha256": {file: hex digest}}``: the formats and hashes of the
files it was converted from. ``model.safetensors`` holds θ under the spec's canonical names
(``mlp/w0``, ``lstm/gates/w``, …). Unlike the other two formats it keeps every
hyperparameter (training options included) and, for small_fc_lopt, the decay offsets.

**Content hashes.** The safetensors header's ``__metadata__`` records the SHA-256 of every
tensor's stored bytes (``xopt.sha256:<name>``) and of ``config.json``'s bytes
(``xopt.sha256:config.json``); :func:`read` verifies them all before it returns anything.
So a flipped bit, two swapped tensors of one shape, or an edited config is an error, not a
silently different optimizer. (Hyperparameters are changed at load time with overrides,
not by editing the file.)
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from xopt.checkpoints import _files
from xopt.errors import CheckpointError, XoptError

FORMAT = "xopt-checkpoint/2"
#: safetensors metadata: the format, and the hash of config.json and of each tensor
META_FORMAT = "xopt.format"
META_SHA = "xopt.sha256:"


def is_xopt_config(config: Mapping[str, Any]) -> bool:
    return config.get("format") == FORMAT


def _check_source(cfg_file: Path, source: Any) -> None:
    ok = (isinstance(source, dict) and set(source) == {"format", "sha256"}
          and isinstance(source["format"], str) and isinstance(source["sha256"], dict)
          and all(isinstance(k, str) and isinstance(v, str) for k, v in source["sha256"].items()))
    if not ok:
        raise CheckpointError(f"{cfg_file}: key 'source' is not {{'format': str, 'sha256': "
                              "{file: hex digest}}")


def read(path: str | os.PathLike[str], **overrides: Any) -> tuple[str, Any, dict[str, Any]]:
    """An xopt checkpoint directory → ``(method, hyperparameters, θ canonical)``, every
    hash verified; ``overrides`` replace hyperparameter fields."""
    from xopt import specs

    path = Path(path)
    cfg_file, st_file = path / _files.CONFIG, path / _files.WEIGHTS
    cfg_bytes = _files.read_bytes(cfg_file, _files.MAX_CONFIG_BYTES)
    tensors, metadata = _files.read_safetensors_meta(st_file)
    if metadata.get(META_FORMAT) != FORMAT:
        raise CheckpointError(f"{st_file}: metadata {META_FORMAT!r} is "
                              f"{metadata.get(META_FORMAT)!r}, expected {FORMAT!r} (this "
                              "file was not written by xopt, or by an older version)")
    want = {f"{META_SHA}{k}" for k in tensors} | {f"{META_SHA}{_files.CONFIG}", META_FORMAT}
    if set(metadata) != want:
        odd = sorted(set(metadata) ^ want)
        raise CheckpointError(f"{st_file}: metadata keys do not match the tensors (missing "
                              f"or unexpected: {', '.join(map(repr, odd[:5]))})")
    if _files.sha256(cfg_bytes) != metadata[f"{META_SHA}{_files.CONFIG}"]:
        raise CheckpointError(f"{cfg_file}: does not match the SHA-256 recorded in {st_file} "
                              "(the file was changed after it was written; pass changed "
                              "hyperparameters as overrides when loading instead)")
    for k, a in tensors.items():
        if _files.sha256(a) != metadata[f"{META_SHA}{k}"]:
            raise CheckpointError(f"{st_file}: tensor {k!r} does not match its recorded "
                                  "SHA-256 (the data is corrupt or was swapped)")
    config = _files.parse_json(cfg_bytes, cfg_file)
    if not isinstance(config, dict) or not is_xopt_config(config):
        raise CheckpointError(f"{cfg_file}: not an xopt checkpoint config (key 'format' must "
                              f"be {FORMAT!r})")
    extra = sorted(set(config) - {"format", "method", "spec", "source"})
    if extra:
        raise CheckpointError(f"{cfg_file}: unexpected key(s) {', '.join(map(repr, extra))}")
    for key in ("method", "spec"):
        if key not in config:
            raise CheckpointError(f"{cfg_file}: missing key {key!r}")
    if "source" in config:
        _check_source(cfg_file, config["source"])
    method = config["method"]
    try:
        spec = specs.get(method) if isinstance(method, str) else None
    except XoptError as e:
        raise CheckpointError(f"{cfg_file}: key 'method': {e}") from None
    if spec is None or spec.meta is None:
        raise CheckpointError(f"{cfg_file}: key 'method' is {method!r}, not a learned "
                              "optimizer")
    try:
        hp = spec.hyperparams.from_json(json.dumps(config["spec"]))
    except (XoptError, TypeError, ValueError, ArithmeticError) as e:
        raise CheckpointError(f"{cfg_file}: key 'spec': {e}") from None
    _files.check_arch(f"{cfg_file}: key 'spec'", hp)
    if overrides:
        try:
            hp = dataclasses.replace(hp, **overrides)
        except TypeError as e:
            raise CheckpointError(f"{path}: bad hyperparameter override ({e})") from None
        _files.check_arch(f"{path}: overrides", hp)
    _files.check_keys(st_file, tensors, spec.meta.shapes(hp))
    return method, hp, tensors


def files(method: str, hp: Any, theta: Mapping[str, Any],
          source: Mapping[str, Any] | None = None) -> dict[str, bytes | str]:
    """``{file name: contents}`` of the xopt checkpoint directory (θ canonical);
    ``source``: ``{"format": ..., "sha256": {file: digest}}`` of what it was ported from."""
    config: dict[str, Any] = {"format": FORMAT, "method": method,
                              "spec": json.loads(hp.to_json())}
    if source is not None:
        config["source"] = {"format": str(source["format"]),
                            "sha256": {str(k): str(v) for k, v in source["sha256"].items()}}
    try:
        text = (json.dumps(config, indent=2, allow_nan=False) + "\n").encode("utf-8")
    except ValueError:
        raise CheckpointError(f"{type(hp).__name__}: a hyperparameter is not finite; a "
                              "checkpoint's must be") from None
    arrays = {k: np.asarray(v) for k, v in theta.items()}
    metadata = {META_FORMAT: FORMAT, f"{META_SHA}{_files.CONFIG}": _files.sha256(text)}
    metadata.update({f"{META_SHA}{k}": _files.sha256(a) for k, a in arrays.items()})
    return {_files.CONFIG: text, _files.WEIGHTS: _files.safetensors_bytes(arrays, metadata)}
