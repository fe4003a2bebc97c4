"""xopt.checkpoints: the fixtures written by the original code read bit-exactly, round trips
reproduce their bytes, and bad input (corrupt bytes, wrong keys, unsupported classes) gives
only CheckpointError with nothing written."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import types

import numpy as np
import pytest
from helpers import REPO, SHARED, has_torch

from xopt import checkpoints as C
from xopt.checkpoints import learned_optimization as lo
from xopt.checkpoints import pylo
from xopt.errors import CheckpointError

# ../shared when it is beside the checkout; otherwise the copies in the repository: the
# small_fc_lopt fixtures (40 KB, tests/fixtures, byte-identical: test_bundled_fixtures_...)
# and the golden meta files bundled with the package. VeLO's fixtures (17 MB) are not
# copied; the tests that need them skip without ../shared.
FIX = SHARED / "fixtures" if (SHARED / "fixtures").is_dir() else REPO / "tests" / "fixtures"
META = SHARED / "parity" if (SHARED / "parity").is_dir() else REPO / "xopt" / "parity" / "data"

LO_SF = FIX / "learned_optimization" / "small_fc_lopt_h32_perturbed"
LO_VELO = FIX / "learned_optimization" / "velo_perturbed"
PYLO_SF = FIX / "pylo" / "small_fc_lopt_h32_perturbed"
PYLO_RNN = FIX / "pylo" / "velo_perturbed_rnn"
PYLO_MLP = FIX / "pylo" / "velo_perturbed_mlp"
# what PyLO does not store (see xopt.checkpoints.pylo): the fixture's step_mult and offsets
SF_PYLO_EXTRA = dict(decays="pylo-defaults", step_mult=0.01)


VELO_FIXTURES = (FIX / "learned_optimization" / "velo_perturbed").is_dir()
_VELO_NAMES = {"LO_VELO", "PYLO_RNN", "PYLO_MLP", "pylo_velo"}


@pytest.fixture(autouse=True)
def _skip_without_velo_fixtures(request):
    """Tests that read VeLO's fixtures (directly, through the ``pylo_velo`` fixture or a
    parameter) skip where only the bundled small_fc_lopt fixtures exist."""
    if VELO_FIXTURES:
        return
    names = set(request.function.__code__.co_names) | set(request.fixturenames)
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if names & _VELO_NAMES or any("velo" in str(v) for v in params.values()):
        pytest.skip("VeLO's checkpoint fixtures (17 MB) are in ../shared/fixtures only")


@pytest.mark.skipif(not (SHARED / "fixtures").is_dir(), reason="../shared is absent")
def test_bundled_fixtures_are_byte_identical_to_shared():
    # the copies of ../shared/fixtures (tests/fixtures/parity holds xopt's own recordings)
    bundled = sorted(p for sub in ("learned_optimization", "pylo")
                     for p in (REPO / "tests" / "fixtures" / sub).rglob("*") if p.is_file())
    assert len(bundled) == 4
    for p in bundled:
        rel = p.relative_to(REPO / "tests" / "fixtures")
        assert p.read_bytes() == (SHARED / "fixtures" / rel).read_bytes(), rel


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
    assert cfg["format"] == "xopt-checkpoint/2" and cfg["method"] == method


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


# -- the original reads what xopt writes (needs learned_optimization importable) -------------


def _original_or_skip():
    from xopt.parity.originals import learned_optimization as orig

    if not orig.available():
        pytest.skip("learned_optimization is not importable (see "
                    "xopt/parity/originals/learned_optimization.py to make it so)")
    return orig.import_modules()


@pytest.mark.parametrize("method,arch", [
    ("small_fc_lopt", dict(hidden_size=8, hidden_layers=1, exp_mult=0.002,
                           initial_rms_decays=(0.99,))),
    ("velo", dict(lstm_hidden_size=16, param_inits=8, ff_hidden_size=3)),
])
def test_original_opt_from_checkpoint_loads_what_xopt_writes(tmp_path, method, arch):
    mods = _original_or_skip()
    import jax
    from flax import serialization

    from xopt import specs
    from xopt.checkpoints import learned_optimization as lo_fmt

    spec = specs.get(method)
    hp = spec.hyperparams(**arch)
    theta = spec.meta.init(hp, 3)
    rng = np.random.default_rng(0)
    theta = {k: (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32)
             for k, v in theta.items()}  # no zero biases, offsets or LSTM state
    C.save(tmp_path / "ck", method, hp, theta, format="lo", gen_id="g", step=7)
    opt = mods.opt_from_checkpoint.opt_from_checkpoint(str(tmp_path / "ck" / "params"))
    restored = {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path):
                np.asarray(leaf)
                for path, leaf in jax.tree_util.tree_flatten_with_path(opt.ginned.theta)[0]}
    assert_bit_equal(restored, {k: np.asarray(v) for k, v in
                                spec.meta.to_original(theta, hp).items()})
    # the msgpack structure is the original's: flax serializes the restored checkpoint to
    # the very bytes xopt wrote
    ckpt = serialization.msgpack_restore((tmp_path / "ck" / "params").read_bytes())
    assert list(ckpt) == ["params", "gen_id", "step"] and ckpt["step"] == 7
    lopt_theta = opt.lopt.init(jax.random.PRNGKey(0))
    from learned_optimization import checkpoints
    from learned_optimization.outer_trainers import gradient_learner

    template = gradient_learner.ParameterCheckpoint(lopt_theta, "", 0)
    loaded = checkpoints.load_state(str(tmp_path / "ck" / "params"), template)
    assert serialization.to_bytes(loaded) == (tmp_path / "ck" / "params").read_bytes()
    assert lo_fmt.gin_text(method, hp) == (tmp_path / "ck" / "config.gin").read_text()


# -- behaviour: θ from each checkpoint reproduces the golden trace sharing it ----------------


def _pylo_velo_dir(tmp_path):
    d = tmp_path / "pylo_velo"
    shutil.copytree(PYLO_RNN, d / "rnn")
    shutil.copytree(PYLO_MLP, d / "mlp")
    return d


GOLDEN_CASES = pytest.mark.parametrize("fixture,trace", [
    ("lo_sf", "small_fc_lopt/pylo_sizes_perturbed_seed0.json"),
    ("pylo_sf", "small_fc_lopt/pylo_sizes_perturbed_seed0.json"),
    ("lo_velo", "velo/perturbed_seed0.json"),
    ("pylo_velo", "velo/perturbed_seed0.json"),
])


@GOLDEN_CASES
def test_theta_from_each_fixture_reproduces_its_golden_trace(tmp_path, fixture, trace):
    _reproduce_golden(tmp_path, fixture, trace, max_steps=5)  # 5 steps: the suite stays fast


@pytest.mark.slow
@GOLDEN_CASES
def test_theta_from_each_fixture_reproduces_its_whole_golden_trace(tmp_path, fixture, trace):
    _reproduce_golden(tmp_path, fixture, trace, max_steps=None)


def _reproduce_golden(tmp_path, fixture, trace, max_steps):
    from helpers import has_torch

    from xopt import specs
    from xopt.parity import load_trace
    from xopt.parity.harness import run_parity

    if not has_torch:
        pytest.skip("torch is not installed")
    src = {"lo_sf": LO_SF, "pylo_sf": PYLO_SF, "lo_velo": LO_VELO}.get(fixture) or \
        _pylo_velo_dir(tmp_path)
    method, hp, theta = C.load(src, **(SF_PYLO_EXTRA if fixture == "pylo_sf" else {}))
    t = load_trace(META / trace)
    t.meta_params = lambda: specs.get(method).meta.to_original(theta, hp)  # θ from the file
    report = run_parity(method, [t], backends=["torch"], modes=["teacher_forced"],
                        explicit_backends=True, max_steps=max_steps)
    assert report.verdict == "agree", [r.worst for r in report.runs]
    assert report.runs and all(r.tolerance.rel <= 1e-6 for r in report.runs)


# -- xopt port ---------------------------------------------------------------------------------


def test_port_cli_converts_and_verifies(tmp_path, capsys):
    from xopt.cli import main

    rc = main(["port", str(PYLO_SF), str(tmp_path / "lo"), "--to", "lo", "--decays",
               "pylo-defaults", "--set", "step_mult=0.01", "--verify"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "verify: identical" in out
    assert (tmp_path / "lo" / "config.gin").read_bytes() == (LO_SF / "config.gin").read_bytes()
    theta, _, _ = lo.read_params(tmp_path / "lo" / "params")
    assert_bit_equal(theta, golden("small_fc_lopt"))
    rc = main(["port", str(LO_SF), str(tmp_path / "p"), "--to", "pylo", "--verify"])
    out = capsys.readouterr().out
    assert rc == 0 and "decay offsets" in out  # says what PyLO cannot keep


def test_port_cli_bad_input_exits_2_and_writes_nothing(tmp_path, capsys):
    from xopt.cli import main

    assert main(["port", str(PYLO_SF), str(tmp_path / "a")]) == 2  # decays not given
    assert "not stored in PyLO" in capsys.readouterr().err
    (tmp_path / "junk").mkdir()
    assert main(["port", str(tmp_path / "junk"), str(tmp_path / "b")]) == 2
    assert "no known checkpoint format" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["junk"]


def test_port_verify_catches_a_changed_theta(tmp_path, monkeypatch, capsys):
    from xopt.cli import main

    real = pylo.velo_files

    def off_by_one_ulp(hp, theta):
        theta = dict(theta)
        theta["lstm/init_cell"] = np.nextafter(theta["lstm/init_cell"], np.float32(np.inf))
        return real(hp, theta)

    monkeypatch.setattr(pylo, "velo_files", off_by_one_ulp)
    rc = main(["port", str(LO_VELO), str(tmp_path / "p"), "--to", "pylo", "--verify"])
    assert rc == 1, capsys.readouterr().out
    assert "DIFFERENT" in capsys.readouterr().out


# -- torch from_pretrained / save_pretrained / hub --------------------------------------------


def test_torch_from_pretrained_and_save_pretrained_round_trip(tmp_path):
    torch = pytest.importorskip("torch")
    import xopt.torch as xt

    w = torch.nn.Parameter(torch.ones(3, 4))
    opt = xt.VeLO.from_pretrained([w], LO_VELO, num_training_steps=50)
    assert opt.hp.num_training_steps == 50 and opt.hp.lstm_hidden_size == 512
    _, hp, canon = C.load(LO_VELO)
    assert_bit_equal({k: v.numpy() for k, v in opt.meta.items()}, canon)
    opt.save_pretrained(tmp_path / "x")
    again = xt.VeLO.from_pretrained([w], tmp_path / "x")  # xopt's format keeps the horizon
    assert again.hp == opt.hp
    opt.save_pretrained(tmp_path / "lo", format="lo")
    assert_bit_equal(lo.read_params(tmp_path / "lo" / "params")[0], golden("velo"))
    assert (tmp_path / "lo" / "config.gin").read_bytes() == (LO_VELO / "config.gin").read_bytes()
    sf = xt.SmallFCLOpt.from_pretrained([w], PYLO_SF, num_training_steps=10, **SF_PYLO_EXTRA)
    assert sf.hp.step_mult == 0.01
    pair = xt.VeLO.from_pretrained([w], (PYLO_RNN, PYLO_MLP), num_training_steps=10)
    assert_bit_equal({k: v.numpy() for k, v in pair.meta.items()}, canon)
    with pytest.raises(CheckpointError, match="not small_fc_lopt"):
        xt.SmallFCLOpt.from_pretrained([w], LO_VELO, num_training_steps=10)


def test_hub_ids_need_the_hub_extra_and_paths_are_not_ids(tmp_path, monkeypatch):
    from xopt.checkpoints import hub

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if not installed
    with pytest.raises(ImportError, match=r"xopt-ml\[hub\]"):
        hub.load_pretrained("hf://someone/velo")
    with pytest.raises(ImportError, match=r"xopt-ml\[hub\]"):
        hub.load_pretrained(repo_id="someone/velo")
    with pytest.raises(ImportError, match=r"xopt-ml\[hub\]"):
        hub.push_to_hub("velo", *C.load(LO_VELO)[1:], "someone/velo")
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        hub.load_pretrained(str(tmp_path / "absent" / "dir"))


def test_a_missing_path_that_looks_like_a_repo_id_is_an_error_not_a_download(tmp_path,
                                                                            monkeypatch):
    from xopt.checkpoints import hub

    fake = _FakeHub(tmp_path / "hub")
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake.module)
    monkeypatch.chdir(tmp_path)
    for source in ("someone/velo", ("someone/velo-rnn", "someone/velo-mlp")):
        with pytest.raises(CheckpointError, match=r"someone/velo\S*: no such checkpoint "
                                                  r"directory \(for the Hugging Face Hub "
                                                  r"repository, write hf://someone/velo"):
            hub.load_pretrained(source)
    with pytest.raises(CheckpointError, match="either a source .* or repo_id="):
        hub.load_pretrained("x", repo_id="someone/velo")
    with pytest.raises(CheckpointError, match="not a Hub repository id"):
        hub.load_pretrained("hf://not a repo")
    assert fake.calls == []


class _FakeHub:
    """A stand-in for huggingface_hub with the calls xopt makes (no network here): a
    "repository" is a folder under ``root``; uploads copy into it, downloads return it."""

    def __init__(self, root):
        self.root, self.calls = root, []
        hub_self = self

        class HfApi:
            def __init__(self, token=None):
                hub_self.calls.append(("HfApi", token))

            def create_repo(self, repo_id, *, private=None, exist_ok=False):
                hub_self.calls.append(("create_repo", repo_id, private, exist_ok))
                (hub_self.root / repo_id).mkdir(parents=True, exist_ok=exist_ok)

            def upload_folder(self, *, repo_id, folder_path, commit_message=None):
                hub_self.calls.append(("upload_folder", repo_id, commit_message))
                shutil.copytree(folder_path, hub_self.root / repo_id, dirs_exist_ok=True)
                return types.SimpleNamespace(commit_url=f"https://hub/{repo_id}/commit/1")

        def snapshot_download(repo_id, *, revision=None, token=None):
            hub_self.calls.append(("snapshot_download", repo_id, revision, token))
            return str(hub_self.root / repo_id)

        self.module = types.SimpleNamespace(HfApi=HfApi, snapshot_download=snapshot_download)


def test_push_to_hub_and_from_pretrained_round_trip_through_the_hub_api(tmp_path, monkeypatch):
    from xopt.checkpoints import hub

    fake = _FakeHub(tmp_path / "hub")
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake.module)
    method, hp, theta = C.load(LO_VELO)
    urls = hub.push_to_hub(method, hp, theta, "someone/velo", token="t0k")
    assert urls == ["https://hub/someone/velo/commit/1"]
    got_method, got_hp, got_theta = hub.load_pretrained("hf://someone/velo", revision="main")
    assert hub.load_pretrained(repo_id="someone/velo")[1] == hp
    assert (got_method, got_hp) == (method, hp)
    assert theta.keys() == got_theta.keys()
    assert all(np.array_equal(theta[k], got_theta[k]) for k in theta)
    # PyLO keeps VeLO as two repositories
    urls = hub.push_to_hub(method, hp, theta, ("someone/velo-rnn", "someone/velo-mlp"),
                           format="pylo")
    assert len(urls) == 2
    _, _, pair_theta = hub.load_pretrained(("hf://someone/velo-rnn", "hf://someone/velo-mlp"))
    assert all(np.array_equal(theta[k], pair_theta[k]) for k in theta)
    assert ("create_repo", "someone/velo", None, True) in fake.calls
    assert ("snapshot_download", "someone/velo", "main", None) in fake.calls
    if has_torch:
        import torch

        import xopt.torch as xt

        w = torch.nn.Parameter(torch.ones(3))
        opt = xt.VeLO.from_pretrained([w], repo_id="someone/velo", num_training_steps=10)
        assert opt.hp.lstm_hidden_size == hp.lstm_hidden_size


def test_the_hub_calls_match_huggingface_hubs_signatures():
    # the stand-in above is only as good as its signatures: check them against the real
    # library's (keyword names and where they may be passed)
    hfh = pytest.importorskip("huggingface_hub")
    import inspect

    for fn, args in [(hfh.HfApi.__init__, {"token"}),
                     (hfh.HfApi.create_repo, {"repo_id", "private", "exist_ok"}),
                     (hfh.HfApi.upload_folder, {"repo_id", "folder_path", "commit_message"}),
                     (hfh.snapshot_download, {"repo_id", "revision", "token"})]:
        params = inspect.signature(fn).parameters
        assert args <= set(params), (fn.__qualname__, args - set(params))


def test_golden_trace_check_sees_a_changed_theta():
    """Guards the check above: the harness really runs the θ it is handed. (It starts every
    run from the trace's recorded state, so it cannot see θ's initial LSTM state; the
    bit-exact θ comparisons and ``port --verify``, which starts from θ, cover that.)"""
    from xopt import specs
    from xopt.parity import load_trace
    from xopt.parity.harness import run_parity

    pytest.importorskip("torch")
    method, hp, theta = C.load(LO_VELO)
    theta = {**theta, "lstm/gates/w": theta["lstm/gates/w"] * np.float32(1.001)}
    t = load_trace(META / "velo/perturbed_seed0.json")
    t.meta_params = lambda: specs.get(method).meta.to_original(theta, hp)
    report = run_parity(method, [t], backends=["torch"], modes=["teacher_forced"],
                        explicit_backends=True, max_steps=2)
    # the oracle runs the changed θ too, so the recording (made with the original θ) is
    # the side off the float64 result: beyond tolerance, reported apart from agreement
    assert not report.runs[0].agrees and report.verdict != "agree"


def test_gin_macros_resolve_and_unrelated_lines_are_skipped():
    text = ("STEPS = 1000\nP = 64\nrun_train.num_steps = %STEPS\noptax.adam.lr = 1e-3\n"
            "HyperV2.param_inits = %P\nrun_train.lopt = @HyperV2()\n")
    assert lo.parse_gin(text) == ("HyperV2", {"param_inits": 64})
    with pytest.raises(CheckpointError, match=r"config.gin:1: macro %UNDEFINED is not defined"):
        lo.parse_gin("HyperV2.param_inits = %UNDEFINED\nrun_train.lopt = @HyperV2()\n")


def test_jax_optax_from_pretrained_and_save(tmp_path):
    from helpers import has_jax

    if not has_jax:
        pytest.skip("jax/optax are not installed")
    import jax.numpy as jnp

    from xopt.checkpoints import hub

    tx = hub.optax_from_pretrained(PYLO_SF, num_training_steps=10, **SF_PYLO_EXTRA)
    params = {"w": jnp.ones((3, 4))}
    state = tx.init(params)
    updates, _ = tx.update({"w": jnp.full((3, 4), 0.1)}, state, params, value=jnp.float32(1.0))
    assert updates["w"].shape == (3, 4)
    method, hp, theta = C.load(LO_SF, num_training_steps=10)
    hub.save_optax_pretrained(theta, hp, tmp_path / "x")
    assert C.load(tmp_path / "x")[1] == hp


# -- corrupt and hostile input: every loader refuses it, naming the file and the field -------


def _pylo_copy(tmp_path, name="p"):
    d = tmp_path / name
    shutil.copytree(PYLO_SF, d)
    for f in d.iterdir():
        os.chmod(f, 0o644)
    return d


def _edit_safetensors(f, edit):
    from xopt.checkpoints import _files

    tensors = _files.read_safetensors(f)
    edit(tensors)
    f.write_bytes(_files.safetensors_bytes(tensors))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_theta_is_refused_by_port_and_from_pretrained(tmp_path, capsys, value):
    from xopt.cli import main

    d = _pylo_copy(tmp_path)

    def poison(t):
        t["network.output.bias"][0] = value

    _edit_safetensors(d / "model.safetensors", poison)
    rc = main(["port", str(d), str(tmp_path / "out"), "--decays", "pylo-defaults", "--verify"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{d / 'model.safetensors'}: key 'network.output.bias' holds {value}" in err
    assert not (tmp_path / "out").exists()
    torch = pytest.importorskip("torch")
    import xopt.torch as xt

    with pytest.raises(CheckpointError, match="network.output.bias.*must be finite"):
        xt.SmallFCLOpt.from_pretrained([torch.nn.Parameter(torch.ones(2))], d,
                                       num_training_steps=10, **SF_PYLO_EXTRA)


def test_non_finite_or_float32_overflowing_theta_in_lo_params_is_refused(tmp_path):
    d = _lo_copy(tmp_path)
    _rewrite_params(d, lambda t: t["nn/~/b1"].__setitem__(3, np.inf))
    with pytest.raises(CheckpointError, match=r"params: key 'nn/~/b1' holds inf at index "
                                              r"\(3,\)"):
        C.load(d)
    shutil.copy(LO_SF / "params", d / "params")
    _rewrite_params(d, lambda t: t.update({"nn/~/b1": np.full(32, 1e39)}))
    with pytest.raises(CheckpointError, match=r"'nn/~/b1' holds 1e\+39 .*beyond float32's "
                                              "range"):
        C.load(d)
    method, hp, theta = C.load(LO_SF)
    theta["mlp/w0"] = theta["mlp/w0"].copy()
    theta["mlp/w0"][0, 0] = np.nan
    with pytest.raises(CheckpointError, match=r"θ to save: key 'mlp/w0' holds nan"):
        C.save(tmp_path / "never", method, hp, theta)
    assert not (tmp_path / "never").exists()


def _gin(tmp_path, extra, replace=None):
    d = tmp_path / "gin"
    if not d.exists():
        d = _lo_copy(tmp_path)
        d.rename(tmp_path / "gin")
        d = tmp_path / "gin"
    text = (LO_SF / "config.gin").read_text()
    if replace:
        text = text.replace(*replace)
    (d / "config.gin").write_text(text + extra)
    return d


def test_gin_scoped_bindings_apply_only_within_their_scope(tmp_path):
    # gin: 'scope/Class.arg' binds only calls made inside that scope (gin/config.py merges
    # the bindings of every prefix of the active scope, the deepest last)
    d = _gin(tmp_path, "eval/AdafacMLPLOpt.step_mult = 0.5\n")
    assert C.load(d)[1].step_mult == 0.01
    d = _gin(tmp_path, "other/AdafacMLPLOpt.hidden_size = 8\n")
    assert C.load(d)[1].hidden_size == 32  # a valid checkpoint stays valid
    d = _gin(tmp_path, "eval/AdafacMLPLOpt.step_mult = 0.5\n"
                       "run_train.lopt = @eval/AdafacMLPLOpt()\n")
    assert C.load(d)[1].step_mult == 0.5  # called in scope eval: its binding applies
    d = _gin(tmp_path, "a/b/AdafacMLPLOpt.exp_mult = 0.003\na/AdafacMLPLOpt.exp_mult = 0.002\n"
                       "a/AdafacMLPLOpt.step_mult = 0.02\nb/AdafacMLPLOpt.step_mult = 0.7\n"
                       "run_train.lopt = @a/b/AdafacMLPLOpt()\n")
    _, hp, _ = C.load(d)
    assert (hp.exp_mult, hp.step_mult) == (0.003, 0.02)  # deepest scope wins; 'b' is not 'a/b'
    d = _gin(tmp_path, "eval/run_train.lopt = @HyperV2()\nAdafacMLPLOpt.step_mult = 0.03\n")
    _, hp, _ = C.load(d)  # run_train runs unscoped; the later unscoped binding wins
    assert hp.step_mult == 0.03 and C.load(d)[0] == "small_fc_lopt"


@pytest.mark.parametrize("extra,match", [
    ("AdafacMLPLOpt.step_mult = 1e999\n", r"config.gin:10: AdafacMLPLOpt.step_mult: inf is "
                                          "not a finite number"),
    ("AdafacMLPLOpt.hidden_size = 1180591620717411303424\n", "hidden_size: integer .* out of "
                                                             "range"),
    ("AdafacMLPLOpt.hidden_size = 100000\n", r"hidden_size = 100000; expected an integer in "
                                             r"\[0, 65536\]"),
    ("AdafacMLPLOpt.step_mult = nan\n", "config.gin:10: 'nan' is not a gin value"),
    ("AdafacMLPLOpt.hidden_siz = 8\n", "AdafacMLPLOpt has no argument 'hidden_siz'"),
    ("foo.AdafacMLPLOpt.step_mult = 0.1\n", "'foo.AdafacMLPLOpt' is not learned_optimization"),
    ("eval/AdafacMLPLOpt.hidden_siz = 8\n", "AdafacMLPLOpt has no argument 'hidden_siz'"),
    ("include 'base.gin'\n", "'include' is not supported"),
    ("AdafacMLPLOpt.step_mult 0.1\n", "is not a gin binding"),
    ("AdafacMLPLOpt.step_mult = (0.1\n", "not valid gin"),
    ("AdafacMLPLOpt.step_mult = @eval/f()\n", "a configurable reference where xopt reads a "
                                              "literal"),
])
def test_gin_values_and_syntax_gin_would_refuse_are_refused(tmp_path, extra, match):
    d = _gin(tmp_path, extra)
    with pytest.raises(CheckpointError, match=match) as e:
        C.load(d)
    assert str(d / "config.gin") in str(e.value)


def test_non_utf8_configs_are_named_errors(tmp_path):
    d = _gin(tmp_path, "")
    (d / "config.gin").write_bytes(b"# \xff\n" + (LO_SF / "config.gin").read_bytes())
    with pytest.raises(CheckpointError, match=r"config.gin: not UTF-8"):
        C.load(d)
    p = _pylo_copy(tmp_path)
    (p / "config.json").write_bytes(b'{"hidden_layers": 1, "\xc3\x28": 2}')
    with pytest.raises(CheckpointError, match=r"config.json: not UTF-8"):
        C.load(p, **SF_PYLO_EXTRA)


def test_oversized_integers_and_deep_nesting_exit_2_through_the_cli(tmp_path, capsys):
    from xopt.cli import main

    p = _pylo_copy(tmp_path)
    cfg = json.loads((p / "config.json").read_text())
    (p / "config.json").write_text(json.dumps({**cfg, "hidden_layers": 1180591620717411303424}))
    assert main(["port", str(p), str(tmp_path / "o"), "--decays", "pylo-defaults"]) == 2
    assert (f"{p / 'config.json'}: key 'hidden_layers' is 1180591620717411303424, out of "
            "range" in capsys.readouterr().err)
    (p / "config.json").write_text(json.dumps({**cfg, "hidden_layers": 10 ** 6}))
    assert main(["port", str(p), str(tmp_path / "o"), "--decays", "pylo-defaults"]) == 2
    assert "key 'hidden_layers' is 1000000, expected an integer in [0, 63]" in \
        capsys.readouterr().err
    (p / "config.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    assert main(["port", str(p), str(tmp_path / "o"), "--decays", "pylo-defaults"]) == 2
    assert "config.json: JSON nested deeper than 32 levels" in capsys.readouterr().err
    d = _lo_copy(tmp_path)
    (d / "params").write_bytes(b"\x81\xa1a" * 100_000 + b"\xc0")
    assert main(["port", str(d), str(tmp_path / "o")]) == 2
    assert "params: not a valid flax msgpack checkpoint (containers nested deeper than 32 " \
           "levels" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["lo", "p"]


def test_msgpack_declared_lengths_are_checked_before_anything_is_allocated():
    data = (LO_SF / "params").read_bytes()
    for forged, match in [(b"\xdf\xff\xff\xff\xff" + data[1:], "map declares 4294967295 "
                                                               "elements but"),
                          (b"\xdb\xff\xff\xff\xff" + data[2:], "string declares 4294967295 "
                                                               "bytes but"),
                          (data + b"\x00", "1 bytes of trailing data"),
                          (b"\x82\xa1a\x01\xa1a\x02", "map key 'a' appears twice"),
                          (b"\x81\x01\x02", "map key is a int, not a string"),
                          (b"\xc1", "byte 0xc1 is not a msgpack type")]:
        with pytest.raises(CheckpointError, match=match):
            lo.read_params_bytes(forged, "params")


def test_safetensors_headers_are_checked_in_full(tmp_path):
    from xopt.checkpoints import _files

    good = (PYLO_SF / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    header, body = json.loads(good[8:8 + n]), good[8 + n:]

    def with_header(h, length=None):
        raw = json.dumps(h).encode()
        return struct.pack("<Q", len(raw) if length is None else length) + raw + body

    b0 = header["network.input.bias"]
    cases = [
        (with_header(header, 2 ** 63), "header length 9223372036854775808"),
        (with_header({**header, "network.input.bias": {**b0, "dtype": "BF16"}}), "bfloat16"),
        (with_header({**header, "network.input.bias": {**b0, "dtype": "F64"}}),
         "F64 of shape \\[32\\] needs 256 bytes, data_offsets give 128"),
        (with_header({**header, "network.input.bias": {**b0, "shape": [2 ** 40, 0]}}),
         "starts at byte 0 of the data, expected 0|tile|needs 0 bytes"),
        (with_header({**header, "network.input.bias": {**b0, "extra": 1}}), "header entry is"),
        (with_header({**header, "network.input.bias": {**b0, "data_offsets": [0, 2 ** 40]}}),
         "data_offsets \\[0, 1099511627776\\] are not \\[begin, end\\] within the 9608"),
        (with_header({**header, "network.input.bias": {**b0, "data_offsets": [0, 2 ** 64]}}),
         "key 'network.input.bias.data_offsets\\[1\\]' is 18446744073709551616, out of "
         "range"),
        (with_header({k: v for k, v in header.items() if k != "network.input.bias"}),
         "starts at byte 128 of the data, expected 0"),
        (with_header({**header, "__metadata__": {"a": 1}}), "'__metadata__' is not a map of "
                                                           "strings"),
    ]
    f = tmp_path / "model.safetensors"
    for data, match in cases:
        f.write_bytes(data)
        with pytest.raises(CheckpointError, match=match) as e:
            _files.read_safetensors(f)
        assert str(f) in str(e.value)


def test_safetensors_and_msgpack_bytes_match_the_packages():
    """xopt's writers (NumPy only) write what the safetensors and msgpack packages write,
    and its readers read what they read."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    msgpack = pytest.importorskip("msgpack")
    from xopt.checkpoints import _files
    from xopt.checkpoints import _msgpack as M

    rng = np.random.default_rng(0)
    tensors = {"b": rng.standard_normal(3).astype(np.float32), "a": rng.standard_normal((2, 2)),
               "c": np.ones(1, np.float16), "z/y": np.zeros((0, 3), np.float32),
               "aa": rng.standard_normal(4).astype(np.float32)}
    for meta in (None, {"xopt.format": "x"}):
        ours = _files.safetensors_bytes(tensors, meta)
        assert ours == safetensors_numpy.save(tensors, metadata=meta)
        back, got_meta = _files.parse_safetensors(ours, "mem")
        assert got_meta == (meta or {})
        assert_bit_equal(back, {k: np.asarray(v) for k, v in tensors.items()})
    for f in (PYLO_SF / "model.safetensors",):
        assert_bit_equal(_files.read_safetensors(f),
                         safetensors_numpy.load(f.read_bytes()))
    doc = {"params": {"nn": {"~": {"w0": M.ExtType(1, b"x" * 300)}}}, "gen_id": "g" * 40,
           "step": 70000, "n": [-1, -33, -129, -40000, -2 ** 40, 2 ** 63, 1.5, None, True,
                               b"\x00" * 70000]}
    lib = {**doc, "params": {"nn": {"~": {"w0": msgpack.ExtType(1, b"x" * 300)}}}}
    assert M.packb(doc) == msgpack.packb(lib, use_bin_type=True)
    assert M.unpackb(M.packb(doc)) == {**doc, "n": [*doc["n"][:-1], b"\x00" * 70000]}
    data = (LO_SF / "params").read_bytes()
    assert M.packb(M.unpackb(data)) == data


