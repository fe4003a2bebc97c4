"""Train a small MLP on scikit-learn's digits with VeLO, in PyTorch and in JAX.

    python examples/velo_digits.py                       # both backends, bundled θ
    python examples/velo_digits.py --meta path/to/theta.npz --steps 300 --out velo.png

The same model (64 -> 64 -> 10, tanh), the same initial weights and the same minibatch
order on both backends; each step feeds the minibatch loss to the optimizer, as a learned
optimizer needs it. The script prints the loss every 50 steps, writes the curves to a PNG
(needs matplotlib) and exits non-zero if either backend fails to lower the loss.

Meta-parameters (VeLO's own weights, θ): ``--meta`` takes an ``.npz`` in
learned_optimization's naming (``rnn_params/rnn/linear/w``, ...) or xopt's. Without it the
script uses the θ bundled for the parity tests (``xopt/parity/data/velo/meta/velo_key0.npz``):
``HyperV2(lstm_hidden_size=512, param_inits=256).init(PRNGKey(0))``, VeLO's architecture at
learned_optimization's *initialisation*, not the meta-trained VeLO. It lowers this loss:
learned_optimization itself, on the same data and batches (``--backend original``, where
it is importable), goes from 2.35 to 2.09 in 300 steps (the mean of the first and of the
last 25 minibatch losses). The curves show xopt's backends running that same optimizer,
not VeLO's tuned behaviour. For the
released VeLO weights, convert Google's checkpoint with the checkpoint porter.

Needs: ``pip install "xopt-ml[torch,jax,plot]" scikit-learn``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HIDDEN = 64


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0 - 0.5).astype(np.float32)  # pixel values 0..16 -> [-0.5, 0.5]
    order = np.random.default_rng(seed).permutation(len(x))
    return x[order], y[order].astype(np.int64)


def init_weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((64, HIDDEN)) / 8.0).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.standard_normal((HIDDEN, 10)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def batches(n: int, batch: int, steps: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    return [rng.choice(n, size=batch, replace=False) for _ in range(steps)]


def load_meta(path: str | None) -> dict[str, np.ndarray]:
    if path is None:
        from xopt.parity import DATA

        return dict(np.load(DATA / "velo" / "meta" / "velo_key0.npz"))
    return dict(np.load(path))


def train_torch(x, y, w0, order, theta, steps) -> list[float]:
    import torch

    from xopt.torch import VeLO

    params = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in w0.items()}
    opt = VeLO(params.values(), theta, num_training_steps=steps)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    losses = []
    for idx in order:
        i = torch.from_numpy(idx)
        h = torch.tanh(xt[i] @ params["w1"] + params["b1"])
        loss = torch.nn.functional.cross_entropy(h @ params["w2"] + params["b2"], yt[i])
        opt.zero_grad()
        loss.backward()
        opt.step(loss=loss.detach())
        losses.append(float(loss.detach()))
    return losses


def train_jax(x, y, w0, order, theta, steps) -> list[float]:
    import jax
    import jax.numpy as jnp
    import optax

    from xopt.jax import velo

    tx = velo(theta, num_training_steps=steps)
    params = {k: jnp.asarray(v) for k, v in w0.items()}
    state = tx.init(params)

    def loss_fn(p, xb, yb):
        h = jnp.tanh(xb @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    @jax.jit
    def step(p, s, xb, yb):
        loss, g = jax.value_and_grad(loss_fn)(p, xb, yb)
        updates, s = tx.update(g, s, p, value=loss)
        return optax.apply_updates(p, updates), s, loss

    losses = []
    for idx in order:
        params, state, loss = step(params, state, jnp.asarray(x[idx]), jnp.asarray(y[idx]))
        losses.append(float(loss))
    return losses


def train_original(x, y, w0, order, theta, steps) -> list[float]:
    """learned_optimization's HyperV2 itself (see xopt/parity/originals/learned_optimization.py
    for how to make it importable)."""
    import jax
    import jax.numpy as jnp
    import optax

    from xopt.parity.originals.learned_optimization import hyper_v2

    opt = hyper_v2(theta, num_training_steps=steps, lstm_hidden_size=512, param_inits=256,
                   use_bugged_loss_features=False)
    state = opt.init({k: jnp.asarray(v) for k, v in w0.items()})

    def loss_fn(p, xb, yb):
        h = jnp.tanh(xb @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
    losses = []
    for idx in order:
        loss, g = value_and_grad(opt.get_params(state), jnp.asarray(x[idx]),
                                 jnp.asarray(y[idx]))
        state = opt.update(state, g, loss)
        losses.append(float(loss))
    return losses


def smooth(v: list[float], k: int = 25) -> np.ndarray:
    a = np.asarray(v)
    return np.convolve(a, np.ones(k) / k, mode="valid")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("torch", "jax", "both", "original"), default="both",
                    help="original: learned_optimization's HyperV2, where importable")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--meta", help="VeLO θ as .npz (learned_optimization or xopt naming)")
    ap.add_argument("--out", default="velo_digits.png", help="loss plot (PNG)")
    args = ap.parse_args(argv)

    x, y = load_data(args.seed)
    w0 = init_weights(args.seed)
    order = batches(len(x), args.batch, args.steps, args.seed)
    theta = load_meta(args.meta)
    runs = {}
    for backend in (("torch", "jax") if args.backend == "both" else (args.backend,)):
        train = {"torch": train_torch, "jax": train_jax, "original": train_original}[backend]
        runs[backend] = train(x, y, w0, order, theta, args.steps)
        curve = runs[backend]
        for t in range(0, args.steps, 50):
            print(f"{backend:5s} step {t:4d}  loss {curve[t]:.4f}")
        print(f"{backend:5s} step {args.steps - 1:4d}  loss {curve[-1]:.4f}")

    ok = True
    for backend, curve in runs.items():
        first, last = float(np.mean(curve[:25])), float(np.mean(curve[-25:]))
        lowered = last < first
        ok &= lowered
        print(f"{backend}: mean loss of the first 25 steps {first:.4f}, of the last 25 "
              f"{last:.4f}: {'lowered' if lowered else 'NOT lowered'}")
    if len(runs) == 2:
        gap = max(abs(a - b) for a, b in zip(runs["torch"], runs["jax"], strict=True))
        print(f"largest |torch - jax| loss difference over {args.steps} steps: {gap:.3g}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
    else:
        fig, ax = plt.subplots(figsize=(6, 4))
        for backend, curve in runs.items():
            ax.plot(curve, alpha=0.3, label=f"{backend} (per step)")
            ax.plot(np.arange(24, len(curve)), smooth(curve), label=f"{backend} (mean of 25)")
        ax.set_xlabel("step")
        ax.set_ylabel("minibatch cross-entropy")
        ax.set_title("VeLO on digits")
        ax.legend()
        fig.tight_layout()
        out = Path(args.out)
        fig.savefig(out, dpi=120)
        print(f"plot: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
