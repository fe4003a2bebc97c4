"""Trace reading, validation and atomic writing; bad traces fail naming file and key."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from xopt.errors import HyperparameterError, TraceError, UnknownMethodError
from xopt.parity import bundled_traces, load_trace, write_trace
from xopt.parity.trace import step_prefix

ADAMW = bundled_traces("adamw")
TORCH_ADAMW = next(p for p in ADAMW if p.stem.startswith("torch_"))
GALORE = Path(__file__).resolve().parents[1] / "xopt/parity/data/galore/adamw_left_r4_gap5.json"


@pytest.mark.parametrize("path", [*ADAMW, GALORE], ids=lambda p: p.stem)
def test_bundled_traces_load_and_validate(path):
    t = load_trace(path)
    assert t.steps > 0 and t.params
    for name, shape in t.params.items():
        assert t.init_params()[name].shape == shape
        assert t.grads(t.steps - 1)[name].shape == shape
        assert t.params_after(t.steps - 1)[name].shape == shape
    assert t.state_after(0)
    t.close()


def test_golden_trace_written_by_original_recorder_reads(tmp_path):
    # galore/adamw_left_r4_gap5 was written by the shared golden recorder (GaLore's code).
    t = load_trace(GALORE)
    assert t.method == "galore" and t.source_object.startswith("galore_torch.GaLoreAdamW")
    assert t.aux(0)["mlp/0/weight/proj_refreshed"].dtype == np.bool_
    assert t.loss(0) is not None


def _copy_case(tmp_path: Path, src: Path = ADAMW[0]) -> tuple[dict, dict, Path]:
    t = load_trace(src)
    arrays = {k: t.array(k) for k in t.keys()}
    manifest = json.loads(json.dumps(t.manifest))
    return manifest, arrays, tmp_path / src.name


def test_write_then_read_is_identical(tmp_path):
    manifest, arrays, path = _copy_case(tmp_path)
    write_trace(path, manifest, arrays)
    back = load_trace(path)
    assert back.manifest == manifest
    assert set(back.keys()) == set(arrays)
    for k, v in arrays.items():
        assert np.array_equal(back.array(k), v) and back.array(k).dtype == v.dtype


def test_missing_array_is_named(tmp_path):
    manifest, arrays, path = _copy_case(tmp_path)
    del arrays[f"{step_prefix(7)}/grad/mlp/0/bias"]
    write_trace(path, manifest, arrays)
    with pytest.raises(TraceError, match=r"\.npz: missing array 'step_0007/grad/mlp/0/bias'"):
        load_trace(path)


def test_wrong_shape_is_named(tmp_path):
    manifest, arrays, path = _copy_case(tmp_path)
    arrays["init/param/tensor3"] = np.zeros((4, 3), np.float32)
    write_trace(path, manifest, arrays)
    with pytest.raises(TraceError, match=r"'init/param/tensor3' has shape \(4, 3\), "
                                         r"manifest says \(4, 3, 5\)"):
        load_trace(path)


def test_wrong_dtype_is_named(tmp_path):
    manifest, arrays, path = _copy_case(tmp_path)
    arrays["step_0000/param/scale"] = arrays["step_0000/param/scale"].astype(np.float64)
    write_trace(path, manifest, arrays)
    with pytest.raises(TraceError, match=r"'step_0000/param/scale' has dtype float64"):
        load_trace(path)


def test_manifest_problems_are_named(tmp_path):
    manifest, arrays, path = _copy_case(tmp_path)
    write_trace(path, manifest, arrays)
    path.write_text("{not json")
    with pytest.raises(TraceError, match="manifest: not valid JSON"):
        load_trace(path)
    bad = dict(manifest)
    del bad["params"]
    path.write_text(json.dumps(bad))
    with pytest.raises(TraceError, match="lacks key.*params"):
        load_trace(path)
    path.write_text(json.dumps({**manifest, "format": "xopt-trace/9"}))
    with pytest.raises(TraceError, match="xopt-trace/9"):
        load_trace(path)


def test_truncated_npz_is_a_clean_error(tmp_path):
    manifest, arrays, path = _copy_case(tmp_path)
    write_trace(path, manifest, arrays)
    npz = path.with_suffix(".npz")
    data = npz.read_bytes()
    npz.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match=r"\.npz"):
        load_trace(path)


def test_unknown_method_and_hyperparameters_fail_the_harness(tmp_path):
    from xopt.parity.harness import run_parity

    manifest, arrays, path = _copy_case(tmp_path)
    write_trace(path, {**manifest, "method": "velox"}, arrays)
    with pytest.raises(UnknownMethodError, match="velox"):
        run_parity(load_trace(path).method, [path])
    with pytest.raises(TraceError, match="for method 'velox', not 'adamw'"):
        run_parity("adamw", [path])
    hp = {**manifest["hyperparameters"], "momentum": 0.9}
    write_trace(path, {**manifest, "hyperparameters": hp}, arrays)
    with pytest.raises(HyperparameterError, match="hyperparameters: unknown .*'momentum'"):
        run_parity("adamw", [path])


def test_state_with_wrong_shape_fails_the_harness(tmp_path):
    from xopt.errors import StateError
    from xopt.parity.harness import run_parity

    manifest, arrays, path = _copy_case(tmp_path)
    assert manifest["source"]["object"] == "optax.adamw"
    arrays["step_0005/state/0/mu/mlp/0/bias"] = np.zeros(3, np.float32)
    write_trace(path, manifest, arrays)
    with pytest.raises(StateError, match=r"'m/mlp/0/bias' has shape \(3,\), expected \(32,\)"):
        run_parity("adamw", [path], backends=["oracle"])


def test_write_is_atomic_and_leaves_nothing_on_failure(tmp_path):
    manifest, arrays, path = _copy_case(tmp_path)
    write_trace(path, manifest, arrays)
    before = path.read_bytes(), path.with_suffix(".npz").read_bytes()

    class Boom:
        def __array__(self, *a, **k):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_trace(path, manifest, {**arrays, "x": Boom()})
    assert (path.read_bytes(), path.with_suffix(".npz").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name,
                                                                 path.with_suffix(".npz").name])
    with pytest.raises(TraceError, match="lacks key"):
        write_trace(tmp_path / "other.json", {"format": "xopt-trace/1"}, arrays)
    assert not (tmp_path / "other.json").exists()


def test_npz_path_accepted_and_missing_npz_named(tmp_path):
    manifest, arrays, path = _copy_case(tmp_path)
    write_trace(path, manifest, arrays)
    assert load_trace(path.with_suffix(".npz")).case == manifest["case"]
    shutil.move(path.with_suffix(".npz"), tmp_path / "elsewhere.npz")
    with pytest.raises(TraceError, match="no such trace array file"):
        load_trace(path)


@pytest.mark.parametrize("field,value,match", [
    ("source", "x", "'source' = 'x' must be an object"),
    ("dtype", {}, "'dtype' = {} must name a floating NumPy dtype"),
    ("dtype", "int32", "'dtype' = 'int32' must name a floating NumPy dtype"),
    ("hyperparameters", [1], "'hyperparameters' = [1] must be an object"),
    ("steps", True, "'steps' = True must be a positive integer"),
    ("steps", 0, "'steps' = 0 must be a positive integer"),
    ("steps", 2 ** 40, "'steps' = 1099511627776 must be a positive integer (at most"),
    ("params", {"w": "x"}, "'params' entry 'w' = 'x' must be a shape"),
    ("params", [], "'params' = [] must be an object"),
    ("kind", "model", "'kind' = 'model' must be one of optimizer, layer"),
    ("method", 3, "'method' = 3 must be a non-empty string"),
    ("num_training_steps", 0, "'num_training_steps' = 0 must be a positive integer"),
    ("meta_params_file", 3, "'meta_params_file' = 3 must be a file path"),
    ("meta_params", {"base_file": ""}, "'meta_params.base_file' = '' must be a file path"),
    ("meta_params", {"sha256": 1}, "'meta_params.sha256' = 1 is not a SHA-256 hex digest"),
    ("inputs", 3, "'inputs' = 3 must be a list or an object"),
])
def test_mistyped_manifest_fields_exit_2_naming_the_field(tmp_path, capsys, field, value,
                                                          match):
    from xopt.cli import main

    manifest, arrays, path = _copy_case(tmp_path)
    write_trace(path, manifest, arrays)
    path.write_text(json.dumps({**manifest, field: value}))
    rc = main(["parity", "adamw", "--trace", str(path), "--backends", "oracle", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and f"xopt: error: {path}: {match}" in err, err
    with pytest.raises(TraceError, match=re.escape(match)):
        load_trace(path)
    with pytest.raises(TraceError, match=re.escape(match)):  # nor is such a trace written
        write_trace(tmp_path / "other.json", {**manifest, field: value}, arrays)
    assert not (tmp_path / "other.json").exists() and not (tmp_path / "other.npz").exists()


@pytest.mark.parametrize("text,match", [
    (b'{"format": "xopt-trace/1", "format": "x"}', "key 'format' appears twice"),
    (b'{"steps": NaN}', "key 'steps' is nan, not a finite number"),
    (b'{"steps": 1e999}', "key 'steps' is inf, not a finite number"),
    (b'{"a": ' * 1000 + b"1" + b"}" * 1000, "JSON nested deeper than 32 levels"),
    (b'{"case": "\xff"}', "not UTF-8"),
])
def test_hostile_manifest_json_is_a_trace_error(tmp_path, text, match):
    manifest, arrays, path = _copy_case(tmp_path)
    write_trace(path, manifest, arrays)
    path.write_bytes(text)
    with pytest.raises(TraceError, match=re.escape(match)) as e:
        load_trace(path)
    assert str(path) in str(e.value)


def test_an_array_declaring_more_data_than_its_entry_holds_is_refused(tmp_path):
    import io
    import zipfile

    manifest, arrays, path = _copy_case(tmp_path)
    write_trace(path, manifest, arrays)
    npz = path.with_suffix(".npz")
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.zeros(4, np.float32))
    raw = buf.getvalue().replace(b"'shape': (4,)", b"'shape': (100000000000,)", 1)
    with zipfile.ZipFile(npz, "a") as z:
        z.writestr("step_0000/aux/huge.npy", raw)
    t = load_trace(path)
    with pytest.raises(TraceError, match=r"'step_0000/aux/huge' declares shape "
                                         r"\(100000000000,\) of float32 \(400000000000 bytes\)"):
        t.array("step_0000/aux/huge")
    t.close()


@pytest.mark.parametrize("betas", ["x", [], None, [0.9]])
def test_a_mistyped_hyperparameter_value_exits_2_naming_the_trace(tmp_path, capsys, betas):
    from xopt.cli import main

    manifest, arrays, path = _copy_case(tmp_path, TORCH_ADAMW)
    write_trace(path, {**manifest, "hyperparameters": {**manifest["hyperparameters"],
                                                       "betas": betas}}, arrays)
    rc = main(["parity", "adamw", "--trace", str(path), "--backends", "oracle", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and f"xopt: error: {path}: hyperparameters: " in err, err


_LAYER_DATA = Path(__file__).resolve().parents[1] / "xopt/parity/data"


@pytest.mark.parametrize("method,case,where,value", [
    ("poet", "cayley_neumann_b8", ("block_size",), "x"),
    ("poet", "cayley_neumann_b8", ("block_size",), 8.5),
    ("poet", "train_in64_out48_b16_merge4", ("POETConfig", "merge_interval"), None),
    ("poet", "train_in64_out48_b16_merge4", ("POETConfig", "block_size"), 1),
    ("compact", "linear_in32_out24_r0.25", ("nn.Linear", "in_features"), None),
    ("compact", "linear_in32_out24_r0.25", ("nn.Linear", "out_features"), [1]),
    ("compact", "linear_in32_out24_r0.25", ("Projector", "gap"), "x"),
    ("compact", "llama2block_h16_r0.25", ("LlamaConfig", "vocab_size"), [1]),
    ("compact", "llama2block_h16_r0.25", ("LlamaConfig", "num_attention_heads"), 3),
])
def test_a_layer_trace_with_a_mistyped_hyperparameter_exits_2_naming_the_trace(
        tmp_path, capsys, method, case, where, value):
    """The layer drivers read their traces' recorded architectures and settings as strictly
    as the optimizer traces: a wrong type or an impossible size exits 2 naming the file."""
    from xopt.cli import main

    src = _LAYER_DATA / method / f"{case}.json"
    manifest = json.loads(src.read_text())
    node = manifest["hyperparameters"]
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    path = tmp_path / src.name
    path.write_text(json.dumps(manifest))
    shutil.copy(src.with_suffix(".npz"), path.with_suffix(".npz"))
    rc = main(["parity", method, "--trace", str(path), "--backends", "torch", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and f"xopt: error: {path}: hyperparameters: " in err, err