# -- xopt's format: content hashes ------------------------------------------------------------


def _xopt_copy(tmp_path, name="x"):
    method, hp, theta = C.load(LO_SF, num_training_steps=100)
    return C.save(tmp_path / name, method, hp, theta)


def test_xopt_format_hashes_catch_bit_flips_swaps_and_edited_configs(tmp_path):
    from xopt.checkpoints import _files

    d = _xopt_copy(tmp_path)
    f = d / "model.safetensors"
    good = f.read_bytes()
    tensors, meta = _files.parse_safetensors(good, f)
    assert set(meta) == {"xopt.format", "xopt.sha256:config.json"} | {
        f"xopt.sha256:{k}" for k in tensors}
    assert meta["xopt.sha256:config.json"] == _files.sha256((d / "config.json").read_bytes())
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8:8 + n])
    s0, e0 = header["mlp/b0"]["data_offsets"]
    s1, e1 = header["mlp/b1"]["data_offsets"]
    flipped = bytearray(good)
    flipped[8 + n + s0 + 5] ^= 0x10
    swapped = bytearray(good)
    swapped[8 + n + s0:8 + n + e0], swapped[8 + n + s1:8 + n + e1] = (
        good[8 + n + s1:8 + n + e1], good[8 + n + s0:8 + n + e0])
    for data, match in [(flipped, "tensor 'mlp/b0' does not match its recorded SHA-256"),
                        (swapped, "tensor 'mlp/b[01]' does not match its recorded SHA-256")]:
        f.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=match):
            C.load(d)
    f.write_bytes(good)
    cfg = (d / "config.json").read_text()
    (d / "config.json").write_text(cfg.replace('"step_mult": 0.01', '"step_mult": 0.02'))
    with pytest.raises(CheckpointError, match=r"config.json: does not match the SHA-256 "
                                              r"recorded in .*model.safetensors"):
        C.load(d)
    (d / "config.json").write_text(cfg)
    assert C.load(d, step_mult=0.02)[1].step_mult == 0.02  # overrides are the way
    tensors["mlp/b0"][0] += 1  # rewritten without xopt's hashes
    f.write_bytes(_files.safetensors_bytes(tensors, {"format": "pt"}))
    with pytest.raises(CheckpointError, match="metadata 'xopt.format' is None"):
        C.load(d)


