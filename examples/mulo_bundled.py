"""Train xopt's bundled example problems with μLO, in PyTorch and in JAX.

    python examples/mulo_bundled.py                          # every bundled problem, both backends
    python examples/mulo_bundled.py --steps 300 --meta hf://btherien/mulo

The problems are :data:`xopt.parity.recorder.PROBLEMS` (least squares through a linear
layer or a tanh MLP, gradients in NumPy): each backend steps its own copy of the
parameters, and the problem computes the next minibatch's loss and gradient at them. The μP
roles are read from the layers (the first weight is the input layer, the last the readout,
the others hidden, every bias a vector) and turned into step multipliers by
:func:`xopt.torch.mulo.mup_param_groups` on the torch side; the JAX side is given the same
multipliers as a pytree (:func:`xopt.jax.mulo.mulo`'s ``mup_lrs``).

Meta-parameters (μLO's θ): ``--meta`` takes a checkpoint directory in any format
:mod:`xopt.checkpoints` reads, or ``hf://owner/name`` (PyLO keeps μLO's as a ``MetaMLP``
at ``hf://btherien/mulo``; read with μLO's decay offsets, PyLO's defaults, and step_mult
0.01). Without it the script builds a θ by hand that makes the MLP output Adam's direction:
the normalised feature ``m·rsqrt(rms)`` of the 0.9 momentum, through two ReLU units (its
positive and negative parts), and a zero magnitude head, so ``step = step_mult ·
m/√rms / RMS_tensor(m/√rms)``. That θ is not μLO's meta-trained one; it shows xopt's two
backends running the same learned optimizer, with its μP multipliers, to a lower loss.
The script prints each backend's mean loss over the first and the last 20 steps and exits
non-zero when a backend fails to lower a problem's loss.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np


def adam_direction_theta(hp: Any) -> dict[str, np.ndarray]:
    """θ whose MLP gives ``direction = normalised m·rsqrt(rms)`` (momentum 0.9) and
    ``magnitude = 0`` (see the module docstring)."""
    from xopt.specs import mulo

    theta = {k: np.zeros(s, np.float32) for k, s in mulo.META.shapes(hp).items()}
    feature = 6  # g, p, m (3), rms, then m·rsqrt(rms) for the first momentum decay (0.9)
    theta["mlp/w0"][feature, :2] = (1.0, -1.0)
    for i in range(1, int(hp.hidden_layers)):
        theta[f"mlp/w{i}"][0, 0] = theta[f"mlp/w{i}"][1, 1] = 1.0
    last = f"mlp/w{int(hp.hidden_layers)}"
    theta[last][0, 0], theta[last][1, 0] = 1.0, -1.0
    return theta


def load_meta(source: str | None, steps: int) -> tuple[Any, dict[str, np.ndarray]]:
    from xopt.specs import mulo

    if source is None:
        hp = mulo.SPEC.make("mulo", num_training_steps=steps)
        return hp, adam_direction_theta(hp)
    from xopt.checkpoints.hub import load_pretrained
    from xopt.errors import CheckpointError

    extra: dict[str, Any] = dict(method="mulo", num_training_steps=steps)
    try:
        _, hp, theta = load_pretrained(source, **extra)
    except CheckpointError:  # a PyLO MetaMLP: it stores neither the offsets nor step_mult
        _, hp, theta = load_pretrained(source, decays="pylo-defaults", step_mult=0.01,
                                       **extra)
    return hp, theta


def roles(names: list[str]) -> dict[str, str]:
    """Input, hidden and readout weights in order; every bias a vector."""
    weights = [n for n in names if n.endswith("weight")]
    out = {n: "vector" for n in names}
    for i, n in enumerate(weights):
        out[n] = "input" if i == 0 else "output" if i == len(weights) - 1 else "hidden"
    return out


def run_torch(problem: Any, hp: Any, theta: dict, steps: int) -> tuple[list[float], dict]:
    import torch

    from xopt.torch import MuLO
    from xopt.torch.mulo import mup_param_groups

    params = {k: torch.tensor(v) for k, v in problem.init_params().items()}
    groups = mup_param_groups(list(params.items()), roles=roles(list(params)))
    opt = MuLO(groups, theta, spec=hp)
    mults = {n: g["mup_lr"] for g in groups for n in g["param_names"]}
    losses = []
    for t in range(steps):
        loss, grads = problem.loss_and_grads({k: p.numpy() for k, p in params.items()}, t)
        for k, p in params.items():
            p.grad = torch.from_numpy(grads[k])
        opt.step(loss=loss)
        losses.append(float(loss))
    return losses, mults


def run_jax(problem: Any, hp: Any, theta: dict, steps: int, mults: dict) -> list[float]:
    import jax
    import jax.numpy as jnp
    import optax

    from xopt.jax import mulo

    tx = mulo(theta, spec=hp, mup_lrs=mults)
    params = {k: jnp.asarray(v) for k, v in problem.init_params().items()}
    state = tx.init(params)
    update = jax.jit(lambda g, s, p, loss: tx.update(g, s, p, value=loss))
    losses = []
    for t in range(steps):
        loss, grads = problem.loss_and_grads({k: np.asarray(v) for k, v in params.items()}, t)
        u, state = update({k: jnp.asarray(v) for k, v in grads.items()}, state, params,
                          jnp.float32(loss))
        params = optax.apply_updates(params, u)
        losses.append(float(loss))
    return losses


def main(argv: list[str] | None = None) -> int:
    from xopt.parity.recorder import PROBLEMS, problem

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--meta", help="checkpoint directory or hf://owner/name (default: the "
                                   "hand-built Adam-direction θ)")
    ap.add_argument("--problem", action="append", choices=sorted(PROBLEMS),
                    help="a bundled problem (repeatable; default: all)")
    args = ap.parse_args(argv)
    hp, theta = load_meta(args.meta, args.steps)
    window = max(1, min(20, args.steps // 4))
    ok = True
    for name in args.problem or list(PROBLEMS):
        t_losses, mults = run_torch(problem(name, 0), hp, theta, args.steps)
        j_losses = run_jax(problem(name, 0), hp, theta, args.steps, mults)
        for backend, losses in (("torch", t_losses), ("jax", j_losses)):
            first, last = np.mean(losses[:window]), np.mean(losses[-window:])
            lowered = last < first
            ok &= bool(lowered)
            print(f"{name} {backend}: mean loss {first:.4f} -> {last:.4f} "
                  f"({'lowered' if lowered else 'NOT lowered'})")
        gap = max(abs(a - b) / max(abs(b), 1e-30)
                  for a, b in zip(t_losses, j_losses, strict=True))
        print(f"{name}: largest relative loss difference between the backends: {gap:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
