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


#: Elementwise work (the norms' and SwiGLU's float32 arithmetic) runs over row chunks of
#: about this many elements, so that its float32 temporaries stay small next to the saved
#: activations (one whole-batch float32 copy of SwiGLU's input is ~360 MiB at batch
#: 128 x 256, and the backward makes several); the same code runs for both variants.
CHUNK_ELEMS = 1 << 24


def _rows(t):
    return t.reshape(-1, t.shape[-1])


def _spans(rows, width):
    step = max(1, CHUNK_ELEMS // width)
    return [(s, min(s + step, rows)) for s in range(0, rows, step)]


class _RMSNormFn(torch.autograd.Function):
    """y = x / rms(x) · w (HF LLaMA's arithmetic), saving x and 1/rms (not y)."""

    @staticmethod
    def forward(ctx, x, w, eps):
        x2 = _rows(x)
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], 1, device=x.device, dtype=torch.float32)
        for s, e in _spans(*x2.shape):
            xf = x2[s:e].float()
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            rstd[s:e] = r
            torch.mul((xf * r).to(x.dtype), w, out=y[s:e])
        ctx.save_for_backward(x, w, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        x, w, rstd = ctx.saved_tensors
        x2, g2 = _rows(x), _rows(g)
        gx = torch.empty_like(x2)
        gw = torch.zeros(w.shape, device=w.device, dtype=torch.float32)
        wf = w.float()
        for s, e in _spans(*x2.shape):
            r = rstd[s:e]
            xhat = x2[s:e].float() * r
            gf = g2[s:e].float()
            gw += (gf * xhat).sum(0)
            gxh = gf * wf
            gx[s:e] = r * (gxh - xhat * (gxh * xhat).mean(-1, keepdim=True))
        return gx.view(x.shape), gw.to(w.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        return _RMSNormFn.apply(x, self.weight, self.eps)


class _SwiGLUFn(torch.autograd.Function):
    """silu(a) · b, saving a and b only (silu recomputed in the backward)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        a2, b2, g2 = _rows(a), _rows(b), _rows(g)
        ga, gb = torch.empty_like(a2), torch.empty_like(b2)
        for s, e in _spans(*a2.shape):
            af = a2[s:e].float()
            sg = torch.sigmoid(af)
            silu = af * sg
            gf = g2[s:e].float()
            gb[s:e] = gf * silu
            # d silu(a) / da = sigmoid(a) (1 + a (1 - sigmoid(a))) = sg + silu (1 - sg)
            ga[s:e] = gf * b2[s:e].float() * (sg + silu * (1.0 - sg))
        return ga.view(a.shape), gb.view(b.shape)


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

    def __init__(self, hidden, layers, heads, inter, vocab, chunk=1024, plain_head=False):
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


def measure(name, cfg, args, device, rank=None, generator="torch", moments=None,
            batch=None, profile=False):
    """One configuration from a fresh model: peak memory, throughput, losses."""
    batch = batch or args.batch
    torch.manual_seed(0)
    model = Llama(**cfg, plain_head=args.plain_head).to(device=device, dtype=args.dtype)
    if rank is None:
        # torch's fastest AdamW where it exists (one fused kernel on CUDA), state in the
        # parameters' dtype (bfloat16).
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0,
                                fused=device.type == "cuda")
    else:
        compact_model(model, rank=rank, scale=0.25, scale_o_proj=0.5, gap=50, seed=0,
                      generator=generator)
        opt = CompActAdamW(model.parameters(), lr=1e-3, moment_dtype=moments)
    gen = torch.Generator(device="cpu").manual_seed(1)
    batches = [torch.randint(0, cfg["vocab"], (batch, args.seq), generator=gen).to(device)
               for _ in range(2)]
    cuda = device.type == "cuda"
    alloc = torch.cuda.memory_allocated if cuda else (lambda: 0)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, mem = [], {}

    def one(i, probe=False):
        before = alloc()
        loss = model(batches[i % 2])
        if probe:  # what the forward leaves for the backward (saved tensors, the loss)
            mem["after_forward_gib"] = alloc() / 2**30
            mem["saved_by_forward_gib"] = (alloc() - before) / 2**30
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(args.warmup):
        losses.append(one(i, probe=i == args.warmup - 1).item())
    mem["between_steps_gib"] = alloc() / 2**30  # parameters and optimizer state
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = one(i)
    host = time.perf_counter() - t0  # host time to issue the timed steps
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() if cuda else float("nan")
    prof_table = None
    if profile and cuda:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprofile
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            one(0)
            torch.cuda.synchronize()
        ka = prof.key_averages()
        for key in ("self_cuda_time_total", "self_device_time_total"):
            try:
                prof_table = ka.table(sort_by=key, row_limit=25, max_name_column_width=60)
                break
            except Exception:  # noqa: BLE001 (the key's name differs between versions)
                continue
    n_params = sum(p.numel() for p in model.parameters())
    out = dict(name=name, rank=rank, generator=generator if rank else None,
               moments=str(moments) if rank else "bf16 (torch.optim.AdamW)", batch=batch,
               peak_bytes=peak, peak_gib=peak / 2**30, step_s=dt / args.steps,
               host_step_s=host / args.steps,
               tokens_per_s=batch * args.seq * args.steps / dt, params=n_params,
               losses=losses, **mem)
    if prof_table is not None:
        out["profile"] = prof_table
    model = opt = batches = None  # free before the next configuration
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke test)")
    ap.add_argument("--batch", type=int, nargs="+", default=None,
                    help="batch sizes; each gets the whole table (default 128)")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 8)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--plain-head", action="store_true",
                    help="whole-batch logits and cross-entropy (no chunking)")
    ap.add_argument("--xopt-generator", action="store_true",
                    help="also measure r=n/4 with xopt.random's portable generator")
    ap.add_argument("--profile", action="store_true",
                    help="profile one more step of AdamW and CompAct r=n/4 (first batch size)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    cfg = CONFIGS["tiny" if args.tiny else "350m"]
    batches = args.batch or [2 if args.tiny else 128]
    args.batch = batches[0]
    args.seq = args.seq or (16 if args.tiny else 256)
    args.steps = args.steps or (2 if args.tiny else 8)
    args.dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    head = {"device": dev_name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(),
            "config": cfg, "batches": batches, "seq": args.seq, "steps": args.steps,
            "warmup": args.warmup, "dtype": str(args.dtype), "chunked_head": not args.plain_head,
            "argv": sys.argv[1:] if argv is None else list(argv)}
    print(f"device: {dev_name}; date: {head['date']}; torch {torch.__version__}")
    print(f"model {cfg}; batch {batches} x seq {args.seq}; {args.dtype}")
    low = args.dtype  # CompAct's moments in the parameters' dtype, as torch.optim.AdamW's
    runs = [("adamw", None, "torch", None), ("compact r=n/2", 0.5, "torch", low),
            ("compact r=n/4", 0.25, "torch", low), ("compact r=n/8", 0.125, "torch", low)]
    if low != torch.float32:
        runs.append(("compact r=n/4, fp32 moments", 0.25, "torch", None))
    if args.xopt_generator:
        runs.append(("compact r=n/4 (xopt.random)", 0.25, "xopt", low))
    results = []
    for bi, batch in enumerate(batches):
        rows = []
        for name, rank, generator, moments in runs:
            prof = args.profile and bi == 0 and rank in (None, 0.25) and moments == low \
                and generator == "torch"
            r = measure(name, cfg, args, device, rank, generator, moments, batch, prof)
            rows.append(r)
            print(f"b={batch} {name:30s} peak {r['peak_gib']:8.3f} GiB  "
                  f"{r['tokens_per_s']:10.0f} tok/s  step {r['step_s'] * 1e3:8.1f} ms "
                  f"(host {r['host_step_s'] * 1e3:6.1f} ms)  saved "
                  f"{r.get('saved_by_forward_gib', 0):7.3f} GiB  state "
                  f"{r['between_steps_gib']:6.3f} GiB  "
                  f"loss {r['losses'][0]:.3f}->{r['losses'][-1]:.3f}", flush=True)
        base = rows[0]
        for r in rows:
            dm = (r["peak_bytes"] / base["peak_bytes"] - 1) * 100 if base["peak_bytes"] \
                else math.nan
            dt = (r["tokens_per_s"] / base["tokens_per_s"] - 1) * 100
            r["peak_change_pct"], r["throughput_change_pct"] = dm, dt
        results += rows
    profiles = [r for r in results if "profile" in r]
    if profiles:
        text = "\n".join(f"profile of one step, {r['name']} (batch {r['batch']}):\n"
                         f"{r['profile']}\n" for r in profiles)
        if args.out:
            Path(args.out).with_suffix(".profile.txt").write_text(text)
        else:
            print(text)
    for batch in batches:
        print(f"\nbatch {batch} x {args.seq} ({args.dtype}, {dev_name}):")
        print("| config | peak GiB | vs AdamW | tokens/s | vs AdamW | saved by forward GiB |")
        print("|---|---|---|---|---|---|")
        for r in results:
            if r["batch"] == batch:
                print(f"| {r['name']} | {r['peak_gib']:.2f} | {r['peak_change_pct']:+.1f}% | "
                      f"{r['tokens_per_s']:.0f} | {r['throughput_change_pct']:+.1f}% | "
                      f"{r.get('saved_by_forward_gib', math.nan):.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({**head, "results": results}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