def test_port_records_the_source_files_hashes(tmp_path, capsys):
    import hashlib

    from xopt.cli import main

    assert main(["port", str(LO_SF), str(tmp_path / "x")]) == 0
    out = capsys.readouterr().out
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    want = {f: hashlib.sha256((LO_SF / f).read_bytes()).hexdigest()
            for f in ("config.gin", "params")}
    assert cfg["source"] == {"format": "learned_optimization", "sha256": want}
    for f, digest in want.items():
        assert f"source sha256: {digest}  {f}" in out
    assert C.load(tmp_path / "x")[0] == "small_fc_lopt"


def test_port_verify_calls_a_non_finite_run_different(tmp_path, capsys):
    from xopt.cli import main

    d = _pylo_copy(tmp_path)
    _edit_safetensors(d / "model.safetensors",
                      lambda t: t["network.output.weight"].__setitem__((0, 0), 3e38))
    assert main(["port", str(d), str(tmp_path / "o"), "--decays", "pylo-defaults",
                 "--verify"]) == 1
    out = capsys.readouterr().out
    assert "gives NaN or inf with the source checkpoint's θ" in out and "DIFFERENT" in out


# -- writes: atomic, durable, and only where safe ----------------------------------------------


def test_overwrite_refuses_links_the_source_s_parents_dot_files_and_foreign_dirs(
        tmp_path, capsys, monkeypatch):
    from xopt.cli import main

    monkeypatch.chdir(tmp_path)
    src = _lo_copy(tmp_path)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("x")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    before = sorted(os.listdir(tmp_path))
    for dst, match in [("link", "is a symbolic link"), (".", "not a checkpoint directory "
                                                             "name"),
                       (str(tmp_path), "is the working directory or one above it"),
                       (str(tmp_path.parent), "is the working directory or one above it"),
                       ("lo", "contains the source checkpoint"),
                       ("file", "exists and is not a directory"),
                       ("home", "holds 'notes.txt', which no checkpoint has")]:
        assert main(["port", str(src), dst, "--overwrite"]) == 2, dst
        assert match in capsys.readouterr().err, dst
    (tmp_path / "outer").mkdir()
    shutil.copytree(src, tmp_path / "outer" / "src")
    assert main(["port", "outer/src", "outer", "--overwrite"]) == 2
    assert "outer: contains the source checkpoint outer/src" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == sorted(before + ["outer"])
    assert os.readlink(tmp_path / "link") == str(tmp_path / "real")
    assert os.listdir(tmp_path / "real") == [] and (tmp_path / "home" / "notes.txt").exists()
    assert C.load(src)[0] == C.load(tmp_path / "outer" / "src")[0] == "small_fc_lopt"


