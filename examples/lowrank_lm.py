"""Train a small transformer language model with GaLore, Flora, COAP and PLUMAGE against
AdamW, in PyTorch and in JAX, and plot the losses.

    python examples/lowrank_lm.py                          # every method, both backends
    python examples/lowrank_lm.py --methods galore,adamw --backends torch --steps 300

The corpus is the Python documentation that ships with every CPython: the
``pydoc_data.topics`` module (the text of ``help("topics")``, about 450 KB of English and
code), read as bytes (vocabulary: the 128 ASCII codes; other bytes map to ``?``). The last
10% is held out. The model is a 2-layer pre-norm decoder (width 64, 4 heads, context 64,
RMSNorm, GELU MLP, learned positions, untied output), written twice as a pure function of
a dict of weights, once in torch and once in jax.numpy, from the same NumPy initial
weights; both backends see the same minibatches in the same order.

The low-rank methods project the four matrices of every block (``qkv``, ``proj``, ``fc1``,
``fc2``), as the authors project attention and MLP weights; embeddings, norms and the
output layer take each method's full-rank base update (a torch param group with
``project=False``; an optax ``param_specs`` entry). Every method uses the same learning
rate for a fair comparison (``--lr``), rank 16 and the methods' refresh intervals scaled
to the run's length.

The script prints train and held-out loss per method and backend, writes a PNG of the
training loss against the step (one panel per backend), and a JSON of every curve
(``--json``). It exits non-zero if a run does not lower the loss or produces NaN.

Needs: ``pip install "xopt-ml[torch,jax,plot]"``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

VOCAB, WIDTH, HEADS, LAYERS, CONTEXT = 128, 64, 4, 2, 64
PROJECTED = ("qkv", "proj", "fc1", "fc2")  # the matrices of each block that are projected


# -- data ----------------------------------------------------------------------------------------
def load_corpus() -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) token arrays (int64) from ``pydoc_data.topics``."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    data = np.where(data < VOCAB, data, ord("?"))
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def batches(data: np.ndarray, batch: int, steps: int, seed: int) -> list[np.ndarray]:
    """``steps`` minibatches of ``batch`` windows of ``CONTEXT + 1`` tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        start = rng.integers(0, len(data) - CONTEXT - 1, size=batch)
        out.append(np.stack([data[s:s + CONTEXT + 1] for s in start]))
    return out


