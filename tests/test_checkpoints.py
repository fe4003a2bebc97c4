"""xopt.checkpoints: the fixtures written by the original code read bit-exactly, round trips
reproduce their bytes, and bad input (corrupt bytes, wrong keys, unsupported classes) gives
only CheckpointError with nothing written."""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
from helpers import SHARED

from xopt import checkpoints as C
from xopt.checkpoints import learned_optimization as lo
from xopt.checkpoints import pylo
from xopt.errors import CheckpointError

FIX = SHARED / "fixtures"
META = SHARED / "parity"
pytestmark = pytest.mark.skipif(not FIX.is_dir(), reason="shared fixtures are absent")

LO_SF = FIX / "learned_optimization" / "small_fc_lopt_h32_perturbed"
LO_VELO = FIX / "learned_optimization" / "velo_perturbed"
PYLO_SF = FIX / "pylo" / "small_fc_lopt_h32_perturbed"
PYLO_RNN = FIX / "pylo" / "velo_perturbed_rnn"
PYLO_MLP = FIX / "pylo" / "velo_perturbed_mlp"
# what PyLO does not store (see xopt.checkpoints.pylo): the fixture's step_mult and offsets
SF_PYLO_EXTRA = dict(decays="pylo-defaults", step_mult=0.01)


def golden(method: str) -> dict[str, np.ndarray]:
    if method == "small_fc_lopt":
        files = [META / "small_fc_lopt/meta/h32_l2_key0_perturbed.npz"]
    else:
        files = [META / "velo/meta/velo_key0.npz", META / "velo/meta/velo_key0_perturbed.npz"]
    out: dict[str, np.ndarray] = {}
    for f in files:
        with np.load(f) as z:
            out.update({k: z[k] for k in z.files})
    return out


def golden_canonical(method: str, hp) -> dict[str, np.ndarray]:
    from xopt import specs

    return {k: np.asarray(v) for k, v in
            specs.get(method).meta.from_original(golden(method), hp).items()}


def assert_bit_equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


@pytest.fixture
def pylo_velo(tmp_path):
    d = tmp_path / "pylo_velo"
    shutil.copytree(PYLO_RNN, d / "rnn")
    shutil.copytree(PYLO_MLP, d / "mlp")
    return d


# -- reading the fixtures --------------------------------------------------------------------


@pytest.mark.parametrize("src,method", [(LO_SF, "small_fc_lopt"), (LO_VELO, "velo")])
def test_lo_params_read_bit_exact_to_golden_meta(src, method):
    theta, gen_id, step = lo.read_params(src / "params")
    assert_bit_equal(theta, golden(method))
    assert gen_id.startswith("xopt_fixture_") and step == 0
    assert C.detect(src) == "learned_optimization"
    m, hp, canon = C.load(src)
    assert m == method
    assert_bit_equal(canon, golden_canonical(method, hp))


def test_lo_gin_bindings_parse_to_the_fixture_hyperparameters():
    _, hp, _ = C.load(LO_SF)
    assert (hp.hidden_layers, hp.hidden_size, hp.step_mult, hp.exp_mult) == (2, 32, 0.01, 0.001)
    _, hp, _ = C.load(LO_VELO)
    assert (hp.lstm_hidden_size, hp.param_inits, hp.use_bugged_loss_features) == (512, 256,
                                                                                   False)


def test_gin_missing_hyperv2_arguments_take_hyperv2_defaults_not_velos():
    cls, kw = lo.parse_gin("run_train.lopt = @HyperV2()\n")
    _, hp = lo.hparams_from_gin(cls, kw)
    assert (hp.lstm_hidden_size, hp.param_inits, hp.use_bugged_loss_features) == (128, 64,
                                                                                   True)


def test_gin_continuations_module_paths_and_other_bindings():
    text = ("# comment\nimport learned_optimization.learned_optimizers.adafac_mlp_lopt\n"
            "run_train.num_steps = 10\n"
            "adafac_mlp_lopt.AdafacMLPLOpt.initial_momentum_decays = (0.8,\n    0.9, \\\n"
            "0.95)\nAdafacMLPLOpt.hidden_size = 8\n"
            "run_train.lopt = @adafac_mlp_lopt.AdafacMLPLOpt()\n")
    cls, kw = lo.parse_gin(text)
    assert cls == "AdafacMLPLOpt"
    assert kw == {"initial_momentum_decays": (0.8, 0.9, 0.95), "hidden_size": 8}


def test_pylo_small_fc_reads_bit_exact_with_explicit_decays():
    assert C.detect(PYLO_SF) == "pylo"
    m, hp, canon = C.load(PYLO_SF, **SF_PYLO_EXTRA)
    assert m == "small_fc_lopt"
    assert_bit_equal(canon, golden_canonical(m, hp))


def test_pylo_small_fc_without_decays_says_they_are_not_stored():
    with pytest.raises(CheckpointError, match="not stored in PyLO checkpoints"):
        C.load(PYLO_SF)


