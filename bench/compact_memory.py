"""Peak GPU memory and throughput of a LLaMA-style training step: AdamW vs CompAct.

One process measures, one after the other and each from a fresh model: full-rank
``torch.optim.AdamW`` and xopt's CompAct (``compact_model`` + ``CompActAdamW``) at
r = n/2, n/4, n/8, with the layers the authors convert (q, k, v, gate, up, down
projected; o_proj identity with scale_o_proj·α). The model is LLaMA-350M-like (the GaLore
and CompAct papers' ``llama_350m``: hidden 1024, 24 blocks, 16 heads, SwiGLU width 2736,
RMSNorm, rotary embeddings, vocabulary 32000) in bfloat16, as the paper trains it.

Both variants share every other piece, written to keep only what a backward needs (so
that activations of the linear layers, which CompAct compresses, are the bulk): RMSNorm
saves its input and 1/rms, SwiGLU saves its two inputs (recomputing SiLU), attention is
``scaled_dot_product_attention`` (flash on the GPU), and the LM head and cross-entropy run
in chunks of tokens under activation checkpointing (the logits of a whole batch would
otherwise dominate both variants' peak alike). ``--plain-head`` turns the last off.

    python bench/compact_memory.py --out bench/compact_memory.json       # GPU
    python bench/compact_memory.py --tiny                                 # CPU smoke test

Peak memory: ``torch.cuda.max_memory_allocated`` over warm-up and timed steps (model,
gradients, optimizer state and activations), reset before each configuration.
Throughput: tokens per second over the timed steps (forward, backward, optimizer step,
``zero_grad``), with ``torch.cuda.synchronize`` around the timed region.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xopt.torch.compact import CompActAdamW, compact_model  # noqa: E402

CONFIGS = {
    "350m": dict(hidden=1024, layers=24, heads=16, inter=2736, vocab=32000),
    "tiny": dict(hidden=64, layers=2, heads=4, inter=176, vocab=128),
}


class _RMSNormFn(torch.autograd.Function):
    """y = x / rms(x) · w, saving x and 1/rms (not y)."""

    @staticmethod
    def forward(ctx, x, w, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, rstd)
        return (xf * rstd).to(x.dtype) * w

    @staticmethod
    def backward(ctx, g):
        x, w, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        gw = (g.float() * xhat).sum(dim=tuple(range(g.dim() - 1))).to(w.dtype)
        gx_hat = g.float() * w.float()
        gx = rstd * (gx_hat - xhat * (gx_hat * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, None


class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        return _RMSNormFn.apply(x, self.weight, self.eps)


class _SwiGLUFn(torch.autograd.Function):
    """silu(a) · b, saving a and b only."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        af = a.float()
        s = torch.sigmoid(af)
        silu = af * s
        ga = g.float() * b.float() * (s * (1 + af * (1 - s)))
        gb = g.float() * silu
        return ga.to(a.dtype), gb.to(b.dtype)


def _rotary(hd: int, n: int, device, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=device).float() / hd))
    f = torch.outer(torch.arange(n, device=device).float(), inv)
    emb = torch.cat([f, f], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attention(nn.Module):
    def __init__(self, h: int, nh: int) -> None:
        super().__init__()
        self.nh, self.hd = nh, h // nh
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x, cos, sin):
        b, n, h = x.shape
        q, k, v = (p(x).view(b, n, self.nh, self.hd).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, h))