# -- the model's weights ------------------------------------------------------------------------
def init_weights(seed: int) -> dict[str, np.ndarray]:
    """GPT-2-style init: N(0, 0.02), residual projections scaled by 1/sqrt(2 L); float32."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = {"embed": normal(VOCAB, WIDTH), "pos": normal(CONTEXT, WIDTH)}
    for i in range(LAYERS):
        b = f"block{i}"
        w[f"{b}/norm1"] = np.ones(WIDTH, np.float32)
        w[f"{b}/qkv"] = normal(WIDTH, 3 * WIDTH)
        w[f"{b}/proj"] = normal(WIDTH, WIDTH, std=0.02 / math.sqrt(2 * LAYERS))
        w[f"{b}/norm2"] = np.ones(WIDTH, np.float32)
        w[f"{b}/fc1"] = normal(WIDTH, 4 * WIDTH)
        w[f"{b}/fc1_bias"] = np.zeros(4 * WIDTH, np.float32)
        w[f"{b}/fc2"] = normal(4 * WIDTH, WIDTH, std=0.02 / math.sqrt(2 * LAYERS))
    w["norm"] = np.ones(WIDTH, np.float32)
    w["head"] = normal(WIDTH, VOCAB)
    return w


def is_projected(name: str) -> bool:
    return name.rsplit("/", 1)[-1] in PROJECTED


def forward_loss(xp: Any, w: dict[str, Any], tokens: Any, *, softmax: Callable,
                 log_softmax: Callable, gelu: Callable) -> Any:
    """Mean next-token cross-entropy of ``tokens`` ``(B, CONTEXT + 1)`` (int); the same
    array code runs under torch and jax.numpy (``xp``), with the framework's softmax,
    log-softmax and GELU passed in."""
    x_tok, y_tok = tokens[:, :-1], tokens[:, 1:]
    bsz, t = x_tok.shape
    h = w["embed"][x_tok] + w["pos"][None, :t]
    causal = xp.tril(xp.ones((t, t))) > 0
    hd = WIDTH // HEADS

    def rms(z: Any, g: Any) -> Any:
        return z * g / xp.sqrt(xp.mean(z * z, axis=-1, keepdims=True) + 1e-6)

    for i in range(LAYERS):
        b = f"block{i}"
        qkv = rms(h, w[f"{b}/norm1"]) @ w[f"{b}/qkv"]
        q, k, v = (qkv[..., j * WIDTH:(j + 1) * WIDTH].reshape(bsz, t, HEADS, hd)
                   .transpose(0, 2, 1, 3) if not hasattr(qkv, "permute") else
                   qkv[..., j * WIDTH:(j + 1) * WIDTH].reshape(bsz, t, HEADS, hd)
                   .permute(0, 2, 1, 3) for j in range(3))
        kt = k.transpose(-1, -2) if hasattr(k, "permute") else xp.swapaxes(k, -1, -2)
        att = (q @ kt) / math.sqrt(hd)
        att = xp.where(causal, att, -1e9)
        ctx = softmax(att) @ v
        ctx = ctx.permute(0, 2, 1, 3) if hasattr(ctx, "permute") else ctx.transpose(0, 2, 1, 3)
        h = h + ctx.reshape(bsz, t, WIDTH) @ w[f"{b}/proj"]
        z = gelu(rms(h, w[f"{b}/norm2"]) @ w[f"{b}/fc1"] + w[f"{b}/fc1_bias"])
        h = h + z @ w[f"{b}/fc2"]
    logits = rms(h, w["norm"]) @ w["head"]
    logp = log_softmax(logits)
    picked = xp.take_along_axis(logp, y_tok[..., None], axis=-1) if not hasattr(
        logp, "gather") else logp.gather(-1, y_tok[..., None])
    return -xp.mean(picked)


# -- the methods, on each backend ---------------------------------------------------------------
#: method -> keyword arguments shared by both backends (refresh intervals set in `configure`)
def configure(method: str, lr: float, steps: int) -> dict[str, Any]:
    gap = max(steps // 5, 1)
    if method == "adamw":
        return dict(lr=lr, weight_decay=0.0)
    if method == "galore":
        return dict(lr=lr, rank=16, update_proj_gap=gap, scale=1.0)
    if method == "flora":
        # Flora's own default is beta1=None: plain Adafactor, nothing to compress
        return dict(lr=lr, rank=16, kappa=gap, beta1=0.9)
    if method == "coap":
        return dict(lr=lr, rank=16, update_interval=max(gap // 2, 1), reproject_factor=2,
                    scale=1.0)
    if method == "plumage":
        return dict(lr=lr, rank=16, update_proj_gap=gap)
    raise SystemExit(f"unknown method {method!r}")


METHODS = ("adamw", "galore", "flora", "coap", "plumage")


def torch_optimizer(method: str, named: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    import xopt.torch as xt

    if method == "adamw":
        return xt.AdamW(named.values(), **kwargs)
    cls = {"galore": "GaLore", "flora": "Flora", "coap": "COAP", "plumage": "PLUMAGE"}[method]
    ctor = getattr(xt, cls)
    groups = [
        {"params": [p for n, p in named.items() if is_projected(n)],
         "param_names": [n for n in named if is_projected(n)]},
        {"params": [p for n, p in named.items() if not is_projected(n)],
         "param_names": [n for n in named if not is_projected(n)], "project": False},
    ]
    return ctor(groups, **kwargs)


def jax_optimizer(method: str, names: list[str], kwargs: dict[str, Any]) -> Any:
    import xopt.jax as xj
    from xopt import specs

    if method == "adamw":
        return xj.adamw(**{"learning_rate" if k == "lr" else k: v for k, v in kwargs.items()})
    spec = specs.get(method)
    hp = spec.make(None, **kwargs)
    param_specs = {n: hp if is_projected(n) else hp.replace(project=False) for n in names}
    return getattr(xj, method)(spec=hp, param_specs=param_specs)


def train_torch(method: str, w0: dict[str, np.ndarray], train: list[np.ndarray],
                held: np.ndarray, kwargs: dict[str, Any]) -> tuple[list[float], float]:
    import torch
    import torch.nn.functional as F

    named = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in w0.items()}
    opt = torch_optimizer(method, named, kwargs)
    fns = dict(softmax=lambda a: torch.softmax(a, -1),
               log_softmax=lambda a: torch.log_softmax(a, -1), gelu=F.gelu)
    losses = []
    for tok in train:
        loss = forward_loss(torch, named, torch.from_numpy(tok), **fns)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        held_loss = float(forward_loss(torch, named, torch.from_numpy(held), **fns))
    return losses, held_loss


def train_jax(method: str, w0: dict[str, np.ndarray], train: list[np.ndarray],
              held: np.ndarray, kwargs: dict[str, Any]) -> tuple[list[float], float]:
    import jax
    import jax.numpy as jnp
    import optax

    params = {k: jnp.asarray(v) for k, v in w0.items()}
    tx = jax_optimizer(method, list(params), kwargs)
    fns = dict(softmax=lambda a: jax.nn.softmax(a, -1),
               log_softmax=lambda a: jax.nn.log_softmax(a, -1),
               gelu=lambda a: jax.nn.gelu(a, approximate=False))

    def loss_fn(p: Any, tok: Any) -> Any:
        # full float32 matmuls, as torch computes them (XLA would use TF32 on a GPU), so
        # that the two backends' curves compare optimizers, not matmul precisions
        with jax.default_matmul_precision("highest"):
            return forward_loss(jnp, p, tok, **fns)

    @jax.jit
    def step(p: Any, s: Any, tok: Any) -> Any:
        loss, g = jax.value_and_grad(loss_fn)(p, tok)
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    state = tx.init(params)
    losses = []
    for tok in train:
        params, state, loss = step(params, state, jnp.asarray(tok))
        losses.append(float(loss))
    return losses, float(jax.jit(loss_fn)(params, jnp.asarray(held)))


# -- the script --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--backends", default="torch,jax")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="lowrank_lm.png", help="PNG of the loss curves")
    ap.add_argument("--json", default=None, help="write every curve here")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    backends = [b for b in args.backends.split(",") if b]

    train_data, held_data = load_corpus()
    w0 = init_weights(args.seed)
    train = batches(train_data, args.batch, args.steps, args.seed + 1)
    held = batches(held_data, 64, 1, args.seed + 2)[0]
    print(f"corpus: pydoc_data.topics, {len(train_data)} train / {len(held_data)} held-out "
          f"bytes; model: {sum(v.size for v in w0.values())} weights")
    runners = {"torch": train_torch, "jax": train_jax}
    curves: dict[str, dict[str, Any]] = {}
    ok = True
    for backend in backends:
        for method in methods:
            t0 = time.perf_counter()
            losses, held_loss = runners[backend](method, w0, train, held,
                                                 configure(method, args.lr, args.steps))
            k = max(1, min(10, len(losses) // 4))
            first, last = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
            lowered = bool(np.isfinite(losses).all() and last < first)
            ok &= lowered
            curves.setdefault(backend, {})[method] = dict(
                loss=losses, held_out=held_loss, first=first, last=last, lowered=lowered)
            print(f"{backend:5s} {method:8s} train loss {first:.3f} -> {last:.3f}, held-out "
                  f"{held_loss:.3f} ({time.perf_counter() - t0:.1f} s)"
                  f"{'' if lowered else '  NOT LOWERED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(curves, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
    else:
        fig, axes = plt.subplots(1, len(backends), figsize=(6 * len(backends), 4),
                                 squeeze=False)
        for ax, backend in zip(axes[0], backends, strict=True):
            for method, c in curves[backend].items():
                ax.plot(c["loss"], label=method, lw=2.2 if method == "adamw" else 1.2,
                        color="black" if method == "adamw" else None)
            ax.set(title=f"{backend}: training loss", xlabel="step",
                   ylabel="cross-entropy (nats/byte)")
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"plot: {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
