"""Record VeLO traces of learned_optimization's HyperV2 on a two-tensor problem.

    PYTHONPATH=/path/to/haiku-and-gin:/path/to/learned_optimization \
        python tools/record_velo_cases.py [OUT_DIR]      (default: tests/fixtures/parity/velo)

The cases behind issue 29's findings 2 and 3 (tests/test_parity_findings.py): HyperV2 in
VeLO's configuration with the bundled perturbed θ (xopt/parity/data/velo/meta), on the
bundled ``linear`` problem (a weight (4, 8) and a bias (4,); xopt.parity.recorder), for a
horizon and a problem seed each. The original is driven as the golden recorder drove it
(``opt.init(params, num_steps=N)``, ``opt.update(state, grad, loss=loss, key=PRNGKey(0))``,
jitted), through xopt.parity.originals.learned_optimization; the gradients are the
problem's, at the original's own parameters. The state is the original's pytree flattened
by path, as in the golden traces.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xopt.parity import load_trace  # noqa: E402
from xopt.parity.originals import learned_optimization as lo  # noqa: E402
from xopt.parity.recorder import machine, problem, versions  # noqa: E402
from xopt.parity.runners import flatten_with_paths  # noqa: E402
from xopt.parity.trace import step_prefix, write_trace  # noqa: E402

TEMPLATE = ROOT / "xopt/parity/data/velo/perturbed_seed0.json"
META = ROOT / "xopt/parity/data/velo/meta"
#: (case, problem seed, horizon, steps, bias zeroed at init): the bias starts at 0, so
#: that after the first updates its relative error is the steps' own
CASES = [("linear_zero_bias_n200_seed1", 1, 200, 4, True),
         ("linear_zero_bias_n10000_seed3", 3, 10_000, 8, True)]


def record_case(out_dir: Path, case: str, seed: int, horizon: int, steps: int,
                zero_bias: bool) -> Path:
    import jax.numpy as jnp

    tmpl = load_trace(TEMPLATE)
    theta = tmpl.meta_params()
    driver = lo.hyper_v2(theta, num_training_steps=horizon,
                         **tmpl.manifest["hyperparameters_given"])
    prob = problem("linear", seed)
    # jax.tree_util order (sorted names): the LSTM state's rows follow it
    params = dict(sorted(prob.init_params().items()))
    if zero_bias:
        params["bias"] = np.zeros_like(params["bias"])
    state = driver.init({k: jnp.asarray(v) for k, v in params.items()})
    arrays = {f"init/param/{k}": v for k, v in params.items()}

    def flat_state(s):
        out = {}
        for k, v in flatten_with_paths(s).items():
            head, _, name = k.rpartition("params/")
            if name in params and head == "":
                continue  # the parameters the state carries
            out[k] = np.asarray(v)
        return out

    arrays.update({f"init/state/{k}": v for k, v in flat_state(state).items()})
    current = params
    for t in range(steps):
        loss, grads = prob.loss_and_grads(current, t)
        pre = step_prefix(t)
        arrays[f"{pre}/loss"] = np.float32(loss)
        arrays.update({f"{pre}/grad/{k}": g for k, g in grads.items()})
        state = driver.update(state, {k: jnp.asarray(g) for k, g in grads.items()},
                              jnp.asarray(np.float32(loss)))
        current = {k: np.asarray(v) for k, v in driver.get_params(state).items()}
        arrays.update({f"{pre}/param/{k}": v for k, v in current.items()})
        arrays.update({f"{pre}/state/{k}": v for k, v in flat_state(state).items()})
    m = tmpl.manifest
    rel = Path("../../../../xopt/parity/data/velo/meta")
    manifest = {
        "format": m["format"], "method": "velo", "case": case, "kind": "optimizer",
        "source": {**m["source"], "versions": versions(), "device": machine(),
                   "calls": [c.replace("num_steps=1000", f"num_steps={horizon}")
                             for c in m["source"]["calls"]],
                   "notes": [f"recorded by tools/record_velo_cases.py (xopt) through "
                             f"xopt.parity.originals.learned_optimization on "
                             f"{prob.description}"]},
        "what": f"VeLO with the perturbed θ, horizon {horizon}, problem seed {seed}"
                + (", the bias starting at 0" if zero_bias else ""),
        "hyperparameters": m["hyperparameters"],
        "hyperparameters_given": m["hyperparameters_given"],
        "dtype": "float32", "params": {k: list(v.shape) for k, v in params.items()},
        "steps": steps, "num_training_steps": horizon,
        "meta_params_file": str(rel / Path(m["meta_params_file"]).name),
        "meta_params": {**m["meta_params"],
                        "base_file": str(rel / Path(m["meta_params"]["base_file"]).name)},
        "inputs": m["inputs"], "outputs": m["outputs"], "aux": {},
    }
    for key in ("state_notes", "effective_decays"):
        if key in m:
            manifest[key] = m[key]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = write_trace(out_dir / f"{case}.json", manifest, arrays)
    load_trace(path)  # the format's own checks
    return path


def main(out_dir: Path) -> None:
    for case in CASES:
        print(record_case(out_dir, *case))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests/fixtures/parity/velo")
