"""The LLaMA of CompAct's recordings, written once for torch and JAX.

The authors' ``peft_pretraining/modeling_llama.py`` (CompAct's repository) as the golden
LLaMA trace ran it: RMSNorm as ``x·rsqrt(mean(x²) + ε)·w``, rotary embeddings with the
half-rotation layout and base 10000, causal attention, SwiGLU ``down(silu(gate(x))·up(x))``,
the LM head without bias, and the mean cross-entropy of the shifted labels.

:func:`loss` is the model, once, on the operations both frameworks spell alike; what each
does its own way comes in :class:`Ops` (torch's fused attention and cross-entropy kernels,
as the authors' model calls them; the same formulas written out in jax.numpy), and the
linear layers come from the caller, so a CompAct layer (xopt's torch module, or
:func:`xopt.jax.compact.compact_linear` with its gradient carrier) stands wherever the
authors' code converted one. :func:`torch_llama` is the model as a torch module with the
authors' parameter names, which :func:`xopt.torch.compact_model` converts in place.

The order of the operations is part of the model: a backward pass sums a tensor's gradient
contributions in the order of the forward's operations (``t·cos`` before
``rotate_half(t)·sin``), so reordering them changes the gradients' last bits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from xopt.specs import arrays

__all__ = ["Ops", "jax_ops", "loss", "rotary_tables", "torch_llama", "torch_ops"]


@dataclasses.dataclass(frozen=True)
class Ops:
    """What the two frameworks do their own way.

    Attributes:
      xp: the array namespace (``torch`` or ``jax.numpy``).
      embed: ``(table, ids) -> rows``.
      variance: ``x -> mean(x², last axis, kept)``, RMSNorm's (the authors' takes it in
        float32 through ``pow``).
      attention: ``(q, k, v) -> o``: causal softmax attention, ``(batch, heads, n, d)``.
      silu: ``x -> x·sigmoid(x)``.
      next_token_loss: ``(logits (b, n, V), ids (b, n)) -> mean cross-entropy of token
        i + 1 given logits i``.
    """

    xp: Any
    embed: Callable[[Any, Any], Any]
    variance: Callable[[Any], Any]
    attention: Callable[[Any, Any, Any], Any]
    silu: Callable[[Any], Any]
    next_token_loss: Callable[[Any, Any], Any]


def rotary_tables(head_dim: int, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables (max_pos × head_dim), float32, as the authors' LlamaRotaryEmbedding
    (computed here in float64 and rounded; torch's float32 cos/sin differ by an ulp)."""
    inv = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    inv = inv.astype(np.float32)
    freqs = np.outer(np.arange(max_pos, dtype=np.float32), inv).astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1).astype(np.float64)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def loss(cfg: dict[str, Any], ids: Any, *, ops: Ops, weight: Callable[[str], Any],
         linear: Callable[[Any, str], Any]) -> Any:
    """The mean next-token loss of token ids ``ids`` (``batch × n``).

    Args:
      cfg: the trace's ``LlamaConfig`` (hidden_size, num_attention_heads,
        num_hidden_layers, rms_norm_eps, max_position_embeddings, vocab_size, ...).
      ops: the framework's :class:`Ops`.
      weight: ``name -> array``: a parameter by its name in the trace
        (``model/norm/weight``).
      linear: ``(x, name) -> x Wᵀ`` for the weight ``name``
        (``model/layers/0/self_attn/q_proj/weight``, ``lm_head/weight``).
    """
    xp = ops.xp
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    hd, eps = h // nh, cfg["rms_norm_eps"]
    b, n = ids.shape
    cos, sin = rotary_tables(hd, cfg["max_position_embeddings"])
    x = ops.embed(weight("model/embed_tokens/weight"), ids)
    cos, sin = (arrays.constant(xp, t[:n][None, None], x) for t in (cos, sin))

    def norm(x: Any, name: str) -> Any:
        return weight(name) * (x * arrays.rsqrt(xp, ops.variance(x) + eps))

    def heads(t: Any) -> Any:  # (b, n, h) -> (b, nh, n, hd)
        return xp.swapaxes(xp.reshape(t, (b, n, nh, hd)), 1, 2)

    def rotate(t: Any) -> Any:  # t·cos + rotate_half(t)·sin, in this order (see below)
        return t * cos + arrays.concat(xp, [-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin

    for i in range(cfg["num_hidden_layers"]):
        pre = f"model/layers/{i}/"
        a = norm(x, pre + "input_layernorm/weight")
        q, k, v = (heads(linear(a, pre + f"self_attn/{w}_proj/weight")) for w in "qkv")
        o = ops.attention(rotate(q), rotate(k), v)
        x = x + linear(xp.reshape(xp.swapaxes(o, 1, 2), (b, n, h)),
                       pre + "self_attn/o_proj/weight")
        a = norm(x, pre + "post_attention_layernorm/weight")
        gate = ops.silu(linear(a, pre + "mlp/gate_proj/weight"))
        x = x + linear(gate * linear(a, pre + "mlp/up_proj/weight"),
                       pre + "mlp/down_proj/weight")
    return ops.next_token_loss(linear(norm(x, "model/norm/weight"), "lm_head/weight"), ids)


# -- torch ---------------------------------------------------------------------------------------


def torch_ops() -> Ops:
    """torch's kernels, as the authors' model calls them (``scaled_dot_product_attention``,
    ``cross_entropy``, ``nn.Embedding``)."""
    import torch
    import torch.nn.functional as F

    def next_token_loss(logits: Any, ids: Any) -> Any:
        vocab = logits.shape[-1]
        return F.cross_entropy(logits[..., :-1, :].contiguous().view(-1, vocab),
                               ids[..., 1:].contiguous().view(-1))

    return Ops(xp=torch, embed=lambda table, ids: F.embedding(ids, table),
               variance=lambda x: x.to(torch.float32).pow(2).mean(-1, keepdim=True),
               attention=lambda q, k, v: F.scaled_dot_product_attention(
                   q, k, v, dropout_p=0.0, is_causal=True),
               silu=F.silu, next_token_loss=next_token_loss)


def torch_llama(cfg: dict[str, Any]) -> Any:
    """The model as a ``torch.nn.Module`` whose parameter names are the authors'
    (``model.layers.0.self_attn.q_proj.weight``, ...), declared in their order (which
    numbers the layers :func:`xopt.torch.compact_model` converts); ``forward(ids)`` is
    :func:`loss`, calling whatever module sits at each linear layer's name."""
    import torch
    from torch import nn

    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    ops = torch_ops()

    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h))

    def block() -> nn.Module:
        blk = nn.Module()
        blk.self_attn = nn.Module()
        for w in "qkvo":
            setattr(blk.self_attn, f"{w}_proj", nn.Linear(h, h, bias=False))
        blk.mlp = nn.Module()
        blk.mlp.gate_proj = nn.Linear(h, inter, bias=False)
        blk.mlp.down_proj = nn.Linear(inter, h, bias=False)
        blk.mlp.up_proj = nn.Linear(h, inter, bias=False)
        blk.input_layernorm, blk.post_attention_layernorm = Norm(), Norm()
        return blk

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(vocab, h)
            self.model.layers = nn.ModuleList(
                [block() for _ in range(cfg["num_hidden_layers"])])
            self.model.norm = Norm()
            self.lm_head = nn.Linear(h, vocab, bias=False)

        def forward(self, ids: Any) -> Any:
            def linear(x: Any, name: str) -> Any:
                return self.get_submodule(name.rpartition("/")[0].replace("/", "."))(x)

            return loss(cfg, ids, ops=ops, linear=linear,
                        weight=lambda name: self.get_parameter(name.replace("/", ".")))

    return Llama()


# -- JAX -----------------------------------------------------------------------------------------


def jax_ops() -> Ops:
    """The same operations written out in jax.numpy (softmax attention under a causal
    mask, log-softmax cross-entropy)."""
    import jax
    import jax.numpy as jnp

    def attention(q: Any, k: Any, v: Any) -> Any:
        n = q.shape[-2]
        scores = (q @ jnp.swapaxes(k, -1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        scores = jnp.where(jnp.tril(jnp.ones((n, n), bool)), scores, -jnp.inf)
        return jax.nn.softmax(scores, axis=-1) @ v

    def next_token_loss(logits: Any, ids: Any) -> Any:
        logp = jax.nn.log_softmax(logits[:, :-1].reshape(-1, logits.shape[-1]), axis=-1)
        labels = ids[:, 1:].reshape(-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))

    return Ops(xp=jnp, embed=lambda table, ids: table[ids],
               variance=lambda x: jnp.mean(x * x, axis=-1, keepdims=True), attention=attention,
               silu=jax.nn.silu, next_token_loss=next_token_loss)
