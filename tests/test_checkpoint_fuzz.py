"""Fuzzing every checkpoint format and the trace loader with corrupted copies of real files.

Each case copies one fixture (a learned_optimization folder, a PyLO MetaMLP folder, an xopt
folder, a parity trace with its meta file), applies one mutation drawn by hypothesis, and
loads the copy: checkpoints through ``xopt.checkpoints.port.port`` (read, convert, write),
traces through ``load_trace`` and every array. A case must end in one of:

* ``error``: a CheckpointError / TraceError naming a file of the copy; nothing written, no
  temporary left, the source untouched;
* ``identical``: accepted, and what was loaded equals the pristine fixture's (the mutation
  hit bytes that carry nothing, e.g. a gin comment);
* ``changed``: accepted with different content, which must still be finite and valid. Only
  the formats without content hashes (learned_optimization, PyLO) and traces may get here;
  for xopt's own format it is a failure.

Any other exception fails the test. CI runs a few cases per format (bounded by example
count, derandomized: the same cases on every run); the long run with its counts is::

    PYTHONPATH=$PWD python tests/test_checkpoint_fuzz.py --examples 300
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import io
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import REPO, SHARED  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from xopt import checkpoints as C  # noqa: E402
from xopt.checkpoints import _files  # noqa: E402
from xopt.checkpoints import learned_optimization as lo  # noqa: E402
from xopt.checkpoints._msgpack import ExtType, packb, unpackb  # noqa: E402
from xopt.checkpoints.port import port  # noqa: E402
from xopt.errors import CheckpointError, TraceError  # noqa: E402
from xopt.parity.trace import load_trace, step_prefix, write_trace  # noqa: E402

FIX = SHARED / "fixtures" if (SHARED / "fixtures").is_dir() else REPO / "tests" / "fixtures"
LO_SF = FIX / "learned_optimization" / "small_fc_lopt_h32_perturbed"
PYLO_SF = FIX / "pylo" / "small_fc_lopt_h32_perturbed"
TRACE = REPO / "xopt" / "parity" / "data" / "small_fc_lopt" / "pylo_sizes_perturbed_seed0.json"
LO_VELO = FIX / "learned_optimization" / "velo_perturbed"
PYLO_RNN = FIX / "pylo" / "velo_perturbed_rnn"
PYLO_MLP = FIX / "pylo" / "velo_perturbed_mlp"
PYLO_KW = {"decays": "pylo-defaults", "step_mult": 0.01}
#: cases CI runs per format and mutation class (the documented long run: ~30)
CI_EXAMPLES = int(os.environ.get("XOPT_FUZZ_EXAMPLES", "8"))

VALUES = (np.nan, np.inf, -np.inf, 3e38, -3e38, 1e-45)  # NaN, ±inf, near float32's max
JSON_VALUES = (-1, 0, 1, 2 ** 31, 2 ** 70, 10 ** 25, 1.5, -0.0, "x", "", True, False, None,
               [], [1], {}, {"a": 1}, json.loads("[" * 40 + "1" + "]" * 40))
GIN_VALUES = ("1e999", "-1e999", "nan", "float('inf')", "1e38", "0.02", "True", "'x'", "None",
              "(1,)", "[]", "10**9", str(2 ** 70), "9" * 40, "-3", "0", "@AdafacMLPLOpt()",
              "%UNDEFINED", "(0.1, 0.2", "1j")
ST_DTYPES = ("F16", "F64", "I32", "BF16", "U8", "X", "", 7)


# -- the fixtures, each in a directory of its own ----------------------------------------------


def _fixture_xopt(src: Path):
    def make(d: Path) -> None:
        method, hp, theta = C.load(src, num_training_steps=100)
        C.save(d, method, hp, theta, "xopt")

    return make


def _fixture_trace(d: Path) -> None:
    t = load_trace(TRACE)
    keep = ("init/",) + tuple(step_prefix(i) + "/" for i in range(2))
    arrays = {k: t.array(k) for k in t.keys() if k.startswith(keep)}
    manifest = {**t.manifest, "steps": 2}
    d.mkdir(parents=True)
    (d / "meta").mkdir()
    shutil.copy(TRACE.parent / t.manifest["meta_params_file"], d / "meta")
    write_trace(d / "case.json", manifest, arrays)
    t.close()


def _copy(*sources: tuple[str, Path]):
    def make(d: Path) -> None:
        for rel, src in sources:
            shutil.copytree(src, d / rel)
        for p in [d, *d.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)

    return make


@dataclasses.dataclass(frozen=True)
class Format:
    kind: str  # "learned_optimization", "pylo", "xopt" or "trace"
    make: Callable[[Path], None]
    load_kw: dict = dataclasses.field(default_factory=dict)  # what the format does not store
    port_to: str = "xopt"


FORMATS = {
    "learned_optimization": Format("learned_optimization", _copy((".", LO_SF)), port_to="pylo"),
    "pylo": Format("pylo", _copy((".", PYLO_SF)), PYLO_KW),
    "xopt": Format("xopt", _fixture_xopt(LO_SF), port_to="lo"),
    "trace": Format("trace", _fixture_trace),
}
#: VeLO's fixtures (17 MB, ../shared only): in the long run (--velo), not in CI
VELO_FORMATS = {
    "learned_optimization_velo": Format("learned_optimization", _copy((".", LO_VELO)),
                                        port_to="pylo"),
    "pylo_velo": Format("pylo", _copy(("rnn", PYLO_RNN), ("mlp", PYLO_MLP))),
    "xopt_velo": Format("xopt", _fixture_xopt(LO_VELO), port_to="lo"),
}
_PRISTINE: dict[str, Path] = {}
_REFERENCE: dict[str, object] = {}


def _format(fmt: str) -> Format:
    return FORMATS.get(fmt) or VELO_FORMATS[fmt]


def _pristine(fmt: str) -> Path:
    if fmt not in _PRISTINE:
        root = Path(tempfile.mkdtemp(prefix=f"xopt-fuzz-{fmt}-"))
        atexit.register(shutil.rmtree, root, True)
        d = root / "src"
        _format(fmt).make(d)
        _PRISTINE[fmt] = d
        _REFERENCE[fmt] = _load(fmt, d)
    return _PRISTINE[fmt]


# -- loading a case ----------------------------------------------------------------------------


def _canon(hp, theta):
    return (repr(hp), {k: (np.asarray(v).dtype.str, np.asarray(v).shape,
                           np.asarray(v).tobytes()) for k, v in theta.items()})


def _load(fmt: str, src: Path):
    """What the case's loader returns, as comparable plain data (raises the named errors)."""
    f = _format(fmt)
    if f.kind == "trace":
        t = load_trace(src / "case.json")
        try:
            arrays = {k: t.array(k).tobytes() + str(t.array(k).dtype).encode() for k in t.keys()}
            meta = {k: v.tobytes() for k, v in (t.meta_params() or {}).items()}
            return json.dumps(t.manifest, sort_keys=True), arrays, meta
        finally:
            t.close()
    method, hp, theta = C.load(src, **f.load_kw)
    for k, a in theta.items():
        assert np.isfinite(a).all(), f"non-finite θ accepted: {k}"
    return method, _canon(hp, theta)


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def run_case(fmt: str, mutate, data) -> str:
    """Copy, mutate, load (and for checkpoints port); the outcome (see the module doc)."""
    pristine = _pristine(fmt)
    with tempfile.TemporaryDirectory(prefix="xopt-fuzz-case-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(pristine, src)
        mutate(src, data)
        before = _snapshot(src)
        dst = Path(tmp) / "dst"
        f = _format(fmt)
        try:
            if f.kind == "trace":
                got = _load(fmt, src)
            else:
                kw = dict(f.load_kw)
                port(src, dst, f.port_to, decays=kw.pop("decays", None), overrides=kw)
                got = _load(fmt, src)
                back = C.load(dst, **(PYLO_KW if f.port_to == "pylo" and "velo" not in fmt
                                      else {}))
                for k, a in back[2].items():
                    assert np.isfinite(a).all(), f"non-finite θ written: {k}"
        except (CheckpointError, TraceError) as e:
            assert str(src) in str(e), f"the error does not name the file: {e}"
            assert sorted(os.listdir(tmp)) == ["src"], os.listdir(tmp)
            assert _snapshot(src) == before
            return "error"
        assert sorted(os.listdir(tmp)) == (["src"] if f.kind == "trace" else ["dst", "src"])
        assert _snapshot(src) == before
        if got == _REFERENCE[fmt]:
            return "identical"
        assert f.kind != "xopt", "a changed xopt checkpoint was accepted (its hashes must " \
                                 "catch it)"
        return "changed"


# -- mutations ---------------------------------------------------------------------------------


def _pick(data, seq, label=None):
    return data.draw(st.sampled_from(list(seq)), label=label)


def _files_of(src: Path, fmt: str) -> list[Path]:
    return sorted(p for p in src.rglob("*") if p.is_file())


def truncate(fmt):
    def m(src, data):
        f = _pick(data, _files_of(src, fmt), "file")
        b = f.read_bytes()
        f.write_bytes(b[:data.draw(st.integers(0, max(len(b) - 1, 0)), label="at")])

    return m


def byte_flip(fmt):
    def m(src, data):
        f = _pick(data, _files_of(src, fmt), "file")
        b = bytearray(f.read_bytes())
        if not b:
            return
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            hi = min(len(b), 2048) if data.draw(st.booleans(), label="head") else len(b)
            b[data.draw(st.integers(0, hi - 1), label="pos")] ^= 1 << data.draw(
                st.integers(0, 7), label="bit")
        f.write_bytes(bytes(b))

    return m


def byte_overwrite(fmt):
    def m(src, data):
        f = _pick(data, _files_of(src, fmt), "file")
        b = bytearray(f.read_bytes())
        i = data.draw(st.integers(0, max(len(b) - 1, 0)), label="pos")
        b[i:i + 8] = data.draw(st.binary(min_size=1, max_size=8), label="bytes")
        f.write_bytes(bytes(b))

    return m


def non_utf8(fmt):
    def m(src, data):
        f = _pick(data, [p for p in _files_of(src, fmt) if p.suffix in (".json", ".gin")],
                  "config")
        b = f.read_bytes()
        i = data.draw(st.integers(0, len(b)), label="pos")
        bad = _pick(data, [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80",
                           b"\x80"], "bytes")
        f.write_bytes(b[:i] + bad + b[i:])

    return m


def _tensor_spans(src: Path, fmt: str) -> dict[str, tuple[Path, int, int, tuple]]:
    """``{file/name: (file, start, end, shape)}`` of θ's raw bytes in the files."""
    out = {}
    if _format(fmt).kind == "learned_optimization":
        f = src / "params"
        b = f.read_bytes()
        theta, _, _ = lo.read_params_bytes(b)
        for k, a in theta.items():
            i = b.find(a.tobytes())
            if i >= 0 and b.find(a.tobytes(), i + 1) < 0:
                out[k] = (f, i, i + a.nbytes, a.shape)
        return out
    for f in _weights(src):
        b = f.read_bytes()
        (n,) = struct.unpack("<Q", b[:8])
        header = json.loads(b[8:8 + n])
        for k, v in header.items():
            s, e = v.get("data_offsets", (0, 0)) if isinstance(v, dict) else (0, 0)
            if k != "__metadata__" and e > s:
                out[f"{f.relative_to(src)}:{k}"] = (f, 8 + n + s, 8 + n + e, tuple(v["shape"]))
    return out


def _weights(src: Path) -> list[Path]:
    return sorted(src.rglob(_files.WEIGHTS))


def _configs(src: Path) -> list[Path]:
    return sorted(src.rglob(_files.CONFIG))


def nonfinite(fmt):
    def m(src, data):
        spans = _tensor_spans(src, fmt)
        f, s, e, _ = spans[_pick(data, sorted(spans), "tensor")]
        b = bytearray(f.read_bytes())
        i = s + 4 * data.draw(st.integers(0, (e - s) // 4 - 1), label="element")
        b[i:i + 4] = struct.pack("<f", _pick(data, VALUES, "value"))
        f.write_bytes(bytes(b))

    return m


def payload_flip(fmt):
    def m(src, data):
        spans = _tensor_spans(src, fmt)
        f, s, e, _ = spans[_pick(data, sorted(spans), "tensor")]
        b = bytearray(f.read_bytes())
        b[data.draw(st.integers(s, e - 1), label="pos")] ^= 1 << data.draw(st.integers(0, 7))
        f.write_bytes(bytes(b))

    return m


def swap(fmt):
    def m(src, data):
        spans = _tensor_spans(src, fmt)
        by_shape = collections.defaultdict(list)
        for k, (f, _, _, shape) in spans.items():
            by_shape[f, shape].append(k)
        pairs = sorted((ks[i], ks[j]) for ks in by_shape.values()
                       for i in range(len(ks)) for j in range(i + 1, len(ks)))
        a, b_ = _pick(data, pairs, "pair")
        (f, s1, e1, _), (_, s2, _, _) = spans[a], spans[b_]
        n = (e1 - s1) // 4  # whole tensors, or the same run of elements of both
        lo_, hi = 0, n
        if n > 1 and data.draw(st.booleans(), label="part"):
            lo_ = data.draw(st.integers(0, n - 1), label="from")
            hi = data.draw(st.integers(lo_ + 1, n), label="to")
        b = bytearray(f.read_bytes())
        x, y = slice(s1 + 4 * lo_, s1 + 4 * hi), slice(s2 + 4 * lo_, s2 + 4 * hi)
        b[x], b[y] = bytes(b[y]), bytes(b[x])
        f.write_bytes(bytes(b))

    return m


# learned_optimization's msgpack


def _edit_tree(tree, data, edit):
    """Apply ``edit(map, key, data)`` to a map drawn from the nested θ maps."""
    maps = []

    def walk(t):
        if isinstance(t, dict):
            maps.append(t)
            for v in t.values():
                walk(v)

    walk(tree)
    node = _pick(data, range(len(maps)), "map")
    edit(maps[node], data)


def msgpack_key_edit(fmt):
    def m(src, data):
        f = src / "params"
        top = unpackb(f.read_bytes())
        how = _pick(data, ["rename", "delete", "add", "duplicate"], "how")
        if how == "duplicate":  # a raw edit: make one key's bytes equal a sibling's
            pairs = []

            def walk(t):
                if isinstance(t, dict):
                    pairs.extend((x, y) for x in t for y in t if x != y and len(x) == len(y))
                    for v in t.values():
                        walk(v)

            walk(top)
            if pairs:
                a, c = _pick(data, sorted(pairs), "keys")
                f.write_bytes(f.read_bytes().replace(packb(a), packb(c), 1))
            return

        def edit(node, data):
            k = _pick(data, sorted(node), "key")
            if how == "rename":
                node[k + _pick(data, ["x", "_", "/"], "suffix")] = node.pop(k)
            elif how == "delete":
                del node[k]
            else:
                node[_pick(data, ["extra", "", "hidden"], "new")] = node[k]

        _edit_tree(top, data, edit)
        f.write_bytes(packb(top))

    return m


def msgpack_header_edit(fmt):
    def m(src, data):
        f = src / "params"
        top = unpackb(f.read_bytes())

        def edit(node, data):
            arrays = [k for k, v in node.items() if isinstance(v, ExtType)]
            if not arrays:
                return
            k = _pick(data, sorted(arrays), "array")
            shape, dtype, buf = unpackb(node[k].data)
            what = _pick(data, ["dtype", "shape", "code", "payload"], "what")
            if what == "dtype":
                dtype = _pick(data, ["float64", "float16", "int32", "bfloat16", "complex64",
                                     "", "float32 "], "dtype")
            elif what == "shape":
                shape = _pick(data, [shape[::-1], shape + [1], shape[:-1], [2 ** 40] + shape,
                                     [0] + shape, [-1], [2 ** 63], "x", [[1]]], "shape")
            elif what == "code":
                node[k] = ExtType(_pick(data, [2, 3, 0, -1], "code"), node[k].data)
                return
            else:
                node[k] = ExtType(1, packb(_pick(data, [[shape, dtype], [shape, dtype, buf, 0],
                                                        {"a": 1}, 5], "payload")))
                return
            node[k] = ExtType(1, packb([shape, dtype, buf]))

        _edit_tree(top["params"], data, edit)
        f.write_bytes(packb(top))

    return m


def msgpack_huge_length(fmt):
    def m(src, data):
        f = src / "params"
        b = f.read_bytes()
        how = _pick(data, ["top map", "key", "bin", "ext", "deep"], "how")
        if how == "top map":
            b = b"\xdf\xff\xff\xff\xff" + b[1:]
        elif how == "key":
            i = b.find(b"\xa6params")
            b = b[:i] + b"\xdb\xff\xff\xff\xff" + b[i + 1:]
        elif how in ("bin", "ext"):
            code = {"bin": (b"\xc5", b"\xc6\xff\xff\xff\xff"),
                    "ext": (b"\xc8", b"\xc9\xff\xff\xff\xff")}[how]
            positions = [i for i in range(len(b)) if b[i:i + 1] == code[0]]
            i = _pick(data, positions[:64], "at")
            b = b[:i] + code[1] + b[i + 3:]
        else:  # nesting far beyond any checkpoint's
            depth = data.draw(st.integers(33, 5000), label="depth")
            b = b"\x81\xa1a" * depth + b
        f.write_bytes(b)

    return m


GIN_ARGS = {"AdafacMLPLOpt": ["step_mult", "exp_mult", "hidden_size", "hidden_layers",
                              "initial_rms_decays"],
            "HyperV2": ["step_mult", "exp_mult", "lstm_hidden_size", "param_inits",
                        "ff_hidden_size", "use_bugged_loss_features"]}


def gin_edit(fmt):
    def m(src, data):
        f = src / "config.gin"
        text = f.read_text()
        cls = re.search(r"@(\w+)\(\)", text)[1]
        other = "HyperV2" if cls == "AdafacMLPLOpt" else "AdafacMLPLOpt"
        lines = text.split("\n")
        how = _pick(data, ["scoped binding", "scoped call", "value", "delete line",
                           "duplicate line", "unknown argument", "module path", "syntax",
                           "macro", "scoped run_train", "other class"], "how")
        arg = _pick(data, GIN_ARGS[cls], "arg")
        value = _pick(data, GIN_VALUES + ("0.5", "8", "(0.5,)"), "value")
        scope = _pick(data, ["eval", "train", "a/b", "other"], "scope")
        if how == "scoped binding":
            lines.append(f"{scope}/{cls}.{arg} = {value}")
        elif how == "scoped call":
            text = text.replace(f"@{cls}()", f"@{scope}/{cls}()")
            lines = text.split("\n") + [f"{scope}/{cls}.{arg} = {value}"] * \
                data.draw(st.booleans(), label="bind in scope")
        elif how == "value":
            binding = _pick(data, [i for i, x in enumerate(lines) if "=" in x], "line")
            lines[binding] = lines[binding].split("=")[0] + "= " + value
        elif how in ("delete line", "duplicate line"):
            i = _pick(data, range(len(lines)), "line")
            lines[i:i + 1] = [] if how == "delete line" else [lines[i], lines[i]]
        elif how == "unknown argument":
            lines.append(f"{cls}.{arg}x = 1")
        elif how == "module path":
            mod = _pick(data, ["adafac_mlp_lopt", "learned_optimizers.adafac_mlp_lopt", "foo",
                               "hyper_v2", "general_lopt.hyper_v2"], "module")
            lines.append(f"{mod}.{cls}.{arg} = {value}")
        elif how == "syntax":
            lines.append(_pick(data, ["include 'x.gin'", f"{cls}.step_mult 0.1",
                                      f"{cls}.step_mult = (", "= 3", "a/b = 1", f"{cls}..x = 1",
                                      "'unterminated", "@x = 1"], "line"))
        elif how == "macro":
            lines.append(f"M = {value}")
            lines.append(f"{cls}.{arg} = %M")
        elif how == "scoped run_train":
            lines.append(f"{scope}/run_train.lopt = @{other}()")
        else:
            lines = text.replace(f"@{cls}()", f"@{other}()").split("\n")
        f.write_text("\n".join(lines))

    return m


# safetensors and config.json


def _header(f: Path) -> tuple[dict, bytes]:
    b = f.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    return json.loads(b[8:8 + n]), b[8 + n:]


def _write_header(f: Path, header: dict, body: bytes, length=None) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    f.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + body)


def st_header_edit(fmt):
    def m(src, data):
        f = _pick(data, _weights(src), "file")
        header, body = _header(f)
        names = sorted(k for k in header if k != "__metadata__")
        k = _pick(data, names, "tensor")
        what = _pick(data, ["dtype", "shape", "offsets", "rename", "delete", "extra field",
                            "metadata"], "what")
        if what == "dtype":
            header[k]["dtype"] = _pick(data, ST_DTYPES, "dtype")
        elif what == "shape":
            s = header[k]["shape"]
            header[k]["shape"] = _pick(data, [s[::-1], s + [1], s[:-1], [2 ** 40] + s,
                                              [0] + s, [-1], "x", [1.5]], "shape")
        elif what == "offsets":
            a, b_ = header[k]["data_offsets"]
            header[k]["data_offsets"] = _pick(data, [[a, b_ + 4], [a + 4, b_], [b_, a],
                                                     [0, 2 ** 64], [a], "x"], "offsets")
        elif what == "rename":
            header[k + _pick(data, ["x", "_", ".0"], "suffix")] = header.pop(k)
        elif what == "delete":
            del header[k]
        elif what == "extra field":
            header[k]["extra"] = 1
        else:
            meta = header.setdefault("__metadata__", {})
            key = _pick(data, sorted(meta) + ["format"], "key")
            meta[key] = _pick(data, ["0" * 64, "", 1, None, "xopt-checkpoint/1"], "value")
        _write_header(f, header, body)

    return m


def st_huge_length(fmt):
    def m(src, data):
        f = _pick(data, _weights(src), "file")
        header, body = _header(f)
        how = _pick(data, ["header length", "offset", "deep"], "how")
        if how == "header length":
            _write_header(f, header, body, _pick(data, [2 ** 63, 2 ** 32, 10 ** 9,
                                                        len(f.read_bytes())], "length"))
        elif how == "offset":
            k = _pick(data, sorted(x for x in header if x != "__metadata__"), "tensor")
            header[k]["data_offsets"][1] = 2 ** _pick(data, [31, 40, 62, 64, 70], "log2")
            _write_header(f, header, body)
        else:
            k = _pick(data, sorted(x for x in header if x != "__metadata__"), "tensor")
            text = json.dumps(header, separators=(",", ":"))
            depth = data.draw(st.integers(33, 100_000), label="depth")
            text = text.replace(f'"{k}":', f'"{k}":' + "[" * depth, 1)
            text = text.replace("}}", "}" + "]" * depth + "}", 1) if depth else text
            raw = text.encode()
            f.write_bytes(struct.pack("<Q", len(raw)) + raw + body)

    return m


def config_edit(fmt):
    def m(src, data):
        f = _pick(data, _configs(src), "file")
        cfg = json.loads(f.read_text())
        how = _pick(data, ["value", "delete", "add", "rename", "nested"], "how")
        path = [_pick(data, sorted(cfg), "key")]
        node = cfg
        if how != "delete" and isinstance(cfg[path[0]], dict) and cfg[path[0]]:
            node = cfg[path[0]]
            if "hyperparameters" in node and data.draw(st.booleans(), label="deeper"):
                node = node["hyperparameters"]
            path = [_pick(data, sorted(node), "sub key")]
        k = path[0]
        if how == "value":
            node[k] = _pick(data, JSON_VALUES, "value")
        elif how == "delete":
            del node[k]
        elif how == "add":
            node[k + "_extra"] = 1
        elif how == "rename":
            node[k + "x"] = node.pop(k)
        else:
            node[k] = json.loads("[" * 40 + "1" + "]" * 40)
        text = json.dumps(cfg, indent=2)
        if data.draw(st.booleans(), label="raw number"):
            text = re.sub(r"(\d+\.\d+|\b\d+\b)", _pick(data, ["1e999", "NaN", "Infinity",
                                                              "9" * 5000, "-1e400"], "raw"),
                          text, count=1)
        f.write_text(text)

    return m


# traces


def manifest_edit(fmt):
    def m(src, data):
        f = src / "case.json"
        man = json.loads(f.read_text())
        how = _pick(data, ["issue", "value", "delete", "rename", "source"], "how")
        if how == "issue":  # the mistyped fields of issue 27
            k, v = _pick(data, [("source", "x"), ("dtype", {}), ("hyperparameters", [1]),
                                ("steps", True), ("params", {"w": "x"}), ("steps", 2 ** 40),
                                ("meta_params_file", "/etc/passwd"), ("meta_params_file", 7),
                                ("meta_params_file", "../../x.npz"),
                                ("meta_params", {"sha256": 1}), ("kind", "model"),
                                ("num_training_steps", -1), ("inputs", 3)], "field")
            man[k] = v
        elif how == "value":
            man[_pick(data, sorted(man), "key")] = _pick(data, JSON_VALUES, "value")
        elif how == "delete":
            del man[_pick(data, sorted(man), "key")]
        elif how == "rename":
            k = _pick(data, sorted(man), "key")
            man[k + "x"] = man.pop(k)
        else:
            man["source"][_pick(data, sorted(man["source"]), "key")] = _pick(
                data, JSON_VALUES, "value")
        f.write_text(json.dumps(man))

    return m


def npy_header_edit(fmt):
    def m(src, data):
        f = src / "case.npz"
        with zipfile.ZipFile(f) as z:
            members = {i.filename: z.read(i) for i in z.infolist()}
        name = _pick(data, sorted(members), "member")
        raw = members[name]
        buf = io.BytesIO(raw)
        version = np.lib.format.read_magic(buf)
        hlen = struct.unpack("<H" if version == (1, 0) else "<I",
                             raw[8:10] if version == (1, 0) else raw[8:12])[0]
        start = 10 if version == (1, 0) else 12
        header = raw[start:start + hlen].decode("latin1")
        what = _pick(data, ["shape", "dtype", "drop", "add"], "what")
        if what == "shape":
            header = re.sub(r"'shape': \(([^)]*)\)", "'shape': (" + _pick(
                data, ["100000000000, ", "3, 3, 3", "", "-1, ", "2**70, "], "shape") + ")",
                header)
        elif what == "dtype":
            header = re.sub(r"'descr': '[^']*'", "'descr': '" + _pick(
                data, ["<f8", "<i4", "|O", "<c16", "x", "<U3"], "dtype") + "'", header)
        if what == "drop":
            del members[name]
        elif what == "add":
            members["extra.npy"] = raw
        else:
            new = header.encode("latin1")
            new += b" " * (-(start + len(new) + 1) % 64) + b"\n" if not new.endswith(b"\n") \
                else b""
            raw = raw[:8] + struct.pack("<H" if version == (1, 0) else "<I", len(new)) + new \
                + raw[start + hlen:]
            members[name] = raw
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
            for k, v in members.items():
                z.writestr(k, v)

    return m


def array_edit(fmt):
    def m(src, data):
        f = src / "case.npz"
        with np.load(f) as z:
            arrays = {k: z[k] for k in z.files}
        k = _pick(data, sorted(arrays), "array")
        a = arrays[k]
        how = _pick(data, ["dtype", "shape", "drop", "nonfinite"], "how")
        if how == "dtype":
            arrays[k] = a.astype(_pick(data, [np.float64, np.int32, np.float16], "dtype"))
        elif how == "shape":
            arrays[k] = np.zeros(a.shape + (2,), a.dtype)
        elif how == "drop":
            del arrays[k]
        elif a.size and a.dtype.kind == "f":
            arrays[k] = a.copy()
            arrays[k].flat[0] = _pick(data, VALUES, "value")
        np.savez_compressed(f, **arrays)

    return m


COMMON = [truncate, byte_flip, byte_overwrite, non_utf8]
THETA = [nonfinite, payload_flip, swap]
SAFETENSORS = [st_header_edit, st_huge_length, config_edit]
MUTATIONS = {
    "learned_optimization": COMMON + THETA + [msgpack_key_edit, msgpack_header_edit,
                                              msgpack_huge_length, gin_edit],
    "pylo": COMMON + THETA + SAFETENSORS,
    "xopt": COMMON + THETA + SAFETENSORS,
    "trace": COMMON + [manifest_edit, npy_header_edit, array_edit],
}


def _case(fmt: str, mutation, examples: int, counts: collections.Counter | None = None):
    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def case(data):
        outcome = run_case(fmt, mutation(fmt), data)
        if counts is not None:
            counts[outcome] += 1

    return case


@pytest.mark.parametrize("fmt,mutation", [(f, m) for f in sorted(FORMATS)
                                          for m in MUTATIONS[FORMATS[f].kind]],
                         ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_corrupt_inputs_give_only_named_errors(fmt, mutation):
    _case(fmt, mutation, CI_EXAMPLES)()


def main(argv: list[str]) -> int:
    import argparse
    import math

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=300,
                   help="cases per format, shared equally by its mutation classes")
    p.add_argument("--velo", action="store_true",
                   help="also VeLO's fixtures (learned_optimization, PyLO, xopt; ../shared)")
    args = p.parse_args(argv)
    outcomes = ("error", "identical", "changed")
    for fmt in sorted(FORMATS) + (sorted(VELO_FORMATS) if args.velo else []):
        mutations = MUTATIONS[_format(fmt).kind]
        per = math.ceil(args.examples / len(mutations))
        rows = {}
        for mutation in mutations:
            counts: collections.Counter = collections.Counter()
            _case(fmt, mutation, per, counts)()
            rows[mutation.__name__] = counts
        total = sum(rows.values(), collections.Counter())
        print(f"{fmt}: {sum(total.values())} cases: "
              + ", ".join(f"{o} {total[o]}" for o in outcomes))
        for name, counts in rows.items():
            print(f"  {name:20s} " + "  ".join(f"{o} {counts[o]:4d}" for o in outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
