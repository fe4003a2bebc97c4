"""CompAct: the spec's projections and schedules, the torch and JAX layers and optimizers.

Expected values come from the paper (Algorithms 1-3, §3.3, §5) and from the authors' golden
traces (their seed schedule, rank rounding and layer conversion), not from xopt itself.
"""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, has_jax, has_torch, needs_jax, needs_torch

from xopt.errors import HyperparameterError, StateError
from xopt.parity import bundled_traces, load_trace
from xopt.specs import compact as spec

TRACES = {p.stem: p for p in bundled_traces("compact")}


def _linear_trace():
    return load_trace(TRACES["linear_in32_out24_r0.25"])


def _llama_trace():
    return load_trace(TRACES["llama2block_h16_r0.25"])


# -- spec ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0.0, -0.25, 1.5, float("nan")])
def test_rank_ratio_outside_unit_interval_is_an_error_naming_the_field(rank):
    with pytest.raises(HyperparameterError, match=r"CompAct\.rank"):
        spec.CompAct(rank=rank)
    with pytest.raises(HyperparameterError, match=r"rank"):
        spec.rank_of(64, rank)


def test_rank_rounding_is_the_authors():
    # The linear trace records the rank the authors' code resolved (round(32 * 0.25)).
    t = _linear_trace()
    hyp = t.hyperparameters
    assert spec.rank_of(32, hyp["Projector"]["rank"]) == hyp["rank_resolved"] == 8
    assert t.array("step_0000/aux/P").shape == (32, 8)
    # LLaMA trace: widths 16 and 32 at ratio 0.25 give the recorded P shapes.
    lt = _llama_trace()
    assert lt.array("step_0000/aux/model/layers/0/mlp/down_proj/weight/P").shape == \
        (32, spec.rank_of(32, 0.25))
    assert lt.array("step_0000/aux/model/layers/0/self_attn/q_proj/weight/P").shape == \
        (16, spec.rank_of(16, 0.25))
    with pytest.raises(HyperparameterError, match="r = round"):
        spec.rank_of(3, 0.1)


def test_seed_schedule_reproduces_the_authors_projector():
    # The Projector's seed at every recorded step (aux/seed), from its initial seed and gap.
    for t in (_linear_trace(), _llama_trace()):
        hyp = t.hyperparameters
        layers = hyp.get("wrapped_layers") or {"": {
            "seed_initial": hyp["Projector.seed_initial"], "gap": hyp["Projector"]["gap"]}}
        for name, lay in layers.items():
            key = f"{name}/seed" if name else "seed"
            for s in range(t.steps):
                aux = t.aux(s)
                if key in aux:
                    assert spec.original_seed(lay["seed_initial"], s, lay["gap"]) == int(aux[key])
    assert spec.original_seed(10, 7, None) == 10  # the authors' default: never bumped


