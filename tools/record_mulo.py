"""Record μLO golden traces and checkpoint fixtures by running the original code, unmodified.

    PYTHONPATH=<haiku, gin, jmp, tabulate>:<learned_optimization>:<mu_learned_optimization/src> \
        python tools/record_mulo.py traces [OUT_DIR]        (default: xopt/parity/data/mulo)
    PYTHONPATH=<as above>:<pylo> python tools/record_mulo.py checkpoints [OUT_DIR]
                                                          (default: tests/fixtures/mulo)

The originals (fetched for the purpose, never committed):

* μLO, https://github.com/bentherien/mu_learned_optimization at :data:`MULO_COMMIT`:
  ``src/mup_adafac_mlp_lopt.py`` (``MuAdafacMLPLOpt``, the optimizer) and ``src/mu_mlp.py``
  (``MuMLP``, the μP model that supplies the per-parameter multipliers through its haiku
  state, as its tasks do), ``src/helpers.py`` (``get_mup_lrs_from_state``);
* the learned_optimization fork μLO installs (its README: ``lefameuxbeding/
  learned_optimization``, branch ``mup_compatible``) at :data:`LO_COMMIT`;
* PyLO (https://github.com/Belilovsky-Lab/pylo at :data:`PYLO_COMMIT`) for the Hub layout.

Import-time shims only: TensorFlow stand-ins from :mod:`xopt.parity.originals.
learned_optimization` (functions raise if called), ``jax.sharding.PositionalSharding``
(removed from jax; μLO's ``helpers.py`` imports it for multi-device batch sharding, which
these runs never reach) as a class that raises if constructed, and
``jax.lib.xla_client.Device`` (removed from jax; a type annotation in the fork's
``gradient_learner.py``) as ``jax.Device``.

The problem: μLO's ``MuMLP`` (input layer, hidden layers, output layer, μP initialisation
and multipliers) on a softmax classification of random inputs with labels from a random
linear teacher; 64 rows, batch 16, update ``t`` uses rows ``[16k, 16k+16)``, ``k = t mod 4``.
The optimizer is driven as μLO's tasks drive it: ``opt.init(params, model_state=state,
num_steps=N)`` and ``opt.update(state, grad, loss, model_state=state)`` (jitted), where the
model state carries ``mup_lrs_to_use`` (μLO's ``MuTask.get_mup_state``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xopt.parity.originals import learned_optimization as lo_orig  # noqa: E402
from xopt.parity.recorder import machine, versions  # noqa: E402
from xopt.parity.runners import flatten_with_paths  # noqa: E402
from xopt.parity.trace import load_trace, step_prefix, write_trace  # noqa: E402

MULO_REPO = "https://github.com/bentherien/mu_learned_optimization"
MULO_COMMIT = "e160d5481c5445f30996f308009ab07ba3d339e7"
LO_REPO = "https://github.com/lefameuxbeding/learned_optimization"
LO_COMMIT = "db14cd2b31fe918fa166b71109ad3b371c1fe84a"
PYLO_REPO = "https://github.com/Belilovsky-Lab/pylo"
PYLO_COMMIT = "d05c6c1e4f4d7c46a91828a0826c2699bfe48211"

META_SRC = ROOT / "xopt/parity/data/small_fc_lopt/meta/h32_l2_key0_perturbed.npz"
META_NAME = "meta/h32_l2_key0_perturbed.npz"
#: μLO's optimizer as its meta-training and benchmarks build it (meta_trainers.py,
#: optimizers.py: exp_mult 0.001, hidden_layers 2, the default decays and flags), with the
#: README's --adafac_step_mult 0.01 and hidden size 32 (the width of PyLO's μLO checkpoint)
LOPT_KWARGS = dict(exp_mult=0.001, step_mult=0.01, hidden_size=32, hidden_layers=2,
                   initial_momentum_decays=(0.9, 0.99, 0.999), initial_rms_decays=(0.999,),
                   initial_adafactor_decays=(0.9, 0.99, 0.999), concat_weights=True,
                   make_separate_weights=False, split_weights=False)
HORIZON = 1000
#: (case, seed, input dim, layer sizes, classes, MuMLP multipliers, clip_grad, steps)
CASES = [
    ("mumlp_w24_perturbed_seed0", 0, 12, (24, 24), 5,
     dict(input_mult=1.0, output_mult=1.0, hidden_lr_mult=1.0), False, 20),
    ("mumlp_w20x3_clip_i4_o32_h3_seed1", 1, 10, (20, 20, 20), 4,
     dict(input_mult=4.0, output_mult=32.0, hidden_lr_mult=3.0), True, 20),
]


def import_originals():
    """The original modules, behind the import-time shims (see the module docstring)."""
    import types

    import jax
    import jax.lib
    import jax.sharding

    if not hasattr(jax.sharding, "PositionalSharding"):
        class PositionalSharding:  # a stand-in; never constructed here
            def __init__(self, *args, **kwargs):
                raise RuntimeError("jax.sharding.PositionalSharding is an xopt stand-in")

        jax.sharding.PositionalSharding = PositionalSharding
    if not hasattr(jax.lib, "xla_client"):  # gradient_learner.py annotates with it
        jax.lib.xla_client = types.SimpleNamespace(Device=jax.Device)
    lo_orig.import_modules()  # the TensorFlow stand-ins, then learned_optimization
    import helpers
    import mu_mlp
    import mup_adafac_mlp_lopt
    from learned_optimization.tasks import base as task_base

    return mup_adafac_mlp_lopt, mu_mlp, helpers, task_base


def theta_tree(lopt, theta):
    """θ (golden meta naming) as the original's pytree: its init's structure, leaves by path."""
    import jax

    template = lopt.init(jax.random.PRNGKey(0))
    paths = list(flatten_with_paths(template))
    assert sorted(paths) == sorted(theta), (paths, list(theta))
    leaves = [np.asarray(theta[k], dtype=np.float32) for k in paths]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)


def record_case(out_dir: Path, case: str, seed: int, d_in: int, widths: tuple[int, ...],
                classes: int, mults: dict, clip_grad: bool, steps: int) -> Path:
    import haiku as hk
    import jax
    import jax.numpy as jnp

    M, mu_mlp, helpers, task_base = import_originals()
    theta_np = dict(np.load(META_SRC))
    lopt = M.MuAdafacMLPLOpt(**LOPT_KWARGS, clip_grad=clip_grad)
    opt = lopt.opt_fn(theta_tree(lopt, theta_np))

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, d_in)).astype(np.float32)
    teacher = rng.standard_normal((d_in, classes))
    labels = np.argmax(x @ teacher, axis=1).astype(np.int32)
    sizes = list(widths) + [classes]

    def forward(inp):
        return mu_mlp.MuMLP(sizes, activation=jax.nn.relu, **mults)(inp)

    model = hk.transform_with_state(forward)
    params, hk_state = model.init(jax.random.PRNGKey(seed), jnp.asarray(x[:16]))
    model_state = dict(hk_state)
    model_state["mup_lrs_to_use"] = helpers.get_mup_lrs_from_state(hk_state)

    def loss_fn(p, batch_x, batch_y):
        logits, _ = model.apply(p, hk_state, None, batch_x)
        onehot = jax.nn.one_hot(batch_y, classes)
        return jnp.mean(task_base.softmax_cross_entropy(logits=logits, labels=onehot))

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    update = jax.jit(lambda s, g, loss, ms: opt.update(s, g, loss, model_state=ms))
    state = opt.init(params, model_state=model_state, num_steps=HORIZON)

    names = list(flatten_with_paths(params))

    def flat_state(s):
        out = {}
        for k, v in flatten_with_paths(s).items():
            if k.startswith("params/") or k.startswith("state/"):
                continue  # the parameters and the model state the optimizer carries
            out[k] = np.asarray(v)
        return out

    arrays = {f"init/param/{k}": np.asarray(v) for k, v in flatten_with_paths(params).items()}
    arrays.update({f"init/state/{k}": v for k, v in flat_state(state).items()})
    current = params
    for t in range(steps):
        k = t % 4
        bx, by = jnp.asarray(x[16 * k:16 * k + 16]), jnp.asarray(labels[16 * k:16 * k + 16])
        loss, grads = grad_fn(current, bx, by)
        pre = step_prefix(t)
        arrays[f"{pre}/loss"] = np.float32(loss)
        arrays.update({f"{pre}/grad/{n}": np.asarray(g)
                       for n, g in flatten_with_paths(grads).items()})
        state = update(state, grads, loss, model_state)
        current = opt.get_params(state)
        arrays.update({f"{pre}/param/{n}": np.asarray(v)
                       for n, v in flatten_with_paths(current).items()})
        arrays.update({f"{pre}/state/{n}": v for n, v in flat_state(state).items()})

    mup_lrs = {n: float(np.float32(v)) for n, v in
               flatten_with_paths(model_state["mup_lrs_to_use"]).items()}
    assert sorted(mup_lrs) == sorted(names), (mup_lrs, names)
    small = json.loads((ROOT / "xopt/parity/data/small_fc_lopt/"
                        "pylo_sizes_perturbed_seed0.json").read_text())
    manifest = {
        "format": "xopt-trace/1", "method": "mulo", "case": case, "kind": "optimizer",
        "source": {
            "repo": MULO_REPO, "commit": MULO_COMMIT,
            "object": "mup_adafac_mlp_lopt.MuAdafacMLPLOpt",
            "calls": [
                f"lopt = MuAdafacMLPLOpt(**{ {**LOPT_KWARGS, 'clip_grad': clip_grad} })",
                "opt = lopt.opt_fn(theta)  # theta from meta_params_file",
                "model = hk.transform_with_state(lambda x: mu_mlp.MuMLP(sizes, "
                f"activation=jax.nn.relu, **{mults})(x))",
                "params, hk_state = model.init(PRNGKey(seed), x[:16])",
                "model_state = {**hk_state, 'mup_lrs_to_use': "
                "helpers.get_mup_lrs_from_state(hk_state)}  # MuTask.get_mup_state",
                f"state = opt.init(params, model_state=model_state, num_steps={HORIZON})",
                "update = jax.jit(lambda s, g, l, ms: opt.update(s, g, l, model_state=ms))",
                "state = update(state, grad, loss, model_state)  # each step",
            ],
            "learned_optimization": {"repo": LO_REPO, "commit": LO_COMMIT,
                                     "branch": "mup_compatible"},
            "versions": versions(), "device": machine(),
            "notes": [
                "recorded by tools/record_mulo.py (xopt), the originals unmodified; "
                "import-time shims only: TensorFlow stand-ins (every function raises) and "
                "jax.sharding.PositionalSharding (removed from jax; imported by μLO's "
                "helpers.py for batch sharding, never used here; raises if constructed) and "
                "jax.lib.xla_client.Device (removed from jax; a type annotation in "
                "outer_trainers/gradient_learner.py; jax.Device stands in)",
                "git archive of the learned_optimization mirror fails on three absent blobs "
                "under learned_optimization/baselines/data/ (unused); the tree was exported "
                "blob by blob",
            ],
        },
        "what": f"μLO (MuAdafacMLPLOpt) on μLO's own MuMLP {d_in} → {' → '.join(map(str, sizes))}"
                f" with multipliers {mults}, clip_grad={clip_grad}, the perturbed θ "
                "(μLO's decay offsets; the θ of small_fc_lopt/pylo_sizes_perturbed_seed0)",
        "hyperparameters": {**{k: list(v) if isinstance(v, tuple) else v
                               for k, v in LOPT_KWARGS.items()},
                            "clip_grad": clip_grad, "mup_lrs_to_use": mup_lrs},
        "hyperparameters_notes": {
            "mup_lrs_to_use": "not a constructor argument: the per-parameter μP multipliers "
                              "the update reads from model_state['mup_lrs_to_use'] "
                              "(new_p = p - step * mup_lr_scale), as MuMLP sets them "
                              "(input and output layers 1, hidden weights hidden_lr_mult / "
                              "fan_in, biases 1); float32 values as the jitted update sees "
                              "them"},
        "dtype": "float32",
        "params": {n: list(np.shape(v)) for n, v in flatten_with_paths(params).items()},
        "steps": steps, "num_training_steps": HORIZON, "meta_params_file": META_NAME,
        "meta_params": {**small["meta_params"],
                        "made_by": "copied from small_fc_lopt/" + small["meta_params_file"]
                                   + ": " + small["meta_params"]["made_by"]},
        "problem": f"MuMLP softmax classification, seed {seed}: x (64, {d_in}) N(0, 1) from "
                   f"numpy.random.default_rng({seed}), labels argmax(x @ teacher) with "
                   f"teacher N(0, 1) ({d_in}, {classes}) from the same generator; batch 16, "
                   "update t uses rows [16k, 16k+16), k = t mod 4; loss mean softmax "
                   "cross-entropy (learned_optimization.tasks.base.softmax_cross_entropy); "
                   "MuMLP initialised with PRNGKey(seed); gradients by jax.value_and_grad "
                   "at the original's own parameters",
        "inputs": ["grad", "loss"],
        "outputs": [o for o in small["outputs"]],
        "state_notes": "state/<path> is MuAdafacMLPLOptState after the update, flattened with "
                       "jax.tree_util paths; leaves under 'params/' (equal to param/<name>) "
                       "and 'state/' (the model state passed in, unchanged) are not stored.",
        "effective_decays": small["effective_decays"],
        "aux": {},
        "tolerance_hint": {
            "guidance": small["tolerance_hint"]["guidance"],
        },
        "notes": [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "meta").mkdir(exist_ok=True)
    (out_dir / META_NAME).write_bytes(META_SRC.read_bytes())
    path = write_trace(out_dir / f"{case}.json", manifest, arrays)
    load_trace(path)  # the format's own checks
    return path


def record_checkpoints(out_dir: Path) -> list[Path]:
    """θ of the traces written by the originals: a learned_optimization checkpoint folder
    (``checkpoints.save_state`` of a ``ParameterCheckpoint``, ``config.gin`` from gin after
    binding ``MuAdafacMLPLOpt``) and PyLO's Hub layout (``MetaMLP.save_pretrained``, the
    module PyLO's ``MuLO`` loads from ``hf_key``)."""
    import gin
    import torch

    M, _, _, _ = import_originals()
    from learned_optimization import (
        checkpoints,
        outer_train,  # noqa: F401  (registers run_train with gin)
    )
    from learned_optimization.outer_trainers import gradient_learner

    theta_np = dict(np.load(META_SRC))
    written = []
    # learned_optimization layout, as outer_train.run_train writes config.gin
    lo_dir = out_dir / "learned_optimization" / "mulo_h32_perturbed"
    lo_dir.mkdir(parents=True, exist_ok=True)
    gin.clear_config()
    gin.parse_config([
        f"MuAdafacMLPLOpt.hidden_size = {LOPT_KWARGS['hidden_size']}",
        f"MuAdafacMLPLOpt.hidden_layers = {LOPT_KWARGS['hidden_layers']}",
        f"MuAdafacMLPLOpt.step_mult = {LOPT_KWARGS['step_mult']}",
        "run_train.lopt = @MuAdafacMLPLOpt()",
    ])
    (lo_dir / "config.gin").write_text(gin.config_str())
    lopt = M.MuAdafacMLPLOpt(hidden_size=LOPT_KWARGS["hidden_size"],
                             hidden_layers=LOPT_KWARGS["hidden_layers"],
                             step_mult=LOPT_KWARGS["step_mult"])
    theta = theta_tree(lopt, theta_np)
    checkpoints.save_state(str(lo_dir / "params"), gradient_learner.ParameterCheckpoint(
        theta, "xopt_fixture_mulo_h32_perturbed", 0))
    written.append(lo_dir)
    # PyLO's Hub layout: MuLO_naive -> AdafacLO_naive(hf_key=...) -> MetaMLP.from_pretrained
    from pylo.models.Meta_MLP import MetaMLP

    pylo_dir = out_dir / "pylo" / "mulo_h32_perturbed"
    net = MetaMLP(input_size=39, hidden_size=32, hidden_layers=1)
    sd = {"network.input.weight": theta_np["nn/~/w0"].T, "network.input.bias":
          theta_np["nn/~/b0"], "network.linear_0.weight": theta_np["nn/~/w1"].T,
          "network.linear_0.bias": theta_np["nn/~/b1"], "network.output.weight":
          theta_np["nn/~/w2"].T, "network.output.bias": theta_np["nn/~/b2"]}
    net.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()},
                        strict=True)
    net.save_pretrained(str(pylo_dir))
    readme = pylo_dir / "README.md"
    if readme.exists():
        readme.unlink()  # the generic model card save_pretrained adds
    written.append(pylo_dir)
    return written


def main(argv: list[str]) -> None:
    what = argv[0] if argv else "traces"
    if what == "traces":
        out = Path(argv[1]) if len(argv) > 1 else ROOT / "xopt/parity/data/mulo"
        for case in CASES:
            print(record_case(out, *case))
    elif what == "checkpoints":
        out = Path(argv[1]) if len(argv) > 1 else ROOT / "tests/fixtures/mulo"
        for p in record_checkpoints(out):
            print(p)
    else:
        raise SystemExit(f"usage: {sys.argv[0]} traces|checkpoints [OUT_DIR]")


if __name__ == "__main__":
    main(sys.argv[1:])
