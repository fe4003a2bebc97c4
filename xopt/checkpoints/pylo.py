"""PyLO's Hugging Face layout: ``config.json`` (the module's constructor arguments) +
``model.safetensors`` (its ``state_dict``), as ``save_pretrained`` writes them.

* small_fc_lopt ↔ PyLO's ``MetaMLP(input_size, hidden_size, hidden_layers)``; PyLO's
  ``hidden_layers`` is xopt's (and JAX's) minus one. ``network.input``,
  ``network.linear_{i}``, ``network.output`` hold ``mlp/w*`` transposed and ``mlp/b*``.
* velo ↔ PyLO's ``VeLORNN`` + ``VeLOMLP``, two Hub repositories; locally xopt takes one
  directory holding them as ``rnn/`` and ``mlp/``. All LSTM weights are stored transposed;
  the MLP bank's weights as ``(P, out, in)``; the ``VeLOMLP`` scratch copies
  (``input_weights``, …, without the trailing ``_``) are written as zeros, as PyLO
  overwrites them before every use, and ignored on read (shape-checked).

**What a PyLO checkpoint does not hold.** PyLO passes these to its optimizers' constructors,
not to the modules it saves, so reading one cannot recover them:

* small_fc_lopt's learned decay offsets θ[``decays/*``] (``momentum_decays``,
  ``rms_decays``, ``adafactor_decays`` of ``AdafacLO_naive``). They are part of θ and change
  the optimizer's step, so :func:`read` requires them: ``decays={"momentum": …, "rms": …,
  "adafactor": …}`` (or the original's keys ``momentum_decays``, …), or
  ``decays="pylo-defaults"`` to choose, explicitly, the values ``AdafacLO_naive`` uses when
  none are passed (μLO's, :data:`PYLO_DEFAULT_DECAYS`). Without them :func:`read` raises
  :class:`CheckpointError`. Writing drops them (PyLO has nowhere to keep them).
* hyperparameters other than the architecture (``step_mult``, ``exp_mult``, the initial
  decays, ``use_bugged_loss_features``, ``num_training_steps``, …): they take the spec's
  defaults unless given as ``overrides`` (``step_mult=0.01``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from xopt.checkpoints import _files
from xopt.errors import CheckpointError

#: ``AdafacLO_naive``'s default decay offsets (μLO's); chosen only by
#: ``decays="pylo-defaults"``.
PYLO_DEFAULT_DECAYS = {
    "momentum": (0.15216392, 0.14245212, 0.06812963),
    "rms": (0.01079706,),
    "adafactor": (0.18621896, -0.10864615, -0.06185547),
}
#: the methods whose θ is PyLO's ``MetaMLP`` (``AdafacLO_naive`` and ``MuLO`` load it)
METAMLP_METHODS = ("small_fc_lopt", "mulo")
RNN_DIR = "rnn"
MLP_DIR = "mlp"


def _config_text(config: Mapping[str, Any]) -> str:
    # huggingface_hub's ModelHubMixin writes the constructor arguments this way.
    return json.dumps(dict(config), indent=2, sort_keys=True)


def _check_config(file: Path, config: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    extra = sorted(k for k in config if k not in expected)
    if extra:
        raise CheckpointError(f"{file}: unexpected key(s) {', '.join(map(repr, extra))}; "
                              f"expected {', '.join(expected)}")
    for key, want in expected.items():
        if key not in config:
            raise CheckpointError(f"{file}: missing key {key!r}")
        if want is not None and (config[key] != want or type(config[key]) is not type(want)):
            raise CheckpointError(f"{file}: key {key!r} is {config[key]!r}; xopt reads only "
                                  f"{want!r}")


# -- small_fc_lopt / MetaMLP --------------------------------------------------------------------


def _metamlp_names(n_linear: int) -> list[str]:
    return ["network.input"] + [f"network.linear_{i}" for i in range(n_linear - 2)] + [
        "network.output"]


def _decays(decays: Any, hp: Any, path: Path) -> dict[str, np.ndarray]:
    where = f"{path}: PyLO MetaMLP checkpoint"
    if decays is None:
        raise CheckpointError(
            f"{where}: the learned decay offsets (θ decays/momentum, decays/rms, "
            "decays/adafactor) are not stored in PyLO checkpoints; pass decays={'momentum': "
            "..., 'rms': ..., 'adafactor': ...} (the values given to AdafacLO_naive), or "
            "decays='pylo-defaults' for AdafacLO_naive's defaults")
    if isinstance(decays, str):
        if decays != "pylo-defaults":
            raise CheckpointError(f"{where}: decays={decays!r}; expected a mapping or "
                                  "'pylo-defaults'")
        decays = PYLO_DEFAULT_DECAYS
    if not isinstance(decays, Mapping):
        raise CheckpointError(f"{where}: decays must be a mapping, got "
                              f"{type(decays).__name__}")
    out = {}
    for kind in ("momentum", "rms", "adafactor"):
        names = (kind, f"{kind}_decays", f"decays/{kind}")
        found = [n for n in names if n in decays]
        if len(found) != 1:
            raise CheckpointError(f"{where}: decays needs exactly one of {names}")
        try:
            value = np.asarray(decays[found[0]], dtype=np.float32)
        except (TypeError, ValueError, OverflowError) as e:
            raise CheckpointError(f"{where}: decays {found[0]!r} is not a list of numbers "
                                  f"({e})") from None
        _files.check_finite(f"{where}: decays=", found[0], value)
        out[f"decays/{kind}"] = value
    allowed = {n for kind in ("momentum", "rms", "adafactor")
               for n in (kind, f"{kind}_decays", f"decays/{kind}")}
    extra = sorted(set(decays) - allowed)
    if extra:
        raise CheckpointError(f"{where}: unexpected decays key(s) {', '.join(extra)}")
    return out


def read_small_fc(path: str | os.PathLike[str], *, decays: Any = None,
                  method: str = "small_fc_lopt", **overrides: Any
                  ) -> tuple[Any, dict[str, np.ndarray]]:
    """A PyLO ``MetaMLP`` directory → ``(SmallFCLOpt, θ canonical)``; see the module
    docstring for ``decays`` and ``overrides``. ``method="mulo"`` reads it as μLO's
    (PyLO's ``MuLO`` loads the same ``MetaMLP``; the folder cannot say which it is for):
    ``(MuLO, θ)``."""
    from xopt.specs import mulo
    from xopt.specs import small_fc_lopt as sf

    if method not in METAMLP_METHODS:
        raise CheckpointError(f"{path}: a PyLO MetaMLP checkpoint is read as "
                              f"{' or '.join(METAMLP_METHODS)}, not {method!r}")
    cls = mulo.MuLO if method == "mulo" else sf.SmallFCLOpt

    path = Path(path)
    cfg_file, st_file = path / _files.CONFIG, path / _files.WEIGHTS
    config = _files.read_json(cfg_file)
    _check_config(cfg_file, config, {"hidden_layers": None, "hidden_size": None,
                                     "input_size": None})
    layers = _files.config_int(cfg_file, config, "hidden_layers", _files.MAX_LAYERS - 1) + 1
    size = _files.config_int(cfg_file, config, "hidden_size", _files.MAX_WIDTH)
    input_size = _files.config_int(cfg_file, config, "input_size", _files.MAX_WIDTH)
    try:
        hp = cls(**{**overrides, "hidden_layers": layers, "hidden_size": size})
    except TypeError as e:
        raise CheckpointError(f"{path}: bad hyperparameter override ({e})") from None
    if input_size != sf.num_inputs(hp):
        raise CheckpointError(f"{cfg_file}: key 'input_size' is {input_size!r}; "
                              f"these hyperparameters need {sf.num_inputs(hp)}")
    shapes = sf.meta_shapes(hp)
    names = _metamlp_names(layers + 1)
    expected = {}
    for i, name in enumerate(names):
        w = shapes[f"mlp/w{i}"]
        expected[f"{name}.weight"] = (w[1], w[0])
        expected[f"{name}.bias"] = shapes[f"mlp/b{i}"]
    tensors = _files.read_safetensors(st_file)
    _files.check_keys(st_file, tensors, expected)
    theta: dict[str, np.ndarray] = {}
    for i, name in enumerate(names):
        theta[f"mlp/w{i}"] = np.ascontiguousarray(tensors[f"{name}.weight"].T)
        theta[f"mlp/b{i}"] = tensors[f"{name}.bias"]
    theta.update(_decays(decays, hp, path))
    for k in ("decays/momentum", "decays/rms", "decays/adafactor"):
        if theta[k].shape != shapes[k]:
            raise CheckpointError(f"{path}: decays {k!r} has shape {theta[k].shape}, these "
                                  f"hyperparameters need {shapes[k]}")
    return hp, theta


def small_fc_files(hp: Any, theta: Mapping[str, Any]) -> dict[str, bytes | str]:
    """``{file name: contents}`` of the PyLO ``MetaMLP`` directory (θ canonical)."""
    from xopt.specs import small_fc_lopt as sf

    if hp.hidden_layers < 1:
        raise CheckpointError(f"SmallFCLOpt.hidden_layers = {hp.hidden_layers}: PyLO's "
                              "MetaMLP needs at least one hidden layer")
    names = _metamlp_names(hp.hidden_layers + 1)
    tensors = {}
    for i, name in enumerate(names):
        tensors[f"{name}.weight"] = np.asarray(theta[f"mlp/w{i}"]).T
        tensors[f"{name}.bias"] = np.asarray(theta[f"mlp/b{i}"])
    config = {"hidden_layers": hp.hidden_layers - 1, "hidden_size": hp.hidden_size,
              "input_size": sf.num_inputs(hp)}
    return {_files.CONFIG: _config_text(config), _files.WEIGHTS: _files.safetensors_bytes(tensors)}


# -- velo / VeLORNN + VeLOMLP -------------------------------------------------------------------

_RNN_LAYERS = {"mix_layer1": "mix0", "mix_layer2": "mix1", "final_mix_layer": "input",
               "lstm.linear": "gates", "rnn_to_controls": "to_controls",
               "step_size": "step_size"}
_INIT_STATE = {"lstm_init_state.0": "lstm/init_hidden", "lstm_init_state.1": "lstm/init_cell"}


def _mlp_names(n_linear: int) -> list[tuple[str, str]]:
    """``[(PyLO weight stem, PyLO bias stem)]`` of the bank's layers (``_`` marks the
    per-bank arrays; the stems without it are the scratch copies)."""
    return [("input_weights", "input_bias")] + [
        (f"hidden_weights.{i}", f"hidden_bias.{i}") for i in range(n_linear - 2)] + [
        ("output_weights", "output_bias")]


def _bank_key(stem: str) -> str:
    # 'hidden_weights.0' -> 'hidden_weights_.0'; 'input_bias' -> 'input_bias_'
    head, dot, tail = stem.partition(".")
    return f"{head}_{dot}{tail}"


def _velo_expected(hp: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    from xopt.specs import velo as v

    shapes = v.meta_shapes(hp)
    rnn: dict[str, tuple[int, ...]] = {}
    for pylo, canon in _RNN_LAYERS.items():
        w = shapes[f"lstm/{canon}/w"]
        rnn[f"{pylo}.weight"] = (w[1], w[0])
        rnn[f"{pylo}.bias"] = shapes[f"lstm/{canon}/b"]
    for pylo, canon in _INIT_STATE.items():
        rnn[pylo] = (1,) + shapes[canon]
    mlp: dict[str, tuple[int, ...]] = {}
    for i, (w, b) in enumerate(_mlp_names(hp.ff_hidden_layers + 1)):
        p, n_in, n_out = shapes[f"mlp_bank/w{i}"]
        mlp[_bank_key(w)] = (p, n_out, n_in)
        mlp[_bank_key(b)] = (p, n_out)
        mlp[w] = (n_out, n_in)
        mlp[b] = (n_out,)
    return rnn, mlp


def read_velo(path: str | os.PathLike[str], **overrides: Any) -> tuple[Any, dict[str, Any]]:
    """A directory with PyLO's ``rnn/`` (``VeLORNN``) and ``mlp/`` (``VeLOMLP``) →
    ``(VeLO, θ canonical)``."""
    path = Path(path)
    return read_velo_pair(path / RNN_DIR, path / MLP_DIR, **overrides)


def read_velo_pair(rnn_dir: str | os.PathLike[str], mlp_dir: str | os.PathLike[str],
                   **overrides: Any) -> tuple[Any, dict[str, Any]]:
    """PyLO's ``VeLORNN`` and ``VeLOMLP`` directories (two Hub repositories, each
    ``config.json`` + ``model.safetensors``) → ``(VeLO, θ canonical)``."""
    from xopt.specs import velo as v

    rnn_dir, mlp_dir = Path(rnn_dir), Path(mlp_dir)
    path = rnn_dir.parent if rnn_dir.parent == mlp_dir.parent else rnn_dir
    rcfg, mcfg = rnn_dir / _files.CONFIG, mlp_dir / _files.CONFIG
    rc, mc = _files.read_json(rcfg), _files.read_json(mcfg)
    _check_config(rcfg, rc, {"input_size": v.NUM_LSTM_FEATURES, "lstm_hidden_size": None,
                             "mix_layers": True, "param_inits": None})
    _check_config(mcfg, mc, {"hidden_layers": None, "hidden_size": None,
                             "input_size": v.NUM_MLP_FEATURES,
                             "output_size": v.NUM_MLP_OUTPUTS, "param_inits": None})
    h = _files.config_int(rcfg, rc, "lstm_hidden_size", _files.MAX_WIDTH)
    p = _files.config_int(rcfg, rc, "param_inits", _files.MAX_WIDTH)
    if _files.config_int(mcfg, mc, "param_inits", _files.MAX_WIDTH) != p:
        raise CheckpointError(f"{mcfg}: key 'param_inits' is {mc['param_inits']!r}, but "
                              f"{rcfg} has {p!r}")
    arch = dict(lstm_hidden_size=h, param_inits=p,
                ff_hidden_size=_files.config_int(mcfg, mc, "hidden_size", _files.MAX_WIDTH),
                ff_hidden_layers=_files.config_int(mcfg, mc, "hidden_layers",
                                                   _files.MAX_LAYERS - 1) + 1)
    try:
        hp = v.VeLO(**{**overrides, **arch})
    except TypeError as e:
        raise CheckpointError(f"{path}: bad hyperparameter override ({e})") from None
    rnn_shapes, mlp_shapes = _velo_expected(hp)
    rfile, mfile = rnn_dir / _files.WEIGHTS, mlp_dir / _files.WEIGHTS
    rnn, mlp = _files.read_safetensors(rfile), _files.read_safetensors(mfile)
    _files.check_keys(rfile, rnn, rnn_shapes)
    _files.check_keys(mfile, mlp, mlp_shapes)
    theta: dict[str, Any] = {}
    for pylo, canon in _INIT_STATE.items():
        theta[canon] = rnn[pylo].reshape(-1)
    for pylo, canon in _RNN_LAYERS.items():
        theta[f"lstm/{canon}/w"] = np.ascontiguousarray(rnn[f"{pylo}.weight"].T)
        theta[f"lstm/{canon}/b"] = rnn[f"{pylo}.bias"]
    for i, (w, b) in enumerate(_mlp_names(hp.ff_hidden_layers + 1)):
        theta[f"mlp_bank/w{i}"] = np.ascontiguousarray(mlp[_bank_key(w)].transpose(0, 2, 1))
        theta[f"mlp_bank/b{i}"] = mlp[_bank_key(b)]
    return hp, {k: theta[k] for k in v.meta_shapes(hp)}


def velo_files(hp: Any, theta: Mapping[str, Any]) -> dict[str, bytes | str]:
    """``{relative file name: contents}`` of the ``rnn/`` + ``mlp/`` pair (θ canonical)."""
    from xopt.specs import velo as v

    rnn_shapes, mlp_shapes = _velo_expected(hp)
    rnn: dict[str, np.ndarray] = {}
    for pylo, canon in _RNN_LAYERS.items():
        rnn[f"{pylo}.weight"] = np.asarray(theta[f"lstm/{canon}/w"]).T
        rnn[f"{pylo}.bias"] = np.asarray(theta[f"lstm/{canon}/b"])
    for pylo, canon in _INIT_STATE.items():
        rnn[pylo] = np.asarray(theta[canon]).reshape(1, -1)
    mlp: dict[str, np.ndarray] = {}
    for i, (w, b) in enumerate(_mlp_names(hp.ff_hidden_layers + 1)):
        wi = np.asarray(theta[f"mlp_bank/w{i}"])
        mlp[_bank_key(w)] = wi.transpose(0, 2, 1)
        mlp[_bank_key(b)] = np.asarray(theta[f"mlp_bank/b{i}"])
        mlp[w] = np.zeros(mlp_shapes[w], dtype=wi.dtype)
        mlp[b] = np.zeros(mlp_shapes[b], dtype=wi.dtype)
    rc = {"input_size": v.NUM_LSTM_FEATURES, "lstm_hidden_size": hp.lstm_hidden_size,
          "mix_layers": True, "param_inits": hp.param_inits}
    mc = {"hidden_layers": hp.ff_hidden_layers - 1, "hidden_size": hp.ff_hidden_size,
          "input_size": v.NUM_MLP_FEATURES, "output_size": v.NUM_MLP_OUTPUTS,
          "param_inits": hp.param_inits}
    if hp.ff_hidden_layers < 1:
        raise CheckpointError(f"VeLO.ff_hidden_layers = {hp.ff_hidden_layers}: PyLO's "
                              "VeLOMLP needs at least one hidden layer")
    return {f"{RNN_DIR}/{_files.CONFIG}": _config_text(rc),
            f"{RNN_DIR}/{_files.WEIGHTS}": _files.safetensors_bytes(rnn),
            f"{MLP_DIR}/{_files.CONFIG}": _config_text(mc),
            f"{MLP_DIR}/{_files.WEIGHTS}": _files.safetensors_bytes(mlp)}