def test_pylo_velo_pair_reads_bit_exact(pylo_velo):
    assert C.detect(pylo_velo) == "pylo"
    m, hp, canon = C.load(pylo_velo)
    assert m == "velo"
    assert_bit_equal(canon, golden_canonical(m, hp))


def test_a_single_pylo_velo_module_is_refused_naming_the_layout():
    with pytest.raises(CheckpointError, match="rnn/ and mlp/"):
        C.load(PYLO_RNN)


# -- round trips -----------------------------------------------------------------------------


def _bytes(d, rel):
    return (d / rel).read_bytes()


@pytest.mark.parametrize("src,pylo_fixture", [
    (LO_SF, {"config.json": PYLO_SF / "config.json",
             "model.safetensors": PYLO_SF / "model.safetensors"}),
    (LO_VELO, {f"{sub}/{f}": fx / f for sub, fx in (("rnn", PYLO_RNN), ("mlp", PYLO_MLP))
               for f in ("config.json", "model.safetensors")}),
])
def test_lo_xopt_pylo_xopt_lo_round_trip_is_byte_exact(tmp_path, src, pylo_fixture):
    method, hp, theta, gen_id, step = C.load_learned_optimization(src)
    C.save(tmp_path / "x1", method, hp, theta)
    assert C.detect(tmp_path / "x1") == "xopt"
    m1, hp1, th1 = C.load(tmp_path / "x1")
    assert (m1, hp1) == (method, hp)
    C.save(tmp_path / "p", m1, hp1, th1, format="pylo")
    for rel, fixture in pylo_fixture.items():  # PyLO's own save_pretrained bytes
        assert _bytes(tmp_path / "p", rel) == fixture.read_bytes(), rel
    extra = SF_PYLO_EXTRA if method == "small_fc_lopt" else {}
    m2, hp2, th2 = C.load(tmp_path / "p", **extra)
    assert (m2, hp2) == (method, hp)
    C.save(tmp_path / "x2", m2, hp2, th2)
    m3, hp3, th3 = C.load(tmp_path / "x2")
    assert_bit_equal(th3, theta)
    C.save(tmp_path / "lo", m3, hp3, th3, format="lo", gen_id=gen_id, step=step)
    for f in ("params", "config.gin"):
        assert _bytes(tmp_path / "lo", f) == (src / f).read_bytes(), f


def test_xopt_format_keeps_training_options(tmp_path):
    import dataclasses

    method, hp, theta = C.load(LO_SF, num_training_steps=100)
    hp = dataclasses.replace(hp, lr=0.5)
    C.save(tmp_path / "x", method, hp, theta)
    assert C.load(tmp_path / "x")[1] == hp
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["format"] == "xopt-checkpoint/1" and cfg["method"] == method


# -- bad input -------------------------------------------------------------------------------


def _lo_copy(tmp_path, src=LO_SF):
    d = tmp_path / "lo"
    shutil.copytree(src, d)
    for f in d.iterdir():
        os.chmod(f, 0o644)
    os.chmod(d, 0o755)
    return d


def _rewrite_params(d, edit):
    theta, gen_id, step = lo.read_params(d / "params")
    edit(theta)
    (d / "params").write_bytes(lo.params_bytes(theta, gen_id, step))


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("nn/~/w1"), "nn/~/w1"),
    (lambda t: t.update({"nn/~/w9": np.zeros(3, np.float32)}), "nn/~/w9"),
    (lambda t: t.update({"nn/~/b0": np.zeros(31, np.float32)}), "nn/~/b0"),
    (lambda t: t.update({"rms_decays": np.zeros(1, np.int32)}), "rms_decays"),
])
def test_lo_missing_extra_misshaped_keys_name_file_and_key(tmp_path, edit, match):
    d = _lo_copy(tmp_path)
    _rewrite_params(d, edit)
    with pytest.raises(CheckpointError, match=match) as e:
        C.load(d)
    assert "params" in str(e.value)


@pytest.mark.parametrize("which,edit,match", [
    ("rnn", lambda t: t.pop("step_size.bias"), "step_size.bias"),
    ("mlp", lambda t: t.update({"extra": np.zeros(2, np.float32)}), "extra"),
    ("mlp", lambda t: t.update({"input_weights_": np.zeros((256, 30, 4), np.float32)}),
     "input_weights_"),
])
def test_pylo_missing_extra_misshaped_keys_name_file_and_key(pylo_velo, which, edit, match):
    from xopt.checkpoints import _files

    f = pylo_velo / which / "model.safetensors"
    tensors = _files.read_safetensors(f)
    edit(tensors)
    os.chmod(f, 0o644)
    f.write_bytes(_files.safetensors_bytes(tensors))
    with pytest.raises(CheckpointError, match=match) as e:
        C.load(pylo_velo)
    assert str(f) in str(e.value)


def test_pylo_config_mismatch_names_file_and_key(pylo_velo):
    f = pylo_velo / "mlp" / "config.json"
    os.chmod(f, 0o644)
    cfg = json.loads(f.read_text())
    f.write_text(json.dumps({**cfg, "param_inits": 128}))
    with pytest.raises(CheckpointError, match="param_inits") as e:
        C.load(pylo_velo)
    assert str(f) in str(e.value)


