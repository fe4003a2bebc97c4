"""learned_optimization checkpoint directories: ``config.gin`` + the flax-msgpack ``params``.

This is the layout of the pretrained folders that learned_optimization's
``opt_from_checkpoint(<dir>/params)`` reads (``gs://gresearch/learned_optimization/
pretrained_lopts/<name>/``). Read and written with msgpack and NumPy only (no jax, no flax).

``params`` is ``flax.serialization.to_bytes(ParameterCheckpoint(θ, gen_id, step))``:

* a top-level msgpack map ``{"params": θ, "gen_id": str, "step": int}`` in that order (the
  dataclass's field order);
* θ as nested maps with string keys. Its flat names (the golden meta files' keys) join the
  nesting with ``/``: ``nn/~/w0`` is ``{"nn": {"~": {"w0": …}}}`` and a haiku module name
  containing ``/`` is *one* key, so ``rnn_params/rnn/linear/w`` is
  ``{"rnn_params": {"rnn/linear": {"w": …}}}``; ``lstm_init_state`` is an ``LSTMState``
  namedtuple and becomes ``{"hidden", "cell"}`` in field order. Every other map is in sorted
  key order (the fixtures written by the original show it: ``w0__10`` precedes ``w0__2``);
* every array an ``ExtType(1, msgpack((shape, dtype name, C-order bytes)))``.

:func:`write_params` reproduces the original's bytes exactly for the same θ, gen_id, step.

``config.gin`` is ``gin.config_str()`` after the optimizer's constructor bindings and
``run_train.lopt = @Class()``. Only ``AdafacMLPLOpt`` (xopt's ``small_fc_lopt``) and
``HyperV2`` (``velo``) are supported.
"""

from __future__ import annotations

import ast
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from xopt.errors import CheckpointError, XoptError

PARAMS_FILE = "params"
GIN_FILE = "config.gin"

#: flax's ExtType code for a NumPy array (``_MsgpackExtType.ndarray``).
_EXT_NDARRAY = 1
#: flax's ExtType codes for a native complex (2) and a NumPy scalar (3): not θ, rejected.
_EXT_OTHER = {2: "native complex", 3: "NumPy scalar"}
_CHUNKED = "__msgpack_chunked_array__"
_TOP_KEYS = ("params", "gen_id", "step")
#: dtypes an array in a checkpoint may have (anything else is corruption or not θ).
_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
           "uint8", "uint16", "uint32", "uint64", "bool")

# -- the msgpack file ------------------------------------------------------------------------


