"""learned_optimization checkpoint directories: ``config.gin`` + the flax-msgpack ``params``.

This is the layout of the pretrained folders that learned_optimization's
``opt_from_checkpoint(<dir>/params)`` reads (``gs://gresearch/learned_optimization/
pretrained_lopts/<name>/``). Read and written with NumPy and the standard library only (no
jax, no flax, no msgpack package: :mod:`xopt.checkpoints._msgpack` says why).

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
``run_train.lopt = @Class()``; it is read with gin's scoping rules (:func:`parse_gin`), without
gin. Only ``AdafacMLPLOpt`` (xopt's ``small_fc_lopt``), ``HyperV2`` (``velo``) and μLO's
``MuAdafacMLPLOpt`` (``mulo``) are supported.
"""

from __future__ import annotations

import ast
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from xopt.checkpoints import _files
from xopt.checkpoints._msgpack import ExtType, MsgpackError, packb, unpackb
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


def _decode_array(ext: ExtType, file: str, key: str) -> np.ndarray:
    if ext.code != _EXT_NDARRAY:
        raise CheckpointError(f"{file}: {key!r} is a msgpack ExtType of code {ext.code} "
                              f"({_EXT_OTHER.get(ext.code, 'unknown to flax')}) where arrays "
                              "use code 1")
    try:
        payload = unpackb(ext.data)
    except MsgpackError as e:
        raise CheckpointError(f"{file}: array {key!r} is corrupt ({e})") from None
    if not isinstance(payload, list) or len(payload) != 3:
        raise CheckpointError(f"{file}: array {key!r} is corrupt (expected (shape, dtype, "
                              f"bytes), got {type(payload).__name__})")
    shape, dtype_name, buf = payload
    if not isinstance(dtype_name, str) or not isinstance(buf, bytes):
        raise CheckpointError(f"{file}: array {key!r} is corrupt (expected (shape, dtype, "
                              f"bytes), got types {type(shape).__name__}, "
                              f"{type(dtype_name).__name__}, {type(buf).__name__})")
    shape = _files.shape_of(shape, f"{file}: array {key!r}")
    if dtype_name not in _DTYPES:
        raise CheckpointError(f"{file}: array {key!r} has unsupported dtype {dtype_name!r}")
    if dtype_name == "bfloat16":
        raise CheckpointError(f"{file}: array {key!r} is bfloat16, which NumPy cannot hold; "
                              "convert the checkpoint to float32")
    dtype = np.dtype(dtype_name)
    n = math.prod(shape)
    if n * dtype.itemsize != len(buf):
        raise CheckpointError(f"{file}: array {key!r} of shape {shape} and dtype "
                              f"{dtype_name} needs {n * dtype.itemsize} bytes, has {len(buf)}")
    return np.frombuffer(buf, dtype=dtype).reshape(shape).copy()


def _flatten(tree: Any, file: str, prefix: str, out: dict[str, np.ndarray]) -> None:
    if isinstance(tree, ExtType):
        a = _decode_array(tree, file, prefix)
        _files.check_finite(file, prefix, a)
        out[prefix] = a
        return
    if isinstance(tree, dict):
        if _CHUNKED in tree:
            raise CheckpointError(f"{file}: array {prefix!r} is stored in chunks (flax does "
                                  "this only above 2 GiB); not supported")
        if not tree:
            raise CheckpointError(f"{file}: {prefix or 'params'!r} is an empty map")
        for k, v in tree.items():
            if not k:
                raise CheckpointError(f"{file}: map {prefix or 'params'!r} has an empty key")
            _flatten(v, file, f"{prefix}/{k}" if prefix else k, out)
        return
    raise CheckpointError(f"{file}: {prefix!r} is a {type(tree).__name__}, expected an array "
                          "or a map")