def test_overwrite_replaces_a_checkpoint_whole_with_or_without_an_atomic_swap(tmp_path,
                                                                            monkeypatch):
    from xopt import _atomic

    method, hp, theta = C.load(LO_SF)
    C.save(tmp_path / "out", method, hp, theta, "pylo")
    C.save(tmp_path / "out", method, hp, theta, "lo", overwrite=True)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.gin", "params"]
    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)  # no renameat2 here
    C.save(tmp_path / "out", method, hp, theta, "xopt", overwrite=True)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["out"]


_KILLED_PORT = """
import os, signal, sys
from xopt.checkpoints import _files
def dying(path, data):
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)
_files.write_file = dying
from xopt.cli import main
main(["port", sys.argv[1], sys.argv[2]])
"""


def test_a_killed_port_leaves_a_temporary_that_the_next_write_removes(tmp_path):
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH",
                                                                               "")}
    proc = subprocess.run([sys.executable, "-c", _KILLED_PORT, str(LO_SF), str(tmp_path / "d")],
                          env=env, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    left = os.listdir(tmp_path)
    assert len(left) == 1 and left[0].startswith(".d.") and left[0].endswith(".tmp")
    [(name, data)] = [(p.name, p.read_bytes()) for p in (tmp_path / left[0]).iterdir()]
    full = C.files(*C.load(LO_SF), "xopt")[name]
    assert 0 < len(data) < len(full) and full.startswith(data)  # a truncated file
    C.save(tmp_path / "d", *C.load(LO_SF))
    assert os.listdir(tmp_path) == ["d"]


def test_a_directory_moved_aside_by_a_killed_replacement_is_restored(tmp_path):
    import subprocess

    from xopt import _atomic

    C.save(tmp_path / "d", *C.load(LO_SF))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    aside = tmp_path / f".d.{dead}@{_atomic._HOST}.abc123.old"
    os.replace(tmp_path / "d", aside)  # as a killed fallback replacement leaves it
    (tmp_path / f".d.{dead}@{_atomic._HOST}.def456.tmp").mkdir()
    assert len(_atomic.clean_stale(tmp_path / "d")) == 2
    assert os.listdir(tmp_path) == ["d"] and C.detect(tmp_path / "d") == "xopt"


def test_writes_fsync_every_file_and_directory(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to name file descriptors")
    monkeypatch.setattr(os, "fsync", spy)
    method, hp, theta = C.load(LO_VELO if VELO_FIXTURES else LO_SF)
    out = C.save(tmp_path / "out", method, hp, theta, "pylo")
    names = {os.path.relpath(p, tmp_path) for p in synced}
    written = {os.path.relpath(p, tmp_path) for p in out.rglob("*")}
    tmp_names = {n.replace(n.split("/")[0], "out", 1) for n in names if n.startswith(".out.")}
    assert written <= tmp_names  # every file and subdirectory, synced before the rename
    assert "." in names  # the parent, after it
