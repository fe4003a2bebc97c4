"""Pre-train a small LLaMA-style language model with POET-X layers, in PyTorch or JAX.

    python examples/poet_llama.py --backend torch            # ~150 steps, a minute on a CPU
    python examples/poet_llama.py --backend jax --steps 300 --merge-interval 50

Every linear layer of the decoder blocks (q, k, v, o, gate, up, down) is a POET-X layer:
its weight is ``R · W0 · P`` with ``W0`` fixed (the row-normalised random init) and ``R``,
``P`` block-diagonal orthogonal (Cayley–Neumann, block size ``--block-size``) between
permutations; only the rotations train, with the authors' POETAdamW arithmetic (learning
rate ``--poet-lr`` × 0.5). Every ``--merge-interval`` steps the rotations are merged into
``W0``, new permutations are drawn and the rotations' moments restart. Embeddings, RMSNorm
gains and the output layer train normally (AdamW arithmetic at ``--lr``), as in the
authors' LLaMA runs (``lm_head`` excluded from POET).

Model: 2 pre-norm blocks, width 64, 4 heads, context 64, RMSNorm, SwiGLU MLP (hidden 128),
learned positions, no biases. Corpus: the Python documentation that ships with CPython
(``pydoc_data.topics``, about 450 KB), bytes as tokens (128 ASCII codes), last 10% held
out; nothing is downloaded or bundled. The script prints train and held-out loss and exits
non-zero if training did not lower the loss.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB, WIDTH, HEADS, LAYERS, CONTEXT, HIDDEN = 128, 64, 4, 2, 64, 128


def load_corpus():
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    data = np.where(data < VOCAB, data, ord("?"))
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def batch(data, n, rng):
    start = rng.integers(0, len(data) - CONTEXT - 1, size=n)
    return np.stack([data[s:s + CONTEXT + 1] for s in start])


# -- PyTorch ---------------------------------------------------------------------------------


def run_torch(args, train, held):
    import torch
    from torch import nn

    from xopt.specs.poet import POET
    from xopt.torch.poet import POETAdamW, convert, merge_and_reset, poet_param_groups

    torch.manual_seed(args.seed)

    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.mlp_norm = RMSNorm(WIDTH), RMSNorm(WIDTH)
            for name, (i, o) in dict(q_proj=(WIDTH, WIDTH), k_proj=(WIDTH, WIDTH),
                                     v_proj=(WIDTH, WIDTH), o_proj=(WIDTH, WIDTH),
                                     gate_proj=(WIDTH, HIDDEN), up_proj=(WIDTH, HIDDEN),
                                     down_proj=(HIDDEN, WIDTH)).items():
                setattr(self, name, nn.Linear(i, o, bias=False))

        def forward(self, x):
            b, t, _ = x.shape
            h = self.attn_norm(x)
            q, k, v = (p(h).view(b, t, HEADS, -1).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, WIDTH))
            h = self.mlp_norm(x)
            return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.pos = nn.Parameter(0.02 * torch.randn(CONTEXT, WIDTH))
            self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm = RMSNorm(WIDTH)
            self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

        def forward(self, tok):
            x = self.embed(tok) + self.pos[: tok.shape[1]]
            for blk in self.layers:
                x = blk(x)
            return self.lm_head(self.norm(x))

    spec = POET(block_size=args.block_size, merge_interval=args.merge_interval,
                lr=args.poet_lr, seed=args.seed)
    model = LM()
    _, n = convert(model, spec=spec)  # every Linear but lm_head
    print(f"torch: {n} POET layers, {sum(p.numel() for p in model.parameters() if p.requires_grad)}"
          " trainable parameters")
    opt = POETAdamW(poet_param_groups(model, lr=args.lr, poet_lr=args.poet_lr), spec=spec,
                    model=model)  # merges every merge_interval updates
    rng = np.random.default_rng(args.seed)

    def loss_of(tokens):
        tok = torch.as_tensor(tokens)
        logits = model(tok[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tok[:, 1:].reshape(-1))

    losses = []
    for step in range(args.steps):
        loss = loss_of(batch(train, args.batch, rng))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}")
    merge_and_reset(model)  # fold the last rotations in: a plain weight per layer again
    with torch.no_grad():
        held_loss = loss_of(batch(held, 64, np.random.default_rng(0))).item()
    return losses, held_loss


# -- JAX ----------------------------------------------------------------------------------------


def run_jax(args, train, held):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    from xopt.jax.poet import POETDense, merge_and_reset, poet_adamw
    from xopt.specs.poet import POET

    spec = POET(block_size=args.block_size, merge_interval=args.merge_interval,
                lr=args.poet_lr, seed=args.seed)

    class RMSNorm(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("weight", nn.initializers.ones, (x.shape[-1],))
            return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            b, t, _ = x.shape
            h = RMSNorm(name="attn_norm")(x)
            q, k, v = (POETDense(WIDTH, spec=spec, name=n)(h).reshape(b, t, HEADS, -1)
                       for n in ("q_proj", "k_proj", "v_proj"))
            a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, WIDTH)
            x = x + POETDense(WIDTH, spec=spec, name="o_proj")(a)
            h = RMSNorm(name="mlp_norm")(x)
            g = POETDense(HIDDEN, spec=spec, name="gate_proj")(h)
            u = POETDense(HIDDEN, spec=spec, name="up_proj")(h)
            return x + POETDense(WIDTH, spec=spec, name="down_proj")(nn.silu(g) * u)

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tok):
            x = nn.Embed(VOCAB, WIDTH, name="embed")(tok)
            pos = self.param("pos", nn.initializers.normal(0.02), (CONTEXT, WIDTH))
            x = x + pos[: tok.shape[1]]
            for i in range(LAYERS):
                x = Block(name=f"layers_{i}")(x)
            return nn.Dense(VOCAB, use_bias=False, name="lm_head")(RMSNorm(name="norm")(x))

    model = LM()
    variables = model.init(jax.random.PRNGKey(args.seed), jnp.zeros((1, CONTEXT), jnp.int32))
    params, poet = variables["params"], variables["poet"]
    label = lambda tree: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: "poet" if str(path[-1].key) == "oft_R" else "base", tree)
    tx = optax.multi_transform(
        {"poet": poet_adamw(spec=spec),
         # the authors' non-rotation groups: the same Adam arithmetic, no scale, no reset
         "base": poet_adamw(learning_rate=args.lr, poet_scale=1.0, merge_interval=2**30)},
        label)
    state = tx.init(params)
    n_train = sum(x.size for x in jax.tree.leaves(params))
    n_layers = sum(1 for k, _ in jax.tree_util.tree_leaves_with_path(poet)
                   if str(k[-1].key) == "weight")
    print(f"jax: {n_layers} POET layers, {n_train} trainable parameters")

    def loss_fn(p, poet, tokens):
        logits = model.apply({"params": p, "poet": poet}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(p, poet, s, tokens):
        loss, g = jax.value_and_grad(loss_fn)(p, poet, tokens)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    rng = np.random.default_rng(args.seed)
    losses = []
    for t in range(args.steps):
        params, state, loss = step(params, poet, state, jnp.asarray(batch(train, args.batch, rng)))
        losses.append(float(loss))
        if (t + 1) % args.merge_interval == 0:
            merged = merge_and_reset({"params": params, "poet": poet}, spec)
            params, poet = merged["params"], merged["poet"]
        if t % 25 == 0 or t == args.steps - 1:
            print(f"step {t:4d}  loss {float(loss):.3f}")
    held_loss = float(loss_fn(params, poet, jnp.asarray(batch(held, 64, np.random.default_rng(0)))))
    return losses, held_loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("torch", "jax"), default="torch")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--merge-interval", type=int, default=50)
    ap.add_argument("--poet-lr", type=float, default=1e-2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    train, held = load_corpus()
    print(f"corpus: pydoc_data.topics, {len(train)} train / {len(held)} held-out bytes")
    t0 = time.perf_counter()
    losses, held_loss = (run_torch if args.backend == "torch" else run_jax)(args, train, held)
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"{args.backend}: train loss {first:.3f} -> {last:.3f} (mean of first/last 10 steps); "
          f"held-out {held_loss:.3f}; uniform would be {math.log(VOCAB):.3f}; "
          f"{time.perf_counter() - t0:.1f} s")
    ok = np.isfinite(losses).all() and last < first - 0.3
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
