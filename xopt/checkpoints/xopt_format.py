"""xopt's own checkpoint layout: ``config.json`` + ``model.safetensors``.

``config.json`` is ``{"format": "xopt-checkpoint/1", "method": ..., "spec": <the
hyperparameters' JSON, format "xopt-spec/1">}``; ``model.safetensors`` holds θ under the
spec's canonical names (``mlp/w0``, ``lstm/gates/w``, …). Unlike the other two formats it
keeps every hyperparameter (training options included) and, for small_fc_lopt, the decay
offsets.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from xopt.checkpoints import _files
from xopt.errors import CheckpointError, XoptError

FORMAT = "xopt-checkpoint/1"


def is_xopt_config(config: Mapping[str, Any]) -> bool:
    return config.get("format") == FORMAT


def read(path: str | os.PathLike[str], **overrides: Any) -> tuple[str, Any, dict[str, Any]]:
    """An xopt checkpoint directory → ``(method, hyperparameters, θ canonical)``;
    ``overrides`` replace hyperparameter fields."""
    import dataclasses

    from xopt import specs

    path = Path(path)
    cfg_file, st_file = path / _files.CONFIG, path / _files.WEIGHTS
    config = _files.read_json(cfg_file)
    if not is_xopt_config(config):
        raise CheckpointError(f"{cfg_file}: key 'format' is {config.get('format')!r}, "
                              f"expected {FORMAT!r}")
    extra = sorted(set(config) - {"format", "method", "spec"})
    if extra:
        raise CheckpointError(f"{cfg_file}: unexpected key(s) {', '.join(map(repr, extra))}")
    for key in ("method", "spec"):
        if key not in config:
            raise CheckpointError(f"{cfg_file}: missing key {key!r}")
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
        if overrides:
            hp = dataclasses.replace(hp, **overrides)
    except XoptError as e:
        raise CheckpointError(f"{cfg_file}: key 'spec': {e}") from None
    except TypeError as e:
        raise CheckpointError(f"{path}: bad hyperparameter override ({e})") from None
    tensors = _files.read_safetensors(st_file)
    _files.check_keys(st_file, tensors, spec.meta.shapes(hp))
    return method, hp, tensors


def files(method: str, hp: Any, theta: Mapping[str, Any]) -> dict[str, bytes | str]:
    """``{file name: contents}`` of the xopt checkpoint directory (θ canonical)."""
    config = {"format": FORMAT, "method": method, "spec": json.loads(hp.to_json())}
    return {_files.CONFIG: json.dumps(config, indent=2) + "\n",
            _files.WEIGHTS: _files.safetensors_bytes(
                {k: np.asarray(v) for k, v in theta.items()})}
