"""Train a small language model sharded over several JAX devices, with any xopt
transformation: the JAX twin of ``examples/fsdp_lm.py``.

    python examples/sharded_lm_jax.py --method velo                # 2 host devices (CPU)
    python examples/sharded_lm_jax.py --method galore --devices 8 --device cuda   # 8 GPUs

A byte-level decoder (2 pre-norm blocks, width 64, context 32) on ``pydoc_data.topics``,
written in ``jax.numpy``. The devices form one mesh axis ``"data"``: every global batch is
split along it (data parallelism) and every parameter along its first dimension that
divides by the number of devices (as FSDP2 shards it; the others replicated); the
optimizer state is placed as the parameters by :func:`xopt.jax.sharding.init` and the
whole step is one ``jax.jit``, in which XLA inserts the collectives. On the CPU the
devices are host devices: the script sets
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX starts (``--device cuda``:
the GPUs JAX sees instead). It prints the loss every few steps and exits 1 unless it went down.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import numpy as np

VOCAB, WIDTH, HEADS, LAYERS, CONTEXT = 128, 64, 4, 2, 32
METHODS = ("adamw", "small_fc_lopt", "velo", "mulo", "galore", "flora", "coap", "plumage")
LEARNED = ("small_fc_lopt", "velo", "mulo")
PROJECTED = ("qkv", "proj", "fc1", "fc2")


def corpus() -> np.ndarray:
    from pydoc_data.topics import topics

    data = np.frombuffer("\n".join(topics[k] for k in sorted(topics)).encode(), np.uint8)
    return np.where(data < VOCAB, data, ord("?")).astype(np.int32)


def global_batch(data: np.ndarray, step: int, batch: int) -> np.ndarray:
    start = np.random.default_rng(step).integers(0, len(data) - CONTEXT - 1, size=batch)
    return np.stack([data[s:s + CONTEXT + 1] for s in start])


def init_weights(seed: int = 0) -> dict[str, np.ndarray]:
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
        w[f"{b}/fc1"] = normal(WIDTH, 2 * WIDTH)
        w[f"{b}/fc2"] = normal(2 * WIDTH, WIDTH, std=0.02 / math.sqrt(2 * LAYERS))
    w["norm"] = np.ones(WIDTH, np.float32)
    w["head"] = normal(WIDTH, VOCAB)
    return w


def loss_fn(w: dict[str, Any], tokens: Any) -> Any:
    import jax
    import jax.numpy as jnp

    x, y = tokens[:, :-1], tokens[:, 1:]
    bsz, t = x.shape
    hd = WIDTH // HEADS
    h = w["embed"][x] + w["pos"][None, :t]
    causal = jnp.tril(jnp.ones((t, t), bool))

    def rms(z: Any, g: Any) -> Any:
        return z * g / jnp.sqrt(jnp.mean(z * z, axis=-1, keepdims=True) + 1e-6)

    for i in range(LAYERS):
        b = f"block{i}"
        qkv = rms(h, w[f"{b}/norm1"]) @ w[f"{b}/qkv"]
        q, k, v = (qkv[..., j * WIDTH:(j + 1) * WIDTH].reshape(bsz, t, HEADS, hd)
                   .transpose(0, 2, 1, 3) for j in range(3))
        att = jnp.where(causal, q @ k.swapaxes(-1, -2) / math.sqrt(hd), -1e9)
        ctx = (jax.nn.softmax(att, -1) @ v).transpose(0, 2, 1, 3).reshape(bsz, t, WIDTH)
        h = h + ctx @ w[f"{b}/proj"]
        h = h + jax.nn.gelu(rms(h, w[f"{b}/norm2"]) @ w[f"{b}/fc1"]) @ w[f"{b}/fc2"]
    logp = jax.nn.log_softmax(rms(h, w["norm"]) @ w["head"], -1)
    return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))


def transformation(method: str, names: list[str], steps: int, lr: float) -> Any:
    """``method``'s optax transformation; the low-rank methods project the blocks'
    matrices (rank 16), the other parameters take their full-rank update."""
    import xopt.jax as xj
    from xopt import specs

    if method == "adamw":
        return xj.adamw(learning_rate=lr)
    if method in LEARNED:
        return getattr(xj, method)(num_training_steps=steps)
    gap = max(steps // 4, 1)
    kwargs = {"galore": dict(lr=lr, rank=16, update_proj_gap=gap, scale=1.0),
              "flora": dict(lr=lr, rank=16, kappa=gap, beta1=0.9),
              "coap": dict(lr=lr, rank=16, update_interval=gap, reproject_factor=2, scale=1.0),
              "plumage": dict(lr=lr, rank=16, update_proj_gap=gap)}[method]
    hp = specs.get(method).make(None, **kwargs)
    param_specs = {n: hp if n.rsplit("/", 1)[-1] in PROJECTED else hp.replace(project=False)
                   for n in names}
    return getattr(xj, method)(spec=hp, param_specs=param_specs)


def train(method: str, steps: int, batch: int, lr: float, n: int) -> list[float]:
    import jax
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from xopt.jax.sharding import init

    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"--devices {n}: jax sees {len(devices)}")
    if batch % n:
        raise SystemExit(f"--batch {batch} must divide by the {n} devices")
    mesh = Mesh(np.array(devices[:n]), ("data",))

    def placement(shape: tuple[int, ...]) -> NamedSharding:
        axes: list[Any] = [None] * len(shape)
        d = next((i for i, s in enumerate(shape) if s % n == 0), None)
        if d is not None:
            axes[d] = "data"
        return NamedSharding(mesh, PartitionSpec(*axes))

    w0 = init_weights()
    params = {k: jax.device_put(v, placement(v.shape)) for k, v in w0.items()}
    tx = transformation(method, list(w0), steps, lr)
    state = init(tx, params)
    batch_sharding = NamedSharding(mesh, PartitionSpec("data", None))

    @jax.jit
    def step(params, state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        extra = {"value": loss} if method in LEARNED else {}
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state, loss

    data = corpus()
    losses = []
    for t in range(steps):
        tokens = jax.device_put(global_batch(data, t, batch), batch_sharding)
        params, state, loss = step(params, state, tokens)
        losses.append(float(loss))
        if t % 5 == 0 or t == steps - 1:
            print(f"{method} step {t:3d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def lowered(losses: list[float]) -> bool:
    k = max(len(losses) // 4, 1)
    return bool(np.isfinite(losses).all()) and np.mean(losses[-k:]) < np.mean(losses[:k])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="adamw", choices=METHODS)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16, help="global batch (split over devices)")
    ap.add_argument("--lr", type=float, default=3e-3,
                    help="learning rate (the learned optimizers take none)")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu: host devices; cuda: the GPUs JAX sees")
    args = ap.parse_args(argv)
    if args.device == "cpu" and "jax" not in sys.modules:
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
    losses = train(args.method, args.steps, args.batch, args.lr, args.devices)
    ok = lowered(losses)
    print(f"{args.method}: loss {losses[0]:.4f} -> {losses[-1]:.4f} on {args.devices} "
          "devices: " + ("lowered" if ok else "NOT lowered"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
