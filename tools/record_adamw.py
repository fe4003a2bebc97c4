"""Record AdamW golden traces by running the originals: torch.optim.AdamW and optax.adamw.

    python tools/record_adamw.py [OUT_DIR]       (default: xopt/parity/data/adamw)

The shared golden set has no AdamW case (AdamW's originals are the two libraries
themselves), so xopt records its own, in the ``xopt-trace/1`` layout, with nothing of
xopt's in the loop: the optimizee, its gradients (each framework's autodiff on the
original optimizer's own trajectory) and the optimizer are all the framework's. Each case
is recorded twice in one process; the two recordings must be bit-identical, which the
manifest's ``tolerance_hint`` states.

The optimizee (float32, batch 32 from a fixed 256-row dataset, rows [32k, 32k+32) at step
t with k = t mod 8):
    loss = mean_b 0.5 || s · (W1 tanh(W0 x_b + b0) + b1) − y_b ||²
         + mean_b 0.5 || einsum('i,ijk->jk', x_b[:4], T) summed over k − y_b[:3] ||²
with W0 (32,16), b0 (32,), W1 (16,32), b1 (16,), the 0-d scale s and the rank-3 T (4,3,5):
ranks 0 to 3, so every code path of a per-tensor optimizer is exercised.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xopt.parity.runners import flatten_with_paths  # noqa: E402  (path naming only)
from xopt.parity.trace import step_prefix, write_trace  # noqa: E402

STEPS = 30
PARAMS = {"mlp/0/weight": (32, 16), "mlp/0/bias": (32,), "mlp/1/weight": (16, 32),
          "mlp/1/bias": (16,), "scale": (), "tensor3": (4, 3, 5)}

CASES = {
    "torch_lr1e-2_wd0.1": ("torch.optim.AdamW",
                           dict(lr=1e-2, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.1)),
    "torch_amsgrad_b0.8_0.99": ("torch.optim.AdamW",
                                dict(lr=3e-2, betas=[0.8, 0.99], eps=1e-6, weight_decay=0.01,
                                     amsgrad=True)),
    "optax_lr1e-2_wd0.1": ("optax.adamw",
                           dict(learning_rate=1e-2, b1=0.9, b2=0.999, eps=1e-8,
                                weight_decay=0.1)),
    "optax_nesterov_eps_root": ("optax.adamw",
                                dict(learning_rate=1e-2, b1=0.9, b2=0.999, eps=1e-8,
                                     eps_root=1e-8, weight_decay=1e-4, nesterov=True)),
}


def dataset():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((256, 16)) * np.geomspace(1, 0.1, 16)).astype(np.float32)
    w0 = rng.standard_normal((32, 16)) / 4
    w1 = rng.standard_normal((16, 32)) / 6
    y = (np.tanh(x @ w0.T) @ w1.T + 0.05 * rng.standard_normal((256, 16))).astype(np.float32)
    init = {
        "mlp/0/weight": rng.standard_normal((32, 16)) / 4,
        "mlp/0/bias": rng.standard_normal(32) * 0.1,
        "mlp/1/weight": rng.standard_normal((16, 32)) / 6,
        "mlp/1/bias": np.zeros(16),
        "scale": np.array(1.3),
        "tensor3": rng.standard_normal((4, 3, 5)) * 0.3,
    }
    return x, y, {k: v.astype(np.float32) for k, v in init.items()}


def batch(t):
    k = t % 8
    return slice(32 * k, 32 * k + 32)


def loss_fn(xp, p, x, y, einsum):
    h = xp.tanh(x @ p["mlp/0/weight"].T + p["mlp/0/bias"])
    out = p["scale"] * (h @ p["mlp/1/weight"].T + p["mlp/1/bias"])
    fit = 0.5 * ((out - y) ** 2).sum(-1).mean()
    z = einsum("bi,ijk->bj", x[:, :4], p["tensor3"])
    aux = 0.5 * ((z - y[:, :3]) ** 2).sum(-1).mean()
    return fit + aux


def record_torch(kwargs):
    import torch

    x, y, init = dataset()
    params = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
    opt = torch.optim.AdamW(list(params.values()), **{**kwargs, "betas": tuple(kwargs["betas"])})
    arrays = {f"init/param/{k}": v for k, v in init.items()}
    for t in range(STEPS):
        opt.zero_grad(set_to_none=True)
        b = batch(t)
        loss = loss_fn(torch, params, torch.tensor(x[b]), torch.tensor(y[b]), torch.einsum)
        loss.backward()
        pre = step_prefix(t)
        arrays[f"{pre}/loss"] = np.float32(loss.item())
        for k, p in params.items():
            arrays[f"{pre}/grad/{k}"] = p.grad.numpy().copy()
        opt.step()
        for k, p in params.items():
            arrays[f"{pre}/param/{k}"] = p.detach().numpy().copy()
            for sk, sv in opt.state[p].items():
                arrays[f"{pre}/state/{k}/{sk}"] = sv.numpy().copy()
    return arrays


def record_optax(kwargs):
    import jax
    import jax.numpy as jnp
    import optax

    x, y, init = dataset()
    params = {k: jnp.asarray(v) for k, v in init.items()}
    tx = optax.adamw(**kwargs)
    state = tx.init(params)
    value_and_grad = jax.jit(jax.value_and_grad(
        lambda p, xb, yb: loss_fn(jnp, p, xb, yb, jnp.einsum)))

    @jax.jit
    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    arrays = {f"init/param/{k}": v for k, v in init.items()}
    for t in range(STEPS):
        b = batch(t)
        loss, grads = value_and_grad(params, jnp.asarray(x[b]), jnp.asarray(y[b]))
        pre = step_prefix(t)
        arrays[f"{pre}/loss"] = np.float32(loss)
        for k, g in grads.items():
            arrays[f"{pre}/grad/{k}"] = np.asarray(g)
        params, state = update(params, state, grads)
        for k, p in params.items():
            arrays[f"{pre}/param/{k}"] = np.asarray(p)
        for key, leaf in flatten_with_paths(state).items():
            arrays[f"{pre}/state/{key}"] = np.asarray(leaf)
    return arrays


def manifest(case, obj, kwargs, versions):
    torch_side = obj.startswith("torch")
    if torch_side:
        outputs = {
            "param": "param/<param>: parameters after update t",
            "state/<param>/step": "float32 0-d: optimizer.state[p]['step'] after update t",
            "state/<param>/exp_avg": "first moment m_t",
            "state/<param>/exp_avg_sq": "second moment v_t (uncorrected)",
        }
        if kwargs.get("amsgrad"):
            outputs["state/<param>/max_exp_avg_sq"] = "running max of exp_avg_sq"
    else:
        outputs = {
            "param": "param/<param>: parameters after update t",
            "state/0/count": "int32: ScaleByAdamState.count after update t",
            "state/0/mu/<param>": "ScaleByAdamState.mu: first moment m_t",
            "state/0/nu/<param>": "ScaleByAdamState.nu: second moment v_t (uncorrected)",
        }
    return {
        "format": "xopt-trace/1",
        "method": "adamw",
        "case": case,
        "kind": "optimizer",
        "source": {
            "repo": "https://github.com/pytorch/pytorch" if torch_side
            else "https://github.com/google-deepmind/optax",
            "commit": f"release {versions['torch' if torch_side else 'optax']} (PyPI wheel)",
            "object": obj,
            "versions": versions,
            "device": f"cpu ({platform.machine()}, {platform.processor() or 'unknown'})",
            "notes": [
                "recorded by tools/record_adamw.py in xopt's repository; the library's own "
                "optimizer, unmodified, on the optimizee in that script's docstring",
                "gradients by the same framework's autodiff on this optimizer's own trajectory"
                + (" (torch eager, float32)" if torch_side else " (jax.jit, float32)"),
                "torch.optim.AdamW on CPU takes its for-loop (_single_tensor_adam) path"
                if torch_side else "update = jax.jit(tx.update + optax.apply_updates)",
            ],
        },
        "hyperparameters": kwargs,
        "dtype": "float32",
        "params": {k: list(v) for k, v in PARAMS.items()},
        "steps": STEPS,
        "inputs": {"grad": "grad/<param>: gradient at the parameters before update t",
                   "loss": "loss: float32 loss at the parameters before update t"},
        "outputs": outputs,
        "aux": {},
        "tolerance_hint": {
            "repeat_runs_bitwise_equal": True,
            "repeat_runs": "recorded twice in one process: bit-identical on every array",
        },
    }


def main(out_dir: Path) -> None:
    import jax
    import optax
    import torch

    versions = {"python": platform.python_version(), "numpy": np.__version__,
                "torch": torch.__version__, "jax": jax.__version__,
                "optax": optax.__version__}
    for case, (obj, kwargs) in CASES.items():
        record = record_torch if obj.startswith("torch") else record_optax
        first, second = record(kwargs), record(kwargs)
        same = first.keys() == second.keys() and all(
            np.array_equal(first[k], second[k]) for k in first)
        if not same:
            raise SystemExit(f"{case}: two recordings differ; not writing")
        m = manifest(case, obj, kwargs, versions)
        path = write_trace(out_dir / f"{case}.json", m, first)
        print(f"wrote {path} ({len(first)} arrays)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "xopt/parity/data/adamw")