class _Array:
    """An array decoded lazily from an ExtType payload (so errors name the key)."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_NDARRAY:
        return _Array(data)
    raise ValueError(f"msgpack ExtType code {code} "
                     f"({_EXT_OTHER.get(code, 'unknown to flax')}) where arrays use code 1")


def _msgpack() -> Any:
    try:
        import msgpack
    except ImportError:
        raise ImportError("learned_optimization checkpoints need msgpack: pip install "
                          "'xopt-ml[hub]'") from None
    return msgpack


def _decode_array(payload: bytes, file: str, key: str) -> np.ndarray:
    msgpack = _msgpack()
    try:
        shape, dtype_name, buf = msgpack.unpackb(payload, use_list=True, raw=False)
    except Exception as e:  # noqa: BLE001 - any decoder failure is a corrupt file
        raise CheckpointError(f"{file}: array {key!r} is corrupt ({type(e).__name__}: {e})") \
            from None
    if (not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape)
            or not isinstance(dtype_name, str) or not isinstance(buf, bytes)):
        raise CheckpointError(f"{file}: array {key!r} is corrupt (expected (shape, dtype, "
                              f"bytes), got types {type(shape).__name__}, "
                              f"{type(dtype_name).__name__}, {type(buf).__name__})")
    if dtype_name not in _DTYPES:
        raise CheckpointError(f"{file}: array {key!r} has unsupported dtype {dtype_name!r}")
    if dtype_name == "bfloat16":
        raise CheckpointError(f"{file}: array {key!r} is bfloat16, which NumPy cannot hold; "
                              "convert the checkpoint to float32")
    dtype = np.dtype(dtype_name)
    n = math.prod(shape)
    if n * dtype.itemsize != len(buf):
        raise CheckpointError(f"{file}: array {key!r} of shape {tuple(shape)} and dtype "
                              f"{dtype_name} needs {n * dtype.itemsize} bytes, has {len(buf)}")
    return np.frombuffer(buf, dtype=dtype).reshape(shape).copy()


def _flatten(tree: Any, file: str, prefix: str, out: dict[str, np.ndarray]) -> None:
    if isinstance(tree, _Array):
        out[prefix] = _decode_array(tree.payload, file, prefix)
        return
    if isinstance(tree, dict):
        if _CHUNKED in tree:
            raise CheckpointError(f"{file}: array {prefix!r} is stored in chunks (flax does "
                                  "this only above 2 GiB); not supported")
        if not tree:
            raise CheckpointError(f"{file}: {prefix or 'params'!r} is an empty map")
        for k, v in tree.items():
            if not isinstance(k, str) or not k:
                raise CheckpointError(f"{file}: map {prefix or 'params'!r} has a non-string "
                                      f"or empty key {k!r}")
            _flatten(v, file, f"{prefix}/{k}" if prefix else k, out)
        return
    raise CheckpointError(f"{file}: {prefix!r} is a {type(tree).__name__}, expected an array "
                          "or a map")


def read_params_bytes(data: bytes, file: str = PARAMS_FILE) -> tuple[dict[str, np.ndarray],
                                                                     str, int]:
    """The ``params`` file's bytes → ``(θ by flat original name, gen_id, step)``; any
    corruption is a :class:`CheckpointError` naming ``file`` (and the key where known)."""
    msgpack = _msgpack()
    try:
        top = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False,
                              use_list=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises many types on corrupt input
        raise CheckpointError(f"{file}: not a valid flax msgpack checkpoint "
                              f"({type(e).__name__}: {e})") from None
    if not isinstance(top, dict):
        raise CheckpointError(f"{file}: top level is a {type(top).__name__}, expected the map "
                              "{params, gen_id, step}")
    keys = list(top)
    missing = [k for k in _TOP_KEYS if k not in top]
    extra = [repr(k) for k in keys if k not in _TOP_KEYS]
    if missing or extra:
        raise CheckpointError(f"{file}: top-level keys {keys!r}; expected {list(_TOP_KEYS)}"
                              + (f" (missing {', '.join(missing)})" if missing else "")
                              + (f" (unexpected {', '.join(extra)})" if extra else ""))
    gen_id, step = top["gen_id"], top["step"]
    if not isinstance(gen_id, str):
        raise CheckpointError(f"{file}: key 'gen_id' is a {type(gen_id).__name__}, expected "
                              "a string")
    if isinstance(step, _Array):
        arr = _decode_array(step.payload, file, "step")
        if arr.shape != () or arr.dtype.kind not in "iu":
            raise CheckpointError(f"{file}: key 'step' is an array of shape {arr.shape} and "
                                  f"dtype {arr.dtype}, expected an integer")
        step = int(arr)
    if not isinstance(step, int) or isinstance(step, bool):
        raise CheckpointError(f"{file}: key 'step' is a {type(step).__name__}, expected an "
                              "integer")
    if not isinstance(top["params"], dict):
        raise CheckpointError(f"{file}: key 'params' is a {type(top['params']).__name__}, "
                              "expected a map")
    theta: dict[str, np.ndarray] = {}
    _flatten(top["params"], file, "", theta)
    return theta, gen_id, step


def read_params(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], str, int]:
    """Read a ``params`` file (see :func:`read_params_bytes`)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    return read_params_bytes(data, str(path))


def _nest(theta: Mapping[str, Any]) -> dict[str, Any]:
    """Flat original names → the original's nesting (see the module docstring)."""
    tree: dict[str, Any] = {}
    for name, value in theta.items():
        parts = name.split("/")
        if any(not p for p in parts):
            raise CheckpointError(f"θ key {name!r} has an empty path component")
        if len(parts) > 2:  # top / haiku module name (may contain '/') / parameter
            parts = [parts[0], "/".join(parts[1:-1]), parts[-1]]
        node = tree
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise CheckpointError(f"θ key {name!r} nests under the array {p!r}")
            node = child
        if parts[-1] in node:
            raise CheckpointError(f"θ key {name!r} collides with another key's map")
        node[parts[-1]] = value
    return tree


def _ordered(tree: Any) -> Any:
    if not isinstance(tree, dict):
        return tree
    if set(tree) == {"hidden", "cell"}:  # an LSTMState namedtuple: field order
        keys = ["hidden", "cell"]
    else:
        keys = sorted(tree)
    return {k: _ordered(tree[k]) for k in keys}