def read_params_bytes(data: bytes, file: str = PARAMS_FILE) -> tuple[dict[str, np.ndarray],
                                                                     str, int]:
    """The ``params`` file's bytes → ``(θ by flat original name, gen_id, step)``; any
    corruption (and a non-finite θ value) is a :class:`CheckpointError` naming ``file``
    (and the key where known)."""
    try:
        top = unpackb(data)
    except MsgpackError as e:
        raise CheckpointError(f"{file}: not a valid flax msgpack checkpoint ({e})") from None
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
    if isinstance(step, ExtType):
        arr = _decode_array(step, file, "step")
        if arr.shape != () or arr.dtype.kind not in "iu":
            raise CheckpointError(f"{file}: key 'step' is an array of shape {arr.shape} and "
                                  f"dtype {arr.dtype}, expected an integer")
        step = int(arr)
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= _files.MAX_INT:
        raise CheckpointError(f"{file}: key 'step' is {step!r}, expected a non-negative "
                              "integer")
    if not isinstance(top["params"], dict):
        raise CheckpointError(f"{file}: key 'params' is a {type(top['params']).__name__}, "
                              "expected a map")
    theta: dict[str, np.ndarray] = {}
    _flatten(top["params"], file, "", theta)
    return theta, gen_id, step


def read_params(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], str, int]:
    """Read a ``params`` file (see :func:`read_params_bytes`)."""
    return read_params_bytes(_files.read_bytes(path), str(path))


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


def _arrays_to_ext(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _arrays_to_ext(v) for k, v in tree.items()}
    arr = np.ascontiguousarray(tree)
    return ExtType(_EXT_NDARRAY, packb((list(arr.shape), arr.dtype.name, arr.tobytes("C"))))


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
    doc = {"params": _arrays_to_ext(_ordered(_nest(arrays))), "gen_id": str(gen_id),
           "step": int(step)}
    return packb(doc)


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
    # μLO's mup_adafac_mlp_lopt.py, MuAdafacMLPLOpt.__init__ (AdafacMLPLOpt's and clip_grad)
    "MuAdafacMLPLOpt": ("mulo",
                        dict(exp_mult=0.001, step_mult=0.001, hidden_size=4, hidden_layers=2,
                             initial_momentum_decays=(0.9, 0.99, 0.999),
                             initial_rms_decays=(0.999,),
                             initial_adafactor_decays=(0.9, 0.99, 0.999),
                             concat_weights=True, make_separate_weights=False,
                             split_weights=False, clip_grad=False),
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
#: where gin registers each supported class, and ``run_train`` (a module path written before
#: a name in a config must be a suffix of these, as gin resolves it)
MODULES = {"AdafacMLPLOpt": "learned_optimization.learned_optimizers.adafac_mlp_lopt",
           "HyperV2": "learned_optimization.research.general_lopt.hyper_v2",
           "MuAdafacMLPLOpt": "mup_adafac_mlp_lopt",  # μLO's src/, a top-level module
           "run_train": "learned_optimization.outer_train"}
_LOPT = ("run_train", "lopt")
_RULE = "=" * 78
_NAME = r"[A-Za-z_]\w*"
_LHS = re.compile(rf"(?:(?P<scope>{_NAME}(?:/{_NAME})*)/)?(?P<selector>{_NAME}(?:\.{_NAME})*)")
_REF = re.compile(rf"@(?:(?P<scope>{_NAME}(?:/{_NAME})*)/)?(?P<selector>{_NAME}(?:\.{_NAME})*)"
                  r"(?P<call>\(\))?")
_MACRO_REF = re.compile(rf"%(?P<name>{_NAME}(?:\.{_NAME})*)")
_STRING_OR_REF = re.compile(r"""('(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")|[@%][\w./]+(?:\(\))?""")


def _statements(text: str, file: str) -> list[tuple[int, str]]:
    """``(first line, source)`` of each gin statement, split as gin does, with Python's
    tokenizer: comments dropped, brackets and backslashes continue a statement."""
    import io
    import tokenize

    starts = [0]
    for line in text.split("\n"):
        starts.append(starts[-1] + len(line) + 1)
    out: list[tuple[int, str]] = []
    first = last = None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENCODING):
                continue
            if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                if first is not None:
                    src = text[starts[first[0] - 1] + first[1]:starts[last[0] - 1] + last[1]]
                    out.append((first[0], src))
                first = last = None
                continue
            if tok.type == tokenize.ERRORTOKEN and not tok.string.isspace():
                raise CheckpointError(f"{file}:{tok.start[0]}: {tok.string!r} is not gin "
                                      "syntax")
            if first is None:
                first = tok.start
            last = tok.end
    except (tokenize.TokenError, SyntaxError) as e:
        raise CheckpointError(f"{file}: not valid gin ({e})") from None
    return out


