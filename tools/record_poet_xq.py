"""Record POET-XQ's 8-bit W0, its merges and its layer from the authors' code (QPOETLinear).

    python tools/record_poet_xq.py /path/to/exported/poet OUT_DIR            # merges
    TRITON_INTERPRET=1 python tools/record_poet_xq.py SRC OUT_DIR forward     # the layer

``/path/to/exported/poet`` holds ``poet_torch/`` of https://github.com/Sphere-AI-Lab/poet at
the commit named below (``git archive 3a34bb6 poet_torch | tar -x``); it is imported
unmodified. Triton is hidden from it, so its Cayley–Neumann series is its PyTorch fallback
(``cayley_formula="taylor"``); QPOETLinear's forward needs Triton and the GPU, so this
records what runs without it: ``from_linear`` (row normalisation and
``quantize_tensor_int8``), ``_dequantize_weight``, ``get_effective_weight`` and
``merge_then_reinitialize`` (dequantise, merge, new ``torch.randperm`` permutations,
re-quantise) for three merges with seeded rotation vectors.

``forward``: the layer's forward and backward (``forward_core_q8``: the Triton Cayley
kernel ``poet::cayley`` and the custom ops ``poet::chain_layer_checkpoint_q8`` /
``_mem_o2_q8``), run by the Triton interpreter on the CPU with two runtime changes, as
for the bundled ``cayley_neumann_triton_*`` cases: each autotuned kernel keeps one
config (the autotuner benchmarks through a GPU driver even under the interpreter), and
``forward_core_q8`` runs eagerly (its ``torch.compile`` wrapper's Inductor fails on
interpreter tensors); the operations are the original's.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np

COMMIT = "3a34bb6acacfb67a034ff4d4ea0fbd2114bc12c0"
CASE = "xq_in64_out48_b16_g256"
FORWARD_CASE = "xq_layer_in64_out48_b16_g256"


def forward(src: str, out_dir: str) -> None:
    import triton

    autotune = triton.autotune

    def one_config(configs, key, **kw):
        pick = [c for c in configs if c.kwargs.get("BLOCK_ROW") == 16
                and c.kwargs.get("BLOCK_K") == 16 and c.num_warps == 2 and c.num_stages == 2]
        return autotune(pick[:1] or configs[:1], key, **kw)

    triton.autotune = one_config
    sys.path.insert(0, src)
    import poet_torch.core.ops as ops
    import poet_torch.layers.qpoet_linear as ql
    import torch

    ql.forward_core_q8 = ops.forward_core_q8._torchdynamo_orig_callable  # eager
    torch.set_num_threads(1)
    arrays = {}
    for mem in (False, True):
        p = "mem" if mem else "fast"
        torch.manual_seed(0)
        lin = torch.nn.Linear(64, 48, bias=False)
        layer = ql.QPOETLinear.from_linear(lin, block_size=16, group_size=256,
                                           mem_efficient_mode=mem)
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            layer.oft_R.copy_(torch.randn(layer.oft_R.shape, generator=gen) * 0.05)
        x = torch.randn(2, 3, 64, generator=gen).requires_grad_(True)
        g = torch.randn(2, 3, 48, generator=gen)
        y = layer(x)
        y.backward(g)
        for name in ("weight", "weight_scales", "weight_zeros", "perm_in", "perm_out",
                     "oft_R"):
            arrays[f"{p}/{name}"] = getattr(layer, name).detach().numpy().copy()
        arrays[f"{p}/x"], arrays[f"{p}/grad_output"] = x.detach().numpy(), g.numpy()
        arrays[f"{p}/y"] = y.detach().numpy()
        arrays[f"{p}/grad_input"] = x.grad.numpy()
        arrays[f"{p}/grad/oft_R"] = layer.oft_R.grad.numpy()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / f"{FORWARD_CASE}.npz", **arrays)
    manifest = {
        "method": "poet",
        "case": FORWARD_CASE,
        "source": {
            "repo": "https://github.com/Sphere-AI-Lab/poet",
            "commit": COMMIT,
            "object": "QPOETLinear.from_linear(nn.Linear(64, 48, bias=False), block_size=16, "
                      "group_size=256, mem_efficient_mode=False|True) forward + backward "
                      "(forward_core_q8: poet::cayley, chain_layer_checkpoint_q8 / "
                      "chain_layer_checkpoint_mem_o2_q8)",
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "numpy": np.__version__, "triton": triton.__version__,
                         "triton_interpret": "1"},
            "device": f"cpu ({platform.machine()}; torch.get_num_threads()=1)",
            "notes": ["Runtime changes: one autotune config per kernel (BLOCK_ROW=BLOCK_COL="
                      "BLOCK_K=16, GROUP_SIZE_M=8, num_warps=2, num_stages=2); "
                      "forward_core_q8 called eagerly. Formula: the Triton kernel's "
                      "'product' Cayley-Neumann series."],
        },
        "arrays": {"<fast|mem>/...": "layer buffers and oft_R (randn * 0.05, generator "
                   "seed 2), x and grad_output (same generator), y, grad_input, grad/oft_R"},
    }
    (out / f"{FORWARD_CASE}.json").write_text(json.dumps(manifest, indent=1) + "\n")


def main(src: str, out_dir: str) -> None:
    sys.modules["triton"] = None  # the authors' code then takes its PyTorch fallbacks
    sys.path.insert(0, src)
    import torch
    from poet_torch.layers.qpoet_linear import QPOETLinear

    torch.set_num_threads(1)
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=False)
    layer = QPOETLinear.from_linear(lin, block_size=16, group_size=256)
    arrays = {"linear_weight": lin.weight.detach().numpy().copy()}

    def snap(prefix: str) -> None:
        arrays[f"{prefix}/weight"] = layer.weight.detach().numpy().copy()
        arrays[f"{prefix}/weight_scales"] = layer.weight_scales.numpy().copy()
        arrays[f"{prefix}/weight_zeros"] = layer.weight_zeros.numpy().copy()
        for name in ("perm_in", "perm_out"):
            arrays[f"{prefix}/{name}"] = getattr(layer, name).numpy().copy()
        with torch.no_grad():
            arrays[f"{prefix}/dequantized"] = layer._dequantize_weight(torch.float32).numpy()

    snap("init")
    gen = torch.Generator().manual_seed(1)
    for k in range(3):
        with torch.no_grad():
            layer.oft_R.copy_(torch.randn(layer.oft_R.shape, generator=gen) * 0.05)
            arrays[f"merge_{k}/oft_R"] = layer.oft_R.numpy().copy()
            arrays[f"merge_{k}/effective_weight"] = layer.get_effective_weight().numpy()
        layer.merge_then_reinitialize()
        snap(f"merge_{k}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / f"{CASE}.npz", **arrays)
    manifest = {
        "method": "poet",
        "case": CASE,
        "source": {
            "repo": "https://github.com/Sphere-AI-Lab/poet",
            "commit": COMMIT,
            "object": "poet_torch.layers.qpoet_linear.QPOETLinear.from_linear(nn.Linear(64, 48, "
                      "bias=False), block_size=16, group_size=256) (normalize_weights=True -> "
                      "poet_torch.core.ops.quantize_tensor_int8); _dequantize_weight; "
                      "get_effective_weight; merge_then_reinitialize x3",
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "numpy": np.__version__, "triton": "hidden (sys.modules['triton'] = "
                         "None): the PyTorch Cayley fallback, 'taylor'"},
            "device": f"cpu ({platform.machine()}; torch.get_num_threads()=1)",
        },
        "arrays": {
            "linear_weight": "the seeded nn.Linear's weight (torch.manual_seed(0))",
            "<p>/weight": "uint8 codes after <p> (init, merge_k)",
            "<p>/weight_scales, <p>/weight_zeros": "float32 (groups, 1)",
            "<p>/perm_in, <p>/perm_out": "int32 permutations in effect after <p>",
            "<p>/dequantized": "_dequantize_weight(float32)",
            "merge_k/oft_R": "rotation vectors set before merge k (randn * 0.05, seed 1)",
            "merge_k/effective_weight": "get_effective_weight() before merge k",
        },
    }
    (out / f"{CASE}.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[3:] == ["forward"]:
        forward(sys.argv[1], sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