def test_unsupported_gin_class_names_file_and_class(tmp_path):
    d = _lo_copy(tmp_path)
    (d / "config.gin").write_text("run_train.lopt = @LOLv2()\n")
    with pytest.raises(CheckpointError, match="LOLv2") as e:
        C.load(d)
    assert "config.gin" in str(e.value)
    (d / "config.gin").write_text("AdafacMLPLOpt.hidden_size = 32\n")
    with pytest.raises(CheckpointError, match="run_train.lopt"):
        C.load(d)


def test_unknown_directory_names_the_directory(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "README").write_text("hi")
    with pytest.raises(CheckpointError, match="junk.*no known checkpoint format"):
        C.load(tmp_path / "junk")
    with pytest.raises(CheckpointError, match="no such"):
        C.detect(tmp_path / "absent")


def _fuzz_cases(data: bytes, rng: np.random.Generator, n: int):
    for _ in range(n):
        kind = rng.integers(3)
        b = bytearray(data)
        if kind == 0:  # truncate
            b = b[:int(rng.integers(len(b)))]
        elif kind == 1:  # flip bits in a few bytes, biased to the header / structure
            for _ in range(int(rng.integers(1, 4))):
                i = int(rng.integers(min(len(b), 2048))) if rng.random() < 0.8 else \
                    int(rng.integers(len(b)))
                b[i] ^= 1 << int(rng.integers(8))
        else:  # overwrite a run with random bytes
            i = int(rng.integers(min(len(b), 1024)))
            k = int(rng.integers(1, 16))
            b[i:i + k] = rng.integers(0, 256, k, dtype=np.uint8).tobytes()
        yield bytes(b)


def test_random_corruption_of_msgpack_gives_only_checkpoint_errors():
    data = (LO_SF / "params").read_bytes()
    rng = np.random.default_rng(0)
    errors = 0
    for b in _fuzz_cases(data, rng, 300):
        try:
            lo.read_params_bytes(b, "params")
        except CheckpointError as e:
            assert "params" in str(e)
            errors += 1
    assert errors > 100


@pytest.mark.parametrize("src", [PYLO_SF, PYLO_MLP])
def test_random_corruption_of_safetensors_gives_only_checkpoint_errors(tmp_path, src):
    data = (src / "model.safetensors").read_bytes()
    rng = np.random.default_rng(1)
    f = tmp_path / "model.safetensors"
    errors = 0
    for b in _fuzz_cases(data, rng, 150):
        f.write_bytes(b)
        try:
            from xopt.checkpoints import _files

            _files.read_safetensors(f)
        except CheckpointError as e:
            assert str(f) in str(e)
            errors += 1
    assert errors > 50


def test_corrupt_files_through_load_give_checkpoint_errors(tmp_path):
    d = _lo_copy(tmp_path)
    (d / "params").write_bytes((LO_SF / "params").read_bytes()[:100])
    with pytest.raises(CheckpointError, match="params"):
        C.load(d)
    (d / "params").write_bytes(b"")
    with pytest.raises(CheckpointError, match="params"):
        C.load(d)
    p = tmp_path / "p"
    shutil.copytree(PYLO_SF, p)
    os.chmod(p / "model.safetensors", 0o644)
    head = (PYLO_SF / "model.safetensors").read_bytes()
    (p / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + head[8:])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        C.load(p, **SF_PYLO_EXTRA)


# -- atomic writes ---------------------------------------------------------------------------


def test_failing_save_leaves_nothing_and_existing_target_untouched(tmp_path, monkeypatch):
    from xopt.checkpoints import _files

    method, hp, theta = C.load(LO_SF)
    bad = dict(theta)
    bad.pop("mlp/w0")
    with pytest.raises(CheckpointError, match="mlp/w0"):
        C.save(tmp_path / "out", method, hp, bad)
    assert not (tmp_path / "out").exists()
    assert os.listdir(tmp_path) == []

    C.save(tmp_path / "out", method, hp, theta)
    before = {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()}
    with pytest.raises(CheckpointError, match="not empty"):
        C.save(tmp_path / "out", method, hp, theta, format="pylo")

    real = _files.write_file
    calls = []

    def failing(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        real(path, data)

    monkeypatch.setattr(_files, "write_file", failing)
    with pytest.raises(OSError, match="disk full"):
        C.save(tmp_path / "out", method, hp, theta, format="lo", overwrite=True)
    assert {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["out"]
    monkeypatch.setattr(_files, "write_file", real)

    C.save(tmp_path / "out", method, hp, theta, format="lo", overwrite=True)
    assert C.detect(tmp_path / "out") == "learned_optimization"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_pylo_write_drops_nothing_silently_but_the_documented_decays():
    method, hp, theta = C.load(LO_SF)
    files = C.files(method, hp, theta, "pylo")
    assert set(files) == {"config.json", "model.safetensors"}
    assert "decays" in pylo.__doc__