def _check_literal(v: Any, where: str, depth: int = 0) -> Any:
    """``v`` if it is a gin literal xopt can use: finite numbers, bounded integers,
    strings, booleans, None, and tuples/lists of them."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        if abs(v) > _files.MAX_INT:
            raise CheckpointError(f"{where}: integer {v} is out of range (|x| <= 2**62)")
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise CheckpointError(f"{where}: {v} is not a finite number")
        return v
    if isinstance(v, (tuple, list)) and depth < 4:
        return type(v)(_check_literal(x, where, depth + 1) for x in v)
    raise CheckpointError(f"{where}: a {type(v).__name__} is not a value xopt reads")


def _literal(value: str, where: str) -> Any:
    try:
        v = ast.literal_eval(value.replace("\\\n", " ").strip())
    except Exception:  # noqa: BLE001 - ValueError, SyntaxError, TypeError, MemoryError...
        raise CheckpointError(f"{where}: {value!r} is not a literal xopt can read") from None
    return _check_literal(v, where)


def _check_syntax(value: str, where: str) -> None:
    """A value of a binding xopt does not use is still checked to be a gin value: a Python
    literal in which configurable references (``@name``, ``@name()``) and macros
    (``%NAME``) may stand for values."""
    def stand_in(m: re.Match[str]) -> str:
        return m.group(1) or "None"

    try:
        ast.literal_eval(_STRING_OR_REF.sub(stand_in, value.replace("\\\n", " ")).strip())
    except Exception:  # noqa: BLE001 - any parse failure is a syntax error
        raise CheckpointError(f"{where}: {value.strip()!r} is not a gin value") from None


def _module_ok(selector: str, name: str) -> bool:
    """``selector`` (``[module.]name``) can name ``name`` as gin resolves it: any module
    path given must be a suffix of the one gin registers it under."""
    parts = selector.split(".")
    if parts[-1] != name:
        return False
    given = parts[:-1]
    real = MODULES[name].split(".")
    return not given or real[-len(given):] == given


class _Binding:
    __slots__ = ("scope", "selector", "arg", "value", "line")

    def __init__(self, scope: tuple[str, ...], selector: str, arg: str, value: str,
                 line: int) -> None:
        self.scope, self.selector, self.arg, self.value, self.line = (scope, selector, arg,
                                                                      value, line)


def parse_gin(text: str, file: str = GIN_FILE) -> tuple[str, dict[str, Any]]:
    """``config.gin`` text → ``(class name, the bindings that apply to it)``, with gin's
    rules:

    * the class is the one the unscoped ``run_train.lopt = @[scope/]Class()`` names (the
      last such binding, as gin keeps the last); ``run_train`` is called unscoped, so
      ``scope/run_train.lopt`` bindings do not apply;
    * a binding ``a/b/Class.arg`` applies only when the class is called within scope
      ``a/b`` or one nested in it, more specific scopes overriding less specific ones, the
      last binding winning within one scope; bindings for other scopes are ignored (never
      applied), as are bindings of other configurables;
    * ``%NAME`` is the macro ``NAME = value``; a module path before a name must be a
      suffix of the module gin registers it under; an argument the class's constructor
      does not have is an error, as in gin.

    Values must be finite literals. Anything gin would not parse, ``include`` (the file
    must be self-contained) and unsupported classes raise :class:`CheckpointError`
    naming ``file`` and the line."""
    from xopt.parity.methods import velo as velo_parity
    from xopt.specs import velo

    bindings: list[_Binding] = []
    macros: dict[str, tuple[int, str]] = {}
    for line, src in _statements(text, file):
        head = src.split(None, 1)[0]
        if head in ("import", "from"):
            continue
        if head == "include":
            raise CheckpointError(f"{file}:{line}: 'include' is not supported (a checkpoint's "
                                  "config must be self-contained)")
        lhs, eq, value = src.partition("=")
        m = _LHS.fullmatch(lhs.strip())
        if not eq or not m or not value.strip():
            raise CheckpointError(f"{file}:{line}: {src[:80]!r} is not a gin binding "
                                  "('scope/name.arg = value' or 'MACRO = value')")
        where = f"{file}:{line}"
        _check_syntax(value, where)
        scope = tuple(m["scope"].split("/")) if m["scope"] else ()
        if "." not in m["selector"]:
            if scope:
                raise CheckpointError(f"{where}: a macro name cannot have a scope")
            macros[m["selector"]] = (line, value)
            continue
        selector, arg = m["selector"].rsplit(".", 1)
        bindings.append(_Binding(scope, selector, arg, value, line))

    def resolve(b: _Binding) -> tuple[str, str]:
        """A binding's value with macros followed: (text, where it is)."""
        value, where, seen = b.value.strip(), f"{file}:{b.line}", set()
        while (m := _MACRO_REF.fullmatch(value)) is not None:
            name = m["name"]
            if name in seen or name not in macros:
                why = "refers to itself" if name in seen else "is not defined in the file"
                raise CheckpointError(f"{where}: macro %{name} {why}")
            seen.add(name)
            line, value = macros[name]
            value, where = value.strip(), f"{file}:{line}"
        return value, where

    lopt = [b for b in bindings if not b.scope and b.arg == _LOPT[1]
            and b.selector.split(".")[-1] == _LOPT[0]]
    if not lopt:
        raise CheckpointError(f"{file}: no unscoped 'run_train.lopt = @Class()' binding; "
                              "cannot tell which learned optimizer the checkpoint is for")
    b = lopt[-1]
    ref, where = resolve(b)
    if not _module_ok(b.selector, _LOPT[0]):
        raise CheckpointError(f"{file}:{b.line}: {b.selector!r} is not learned_optimization's "
                              f"run_train ({MODULES['run_train']})")
    m = _REF.fullmatch(ref)
    if not m or not m["call"]:
        raise CheckpointError(f"{where}: run_train.lopt = {ref!r} is not a configurable "
                              "reference '@Class()'")
    cls = m["selector"].split(".")[-1]
    if cls not in CLASSES:
        raise CheckpointError(f"{where}: run_train.lopt names {cls!r}, which xopt does not "
                              f"support; supported: {', '.join(CLASSES)}")
    if not _module_ok(m["selector"], cls):
        raise CheckpointError(f"{where}: {m['selector']!r} is not {MODULES[cls]}.{cls}")
    call_scope = tuple(m["scope"].split("/")) if m["scope"] else ()
    known = set(CLASSES[cls][1])
    if cls == "HyperV2":
        known |= set(velo.VELO_FIXED) | set(velo_parity.INERT)

    kwargs: dict[str, Any] = {}
    ours = [b for b in bindings if b.selector.split(".")[-1] == cls]
    for b in ours:
        if not _module_ok(b.selector, cls):
            raise CheckpointError(f"{file}:{b.line}: {b.selector!r} is not "
                                  f"{MODULES[cls]}.{cls}")
        if b.arg not in known:
            raise CheckpointError(f"{file}:{b.line}: {cls} has no argument {b.arg!r}; its "
                                  f"arguments: {', '.join(sorted(known))}")
    for depth in range(len(call_scope) + 1):  # root scope first: deeper scopes override
        for b in ours:
            if b.scope == call_scope[:depth]:
                value, where = resolve(b)
                if value.startswith("@"):
                    raise CheckpointError(f"{where}: {cls}.{b.arg} = {value!r}: a "
                                          "configurable reference where xopt reads a literal")
                kwargs[b.arg] = _literal(value, f"{where}: {cls}.{b.arg}")
    return cls, kwargs


def read_gin(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    data = _files.read_bytes(path, _files.MAX_CONFIG_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 ({e})") from None
    return parse_gin(text, str(path))


def hparams_from_gin(cls: str, kwargs: Mapping[str, Any], file: str = GIN_FILE):
    """``(class, bindings)`` → xopt hyperparameters: the original constructor's defaults for
    arguments the file leaves out (HyperV2's own 128/64/True, not VeLO's), then the
    original's ``from_kwargs`` (the parity harness's adapter to it)."""
    from xopt.parity.methods import get as get_parity

    method, defaults, _ = CLASSES[cls]
    full = {**defaults, **kwargs}
    _files.check_arch(f"{file}: {cls}", full)
    original = next(iter(get_parity(method).originals.values()))
    try:
        return method, original.from_kwargs(full)
    except (XoptError, TypeError, ValueError, ArithmeticError) as e:
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
            f"# Parameters for run_train:\n# {_RULE}\nrun_train.lopt = @{cls}()\n")


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