def test_refresh_index_changes_every_gap_updates():
    assert [spec.refresh_index(t, 3) for t in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert [spec.refresh_index(t, 0) for t in range(3)] == [0, 0, 0]


def test_gaussian_projection_has_the_papers_variance():
    # §3.3: P_ij ~ N(0, 1/r), so that P Pᵀ ≈ I (each row has expected squared norm 1).
    n, r = 512, 128
    p = spec.gaussian(spec.projection_seed(spec.layer_seed(0, 0), 0), n, r)
    assert p.shape == (n, r) and p.dtype == np.float32
    assert abs(p.var() * r - 1) < 0.02          # 65536 samples: std of the estimate ~0.006
    assert abs(np.mean(np.sum(p * p, axis=1)) - 1) < 0.02
    q = spec.gaussian(spec.projection_seed(spec.layer_seed(0, 0), 1), n, r)
    assert not np.array_equal(p, q)             # a refresh draws a new matrix
    other = spec.gaussian(spec.projection_seed(spec.layer_seed(0, 1), 0), n, r)
    assert abs(np.corrcoef(p.ravel(), other.ravel())[0, 1]) < 0.02  # layers independent


def test_sparse_jl_rows_have_s_signed_entries_one_per_block():
    # §5 (Dasgupta, Kumar & Sarlós 2010): s non-zeros ±1/√s per row, so every row has
    # unit norm exactly; E[P Pᵀ] = I.
    n, r, s = 300, 40, 4
    p = spec.sparse_jl(123, n, r, s)
    nz = p != 0
    assert (nz.sum(axis=1) == s).all()
    assert np.allclose(np.abs(p[nz]), 1 / np.sqrt(s))
    assert np.allclose(np.sum(p * p, axis=1), 1.0)
    for j in range(s):  # one non-zero in each block of columns
        block = nz[:, (j * r) // s:((j + 1) * r) // s]
        assert (block.sum(axis=1) == 1).all()
    signs = np.sign(p[nz])
    assert 0.4 < (signs > 0).mean() < 0.6
    gram = p.T @ p  # columns nearly orthogonal, norms n·s/r/s... sum of row norms = n
    assert abs(np.trace(gram) - n) < 1e-3


@pytest.mark.skipif(not (has_torch and has_jax), reason="needs torch and jax")
@pytest.mark.parametrize("kind", ["gaussian", "sparse_jl"])
def test_projections_are_bit_identical_in_numpy_torch_and_jax(kind):
    import jax
    import jax.numpy as jnp

    from xopt.jax.compact import draw_projection

    proj = spec.Projection(kind=kind, in_features=48, rank=12, scale=1.0,
                           seed=spec.layer_seed(7, 3), gap=2)
    for refresh in (0, 5):
        ref = spec.projection(proj, refresh)
        t = spec.projection(proj, refresh, backend="torch").numpy()
        j_eager = np.asarray(draw_projection(proj, refresh))
        j_jit = np.asarray(jax.jit(lambda k: draw_projection(proj, k))(jnp.int32(refresh)))
        for other in (t, j_eager, j_jit):
            assert other.tobytes() == ref.tobytes()


def test_import_of_the_spec_stays_framework_free():
    code = ("import sys, xopt.specs.compact as c; c.SPEC; c.rank_of(8, .5);"
            "print([m for m in ('torch', 'jax', 'flax', 'optax') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                         capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


# -- torch -------------------------------------------------------------------------------------


@needs_torch
def test_torch_forward_is_exact_and_weight_gradient_is_the_projected_full_gradient():
    # Algorithms 1-2: y and ∂L/∂x are nn.Linear's; Ĝ = gᵀ(xP) = G P with G the full
    # weight gradient (eq. 8); the bias gradient is unchanged.
    import torch

    from xopt.torch.compact import CompActLinear

    torch.manual_seed(0)
    ref = torch.nn.Linear(20, 12).double()
    layer = CompActLinear.from_linear(ref, rank=0.5, seed=5)
    x = torch.randn(3, 4, 20, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, 12, dtype=torch.float64)
    y = layer(x)
    y.backward(g)
    gx, gb = x.grad.clone(), ref.bias.grad.clone()
    assert ref.weight.grad is None and layer.weight.compact_grad.shape == (12, 10)
    x.grad = None
    ref.bias.grad = None
    y_ref = torch.nn.functional.linear(x, ref.weight, ref.bias)
    y_ref.backward(g)
    torch.testing.assert_close(y, y_ref, rtol=1e-13, atol=0)
    torch.testing.assert_close(gx, x.grad, rtol=1e-13, atol=0)
    torch.testing.assert_close(gb, ref.bias.grad, rtol=1e-13, atol=0)
    p = layer.projection()
    torch.testing.assert_close(layer.weight.compact_grad, ref.weight.grad @ p, rtol=1e-12,
                               atol=1e-12)


@needs_torch
def test_torch_optimizer_reproduces_the_papers_algorithm_3_over_a_refresh():
    # Two independent evaluations: the optimizer vs Algorithm 3 written out here with the
    # same P the layer draws (refresh every gap=2 updates).
    import torch

    from xopt.torch.compact import CompActAdamW, CompActLinear

    torch.manual_seed(1)
    layer = CompActLinear(16, 8, bias=False, rank=0.25, scale=0.5, seed=11, gap=2).double()
    opt = CompActAdamW(layer.parameters(), lr=0.01, b1=0.9, b2=0.999, eps=1e-6,
                       weight_decay=0.1)
    w = layer.weight.detach().clone()
    m = torch.zeros(8, 4, dtype=torch.float64)
    v = torch.zeros_like(m)
    ps = []
    for t in range(5):
        x = torch.randn(6, 16, dtype=torch.float64)
        p = layer.projection()
        ps.append(p)
        layer(x).pow(2).sum().backward()
        g_hat = layer.weight.compact_grad.clone()
        opt.step()
        opt.zero_grad()
        m = 0.9 * m + 0.1 * g_hat
        v = 0.999 * v + 0.001 * g_hat**2
        n = m / (v.sqrt() + 1e-6)
        s = 0.01 * (1 - 0.999 ** (t + 1)) ** 0.5 / (1 - 0.9 ** (t + 1))
        w = w - s * 0.5 * (n @ p.T)
        w = w - 0.01 * 0.1 * w
        torch.testing.assert_close(layer.weight.detach(), w, rtol=1e-12, atol=1e-14)
        assert int(layer.proj_step) == t + 1
    assert torch.equal(ps[0], ps[1]) and not torch.equal(ps[1], ps[2])
    assert torch.equal(ps[2], ps[3]) and not torch.equal(ps[3], ps[4])


@needs_torch
@pytest.mark.parametrize("proj_type", ["gaussian", "sparse_jl"])
def test_the_projection_is_drawn_once_per_refresh_with_the_values_of_a_fresh_draw(proj_type):
    # cache_projection keeps one float32 P per refresh for forwards and updates; the values
    # are those drawn anew at every call (cache_projection=False, the authors' way), in
    # every dtype, and a run with the cache is bitwise a run without it
    import torch

    from xopt.torch.compact import CompActAdamW, CompActLinear

    def run(cache):
        torch.manual_seed(2)
        layer = CompActLinear(16, 8, rank=0.5, seed=4, gap=2, proj_type=proj_type,
                              cache_projection=cache)
        opt = CompActAdamW(layer.parameters(), lr=0.01)
        drawn = []
        for _ in range(5):
            drawn.append(layer.projection())
            layer(torch.randn(6, 16)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        return layer, drawn

    cached, with_cache = run(True)
    fresh, without = run(False)
    assert torch.equal(cached.weight, fresh.weight)
    assert with_cache[0] is with_cache[1] and with_cache[2] is with_cache[3]  # kept
    assert with_cache[1] is not with_cache[2] and not torch.equal(with_cache[1], with_cache[2])
    assert without[0] is not without[1]  # drawn at every call
    for a, b in zip(with_cache, without, strict=True):
        assert torch.equal(a, b)
    for dtype in (torch.bfloat16, torch.float64):
        assert torch.equal(cached.projection(dtype=dtype), fresh.projection(dtype=dtype))


@needs_torch
def test_a_weight_assigned_to_a_layer_after_it_was_made_trains_as_its_own():
    # the backward leaves Ĝ on the layer when the forward's weight is not the one linked
    # to it (FSDP2's unsharded copy; here a weight assigned since); the optimizer finds it
    import torch

    from xopt.torch.compact import CompActAdamW, CompActLinear, compact_grad_of

    torch.manual_seed(3)
    w = torch.randn(8, 16)
    ref = CompActLinear(16, 8, bias=False, rank=0.5, seed=6)
    layer = CompActLinear(16, 8, bias=False, rank=0.5, seed=6)
    with torch.no_grad():
        ref.weight.copy_(w)
    layer.weight = torch.nn.Parameter(w.clone())
    opts = [CompActAdamW(m.parameters(), lr=0.01) for m in (ref, layer)]
    for _ in range(2):
        x = torch.randn(5, 16)
        for m, opt in zip((ref, layer), opts, strict=True):
            m(x).pow(2).sum().backward()
            assert compact_grad_of(m.weight)[0] is not None and m.weight.grad is None
            opt.step()
            opt.zero_grad()
            assert compact_grad_of(m.weight)[0] is None
    assert torch.equal(layer.weight, ref.weight) and not torch.equal(layer.weight, w)


@needs_torch
def test_mismatched_seeds_between_forward_and_optimizer_are_named():
    import torch

    from xopt.torch.compact import CompActAdamW, CompActLinear

    layer = CompActLinear(8, 4, rank=0.5, seed=3)
    layer.compact_name = "blocks.0.q_proj"
    opt = CompActAdamW(layer.parameters())
    layer(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    # The layer's seed changes after the optimizer took its first step with seed 3.
    layer.configure(rank=0.5, proj_type="gaussian", scale=1.0, seed=4, gap=0, jl_nnz=4,
                    generator="xopt")
    layer(torch.randn(2, 8)).sum().backward()
    with pytest.raises(StateError, match=r"'blocks\.0\.q_proj'.*seed 4.*seed 3"):
        opt.step()
    # An optimizer state dict from another model (seed 3) on a fresh layer of seed 9.
    other = CompActLinear(8, 4, rank=0.5, seed=9)
    opt2 = CompActAdamW(other.parameters())
    opt2.load_state_dict(opt.state_dict())
    other(torch.randn(2, 8)).sum().backward()
    with pytest.raises(StateError, match="seed 9.*seed 3"):
        opt2.step()
    # Forward at a projection refresh the optimizer is not at.
    lay = CompActLinear(8, 4, rank=0.5, seed=1, gap=1)
    o = CompActAdamW(lay.parameters())
    lay.set_proj_step(5)
    lay(torch.randn(2, 8)).sum().backward()
    with pytest.raises(StateError, match="refresh 5.*update 0"):
        o.step()


@needs_torch
def test_converter_follows_the_authors_llama_conversion():
    # The LLaMA trace records which layers the authors wrapped, with which projector and
    # scale (o_proj: identity, scale_o_proj * scale).
    import torch

    from xopt.parity.layers.llama import torch_llama
    from xopt.torch.compact import CompActLinear, compact_model

    t = _llama_trace()
    hyp = t.hyperparameters
    rp = hyp["replace_parameters"]
    model = torch_llama(hyp["LlamaConfig"])
    converted = compact_model(model, rank=rp["rank"], scale=rp["scale"],
                              scale_o_proj=rp["scale_o_proj"], gap=rp["update_proj_gap"])
    got = {f"{n.replace('.', '/')}/weight": m for n, m in converted.items()}
    assert set(got) == set(hyp["wrapped_layers"])
    for name, lay in hyp["wrapped_layers"].items():
        m = got[name]
        assert isinstance(m, CompActLinear)
        assert m.proj.scale == pytest.approx(lay["scale"])
        assert m.proj.kind == ("identity" if lay["proj_type"] == "id" else "gaussian")
        assert m.proj.gap == lay["gap"]
    assert len({m.seed for m in converted.values()}) == len(converted)  # one seed per layer
    # Parameters are shared, not copied: the model's parameter list is unchanged.
    assert {n.replace(".", "/") for n, _ in model.named_parameters()} == set(t.params)
    assert isinstance(model.lm_head, torch.nn.Linear)


@needs_torch
def test_converter_rejects_what_is_not_linear_and_names_it():
    import torch
    from torch import nn

    from xopt.torch.compact import CompActLinear, LayerError, compact_model

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Conv1d(4, 4, 1)
            self.up_proj = nn.Linear(4, 8)

    model = nn.Sequential(Block())
    with pytest.raises(LayerError, match=r"'0\.q_proj' is a torch\.nn\.modules\.conv\.Conv1d"):
        compact_model(model)
    with pytest.raises(LayerError, match="'conv'.*not a torch.nn.Linear"):
        CompActLinear.from_linear(nn.Conv2d(1, 1, 1), name="conv")
    with pytest.raises(LayerError, match="no module named '0.nope'"):
        compact_model(nn.Sequential(nn.Linear(2, 2)), layers=("0.nope",))
    with pytest.raises(HyperparameterError, match="rank"):
        compact_model(nn.Sequential(Block()), layers=("up_proj",), rank=2.0)
    assert isinstance(torch.nn.Linear(1, 1), nn.Linear)


@needs_torch
def test_layer_state_dict_restores_the_projection_settings():
    import torch

    from xopt.torch.compact import CompActAdamW, CompActLinear

    # (the optimizer's resume is tests/contract/'s; this is the layer's extra state)
    layer = CompActLinear(12, 10, rank=0.5, seed=2, gap=2)
    opt = CompActAdamW(layer.parameters(), lr=0.01)
    for _ in range(3):
        layer(torch.randn(5, 12)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    saved = io.BytesIO()
    torch.save(layer.state_dict(), saved)
    saved.seek(0)
    other = CompActLinear(12, 10)
    other.configure(rank=0.25, proj_type="sparse_jl", scale=3.0, seed=99, gap=7, jl_nnz=2,
                    generator="xopt")  # overwritten by the state dict
    other.load_state_dict(torch.load(saved, weights_only=True))
    assert other.proj == layer.proj and int(other.proj_step) == 3 and other.refresh() == 1


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_foreach_step_is_bitwise_the_per_tensor_step(dtype):
    # The batched update (the default on GPUs) against the per-tensor reference loop: CompAct
    # layers (projected and identity), plain weights, a bias, weight decay, a refresh.
    import torch

    from xopt.torch.compact import CompActAdamW, compact_model

    dt = getattr(torch, dtype)

    def make(foreach):
        torch.manual_seed(0)
        net = torch.nn.ModuleDict({
            "q_proj": torch.nn.Linear(12, 10, bias=False), "o_proj": torch.nn.Linear(10, 10),
            "down_proj": torch.nn.Linear(10, 6, bias=False), "head": torch.nn.Linear(6, 3)})
        compact_model(net, rank=0.5, scale=0.5, scale_o_proj=0.5, gap=2, seed=5,
                      layers=("q_proj", "o_proj", "down_proj"), generator="torch")
        net = net.to(dt)
        return net, CompActAdamW(net.parameters(), lr=0.01, weight_decay=0.1, foreach=foreach)

    runs = []
    for foreach in (False, True):
        net, opt = make(foreach)
        for i in range(5):
            x = torch.randn(2, 4, 12, generator=torch.Generator().manual_seed(i)).to(dt)
            h = net["q_proj"](x).tanh()
            y = net["head"](net["down_proj"](net["o_proj"](h)).tanh())
            y.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append((net, opt))
    (a, oa), (b, ob) = runs
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), na
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(oa.state[pa][k], ob.state[pb][k]), (na, k)
    assert int(b["q_proj"].proj_step) == 5


@needs_torch
def test_moment_dtype_keeps_bfloat16_moments_when_asked():
    import torch

    from xopt.torch.compact import CompActAdamW, CompActLinear

    def make(**kw):
        torch.manual_seed(0)
        layer = CompActLinear(16, 8, rank=0.5, dtype=torch.bfloat16, generator="torch")
        return layer, CompActAdamW(layer.parameters(), lr=0.1, **kw)

    layer, opt = make(moment_dtype=torch.bfloat16)
    layer(torch.randn(4, 16, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    opt.step()
    assert opt.state[layer.weight]["exp_avg"].dtype == torch.bfloat16
    assert opt.state[layer.bias]["exp_avg_sq"].dtype == torch.bfloat16
    with pytest.raises(HyperparameterError, match="moment_dtype"):
        make(moment_dtype="bf16")


# -- jax ---------------------------------------------------------------------------------------


@needs_jax
def test_jax_layer_is_exact_forward_and_carries_the_projected_gradient():
    import jax
    import jax.numpy as jnp

    from xopt.jax.compact import CompActDense, draw_projection

    m = CompActDense(6, rank=0.5, seed=4)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 10))
    variables = m.init(jax.random.PRNGKey(1), x)
    params = variables["params"]
    assert set(params) == {"weight", "bias", "compact_grad"}  # torch's names + the carrier
    assert params["weight"].shape == (6, 10) and params["compact_grad"].shape == (6, 5)
    g = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 6))

    def f(p):
        return jnp.sum(m.apply({"params": p, "compact": variables["compact"]}, x) * g)

    def f_ref(p):
        return jnp.sum((x @ p["weight"].T + p["bias"]) * g)

    grads = jax.grad(f)(params)
    y = m.apply(variables, x)
    p = draw_projection(m.projection_of(10), 0)
    with jax.default_matmul_precision("highest"):  # the layer's precision (not TF32 on GPUs)
        ref = jax.grad(f_ref)(params)
        np.testing.assert_allclose(y, x @ params["weight"].T + params["bias"], rtol=1e-6)
        want = ref["weight"] @ p
    np.testing.assert_allclose(grads["bias"], ref["bias"], rtol=1e-6)
    np.testing.assert_allclose(grads["compact_grad"], want, rtol=2e-5, atol=1e-5)
    assert not np.any(np.asarray(grads["weight"]))


@needs_jax
def test_jax_optimizer_rejects_a_model_with_other_seeds():
    import jax
    import jax.numpy as jnp

    from xopt.jax.compact import CompActDense, compact_adamw

    x = jnp.ones((2, 8))
    v1 = CompActDense(4, seed=1).init(jax.random.PRNGKey(0), x)
    v2 = CompActDense(4, seed=2).init(jax.random.PRNGKey(0), x)
    tx = compact_adamw(compact=v1["compact"], params=v1["params"])
    state = tx.init(v1["params"])
    grads = jax.tree.map(jnp.ones_like, v1["params"])
    tx.update(grads, state, v1["params"], compact=v1["compact"])
    with pytest.raises(StateError, match="seed is 2.*built with seed 1"):
        tx.update(grads, state, v1["params"], compact=v2["compact"])
    with pytest.raises(HyperparameterError, match="rank"):
        CompActDense(4, rank=0.0).init(jax.random.PRNGKey(0), x)