def _pack_default(obj: Any) -> Any:
    msgpack = _msgpack()
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        payload = msgpack.packb((list(arr.shape), arr.dtype.name, arr.tobytes("C")),
                                use_bin_type=True)
        return msgpack.ExtType(_EXT_NDARRAY, payload)
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def params_bytes(theta: Mapping[str, Any], gen_id: str = "", step: int = 0) -> bytes:
    """θ (flat original names, arrays of any kind convertible by ``np.asarray``) →
    the bytes the original's ``checkpoints.save_state`` writes."""
    arrays = {}
    for k, v in theta.items():
        a = np.asarray(v)
        if a.dtype.name not in _DTYPES:
            raise CheckpointError(f"θ key {k!r} has dtype {a.dtype}, which a learned_"
                                  "optimization checkpoint cannot hold")
        arrays[k] = a
    doc = {"params": _ordered(_nest(arrays)), "gen_id": str(gen_id), "step": int(step)}
    return _msgpack().packb(doc, default=_pack_default, use_bin_type=True, strict_types=True)


# -- config.gin ------------------------------------------------------------------------------

#: supported gin classes → (xopt method, the constructor's defaults of its arguments that
#: xopt reads, the arguments always written because they fix θ's shapes).
CLASSES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    # adafac_mlp_lopt.py, AdafacMLPLOpt.__init__
    "AdafacMLPLOpt": ("small_fc_lopt",
                      dict(exp_mult=0.001, step_mult=0.001, hidden_size=4, hidden_layers=2,
                           initial_momentum_decays=(0.9, 0.99, 0.999),
                           initial_rms_decays=(0.999,),
                           initial_adafactor_decays=(0.9, 0.99, 0.999),
                           concat_weights=True, make_separate_weights=False,
                           split_weights=False),
                      ("hidden_layers", "hidden_size")),
    # hyper_v2.py, HyperV2.__init__ (not VeLO's values: 128 / 64 / True here)
    "HyperV2": ("velo",
                dict(lstm_hidden_size=128, ff_hidden_size=4, ff_hidden_layers=2,
                     initial_momentum_decays=(0.9, 0.99, 0.999), initial_rms_decays=(0.999,),
                     initial_adafactor_decays=(0.9, 0.99, 0.999), param_inits=64,
                     exp_mult=0.001, step_mult=0.001, use_bugged_loss_features=True),
                ("lstm_hidden_size", "param_inits")),
}
METHOD_CLASS = {method: cls for cls, (method, _, _) in CLASSES.items()}
_LOPT_BINDING = "run_train.lopt"
_RULE = "=" * 78


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines with comments removed, backslash continuations and open brackets joined."""
    text = text.replace("\\\n", "")
    out: list[tuple[int, str]] = []
    buf, start, depth = "", 0, 0
    for n, raw in enumerate(text.split("\n"), 1):
        line = raw
        if depth == 0 and line.lstrip().startswith("#"):
            continue
        if not buf:
            start = n
        buf += (" " if buf else "") + line.strip()
        in_str: str | None = None
        for ch in line:
            if in_str:
                if ch == in_str:
                    in_str = None
            elif ch in "\"'":
                in_str = ch
            elif ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
        if depth <= 0:
            if buf.strip():
                out.append((start, buf.strip()))
            buf, depth = "", 0
    if buf.strip():
        out.append((start, buf.strip()))
    return out


_BINDING = re.compile(r"^(?:(?P<scope>[\w./]+)/)?(?P<target>[\w.]+)\.(?P<arg>\w+)\s*=\s*"
                      r"(?P<value>.+)$")


_MACRO = re.compile(r"^(?P<name>[A-Za-z_]\w*)\s*=\s*(?P<value>.+)$")


def parse_gin(text: str, file: str = GIN_FILE) -> tuple[str, dict[str, Any]]:
    """``config.gin`` text → ``(class name, its bindings)``. The class is the one
    ``run_train.lopt = @Class()`` names (a module path before it is dropped); only its
    bindings are kept. Unsupported classes and unreadable values raise
    :class:`CheckpointError` naming ``file``."""
    bindings: dict[str, dict[str, tuple[int, str]]] = {}
    macros: dict[str, str] = {}
    lopt: tuple[int, str] | None = None
    for lineno, line in _logical_lines(text):
        if line.startswith(("import ", "from ", "include ")):
            continue
        macro = _MACRO.match(line)
        if macro:
            macros[macro["name"]] = macro["value"].strip()
            continue
        m = _BINDING.match(line)
        if not m:  # other gin syntax: learned_optimization also skips what it cannot use
            continue
        target, arg, value = m["target"], m["arg"], m["value"].strip()
        if f"{target}.{arg}" == _LOPT_BINDING:
            lopt = (lineno, value)
            continue
        cls = target.rsplit(".", 1)[-1]
        bindings.setdefault(cls, {})[arg] = (lineno, value)
    if lopt is None:
        raise CheckpointError(f"{file}: no '{_LOPT_BINDING} = @Class()' binding; cannot tell "
                              "which learned optimizer the checkpoint is for")
    lineno, ref = lopt
    m = re.fullmatch(r"@(?:[\w./]+/)?(?P<cls>[\w.]+)(?:\(\))?", ref)
    if not m:
        raise CheckpointError(f"{file}:{lineno}: {_LOPT_BINDING} = {ref!r} is not a "
                              "configurable reference '@Class()'")
    cls = m["cls"].rsplit(".", 1)[-1]
    if cls not in CLASSES:
        raise CheckpointError(f"{file}:{lineno}: {_LOPT_BINDING} names {cls!r}, which xopt "
                              f"does not support; supported: {', '.join(CLASSES)}")
    kwargs: dict[str, Any] = {}
    for arg, (n, value) in bindings.get(cls, {}).items():
        seen = set()
        while value.startswith("%") and value[1:] in macros and value not in seen:
            seen.add(value)
            value = macros[value[1:]]
        try:
            kwargs[arg] = ast.literal_eval(value)
        except Exception:  # noqa: BLE001 - ValueError, SyntaxError, TypeError, RecursionError
            raise CheckpointError(f"{file}:{n}: {cls}.{arg} = {value!r} is not a literal "
                                  "xopt can read") from None
    return cls, kwargs


def read_gin(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    return parse_gin(text, str(path))


def hparams_from_gin(cls: str, kwargs: Mapping[str, Any], file: str = GIN_FILE):
    """``(class, bindings)`` → xopt hyperparameters: the original constructor's defaults for
    arguments the file leaves out (HyperV2's own 128/64/True, not VeLO's), then the
    original's ``from_kwargs`` (the parity harness's adapter to it)."""
    from xopt.parity.methods import get as get_parity

    method, defaults, _ = CLASSES[cls]
    full = {**defaults, **kwargs}
    original = next(iter(get_parity(method).originals.values()))
    try:
        return method, original.from_kwargs(full)
    except (XoptError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: {cls} bindings: {e}") from None


def _gin_value(v: Any) -> str:
    if isinstance(v, tuple):
        return "(" + ", ".join(_gin_value(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    if isinstance(v, (bool, int, float, str)) or v is None:
        return repr(v)
    raise CheckpointError(f"cannot write {v!r} to config.gin")


def gin_text(method: str, hp: Any) -> str:
    """The ``config.gin`` the original's ``run_train`` writes for these hyperparameters:
    the θ-shaping arguments always, the others where they differ from the constructor's
    default, sorted by name, then ``run_train.lopt = @Class()``."""
    cls = METHOD_CLASS[method]
    _, defaults, always = CLASSES[cls]
    hp_args = _arch_kwargs(method, hp)
    lines = []
    for arg in sorted(hp_args):
        v = hp_args[arg]
        if arg in always or arg not in defaults or v != defaults[arg]:
            lines.append(f"{cls}.{arg} = {_gin_value(v)}")
    return (f"# Parameters for {cls}:\n# {_RULE}\n" + "\n".join(lines) + "\n\n"
            f"# Parameters for run_train:\n# {_RULE}\n{_LOPT_BINDING} = @{cls}()\n")


def _arch_kwargs(method: str, hp: Any) -> dict[str, Any]:
    """The constructor arguments a checkpoint's config records (not the training options
    ``num_training_steps``, ``lr``, ``weight_decay``…, which no learned_optimization
    checkpoint holds)."""
    _, defaults, _ = CLASSES[METHOD_CLASS[method]]
    out = {}
    for name in defaults:
        if hasattr(hp, name):
            v = getattr(hp, name)
            out[name] = tuple(v) if isinstance(v, list) else v
    return out