class MLP(nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(_SwiGLUFn.apply(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, h: int, nh: int, i: int) -> None:
        super().__init__()
        self.self_attn = Attention(h, nh)
        self.mlp = MLP(h, i)
        self.input_layernorm = RMSNorm(h)
        self.post_attention_layernorm = RMSNorm(h)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """LLaMA-style causal LM; ``forward(ids)`` returns the mean next-token loss."""

    def __init__(self, hidden, layers, heads, inter, vocab, chunk=4096, plain_head=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([Block(hidden, heads, inter) for _ in range(layers)])
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.heads, self.chunk, self.plain_head = heads, chunk, plain_head
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def _head_loss(self, h, labels):
        logits = self.lm_head(h).float()
        return F.cross_entropy(logits, labels, reduction="sum")

    def forward(self, ids):
        b, n = ids.shape
        x = self.embed_tokens(ids)
        cos, sin = _rotary(x.shape[-1] // self.heads, n, x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        h = self.norm(x)[:, :-1].reshape(-1, x.shape[-1])
        labels = ids[:, 1:].reshape(-1)
        if self.plain_head:
            return self._head_loss(h, labels) / labels.numel()
        total = 0.0
        for s in range(0, labels.numel(), self.chunk):
            total = total + checkpoint(self._head_loss, h[s:s + self.chunk],
                                       labels[s:s + self.chunk], use_reentrant=False)
        return total / labels.numel()


def measure(name, cfg, args, device, rank=None, generator="torch"):
    torch.manual_seed(0)
    model = Llama(**cfg, plain_head=args.plain_head).to(device=device, dtype=args.dtype)
    if rank is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    else:
        compact_model(model, rank=rank, scale=0.25, scale_o_proj=0.5, gap=50, seed=0,
                      generator=generator)
        opt = CompActAdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cpu").manual_seed(1)
    batches = [torch.randint(0, cfg["vocab"], (args.batch, args.seq), generator=gen).to(device)
               for _ in range(2)]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses = []

    def one(i):
        loss = model(batches[i % 2])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(args.warmup):
        losses.append(one(i).item())
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = one(i)
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() if cuda else float("nan")
    n_params = sum(p.numel() for p in model.parameters())
    out = dict(name=name, rank=rank, generator=generator if rank else None,
               peak_bytes=peak, peak_gib=peak / 2**30, step_s=dt / args.steps,
               tokens_per_s=args.batch * args.seq * args.steps / dt, params=n_params,
               losses=losses)
    model = opt = batches = None  # free before the next configuration
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke test)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--plain-head", action="store_true",
                    help="whole-batch logits and cross-entropy (no chunking)")
    ap.add_argument("--xopt-generator", action="store_true",
                    help="also measure r=n/4 with xopt.random's portable generator")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    cfg = CONFIGS["tiny" if args.tiny else "350m"]
    args.batch = args.batch or (2 if args.tiny else 128)
    args.seq = args.seq or (16 if args.tiny else 256)
    args.steps = args.steps or (2 if args.tiny else 5)
    args.dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    head = {"device": dev_name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(),
            "config": cfg, "batch": args.batch, "seq": args.seq, "steps": args.steps,
            "warmup": args.warmup, "dtype": str(args.dtype), "chunked_head": not args.plain_head}
    print(f"device: {dev_name}; date: {head['date']}; torch {torch.__version__}")
    print(f"model {cfg}; batch {args.batch} x seq {args.seq}; {args.dtype}")
    runs = [("adamw", None, "torch"), ("compact r=n/2", 0.5, "torch"),
            ("compact r=n/4", 0.25, "torch"), ("compact r=n/8", 0.125, "torch")]
    if args.xopt_generator:
        runs.append(("compact r=n/4 (xopt.random)", 0.25, "xopt"))
    results = []
    for name, rank, generator in runs:
        r = measure(name, cfg, args, device, rank, generator)
        results.append(r)
        print(f"{name:30s} peak {r['peak_gib']:8.3f} GiB  {r['tokens_per_s']:10.0f} tok/s  "
              f"step {r['step_s'] * 1e3:8.1f} ms  loss {r['losses'][0]:.3f}->{r['losses'][-1]:.3f}",
              flush=True)
    base = results[0]
    print()
    print("| config | peak GiB | vs AdamW | tokens/s | vs AdamW |")
    print("|---|---|---|---|---|")
    for r in results:
        dm = (r["peak_bytes"] / base["peak_bytes"] - 1) * 100 if base["peak_bytes"] else math.nan
        dt = (r["tokens_per_s"] / base["tokens_per_s"] - 1) * 100
        r["peak_change_pct"], r["throughput_change_pct"] = dm, dt
        print(f"| {r['name']} | {r['peak_gib']:.2f} | {dm:+.1f}% | {r['tokens_per_s']:.0f} | "
              f"{dt:+.1f}% |")
    if args.out:
        Path(args.out).write_text(json.dumps({**head, "results": results}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
