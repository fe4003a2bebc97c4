"""Record POET-XQ's 8-bit W0 and its merges from the authors' code (poet_torch, QPOETLinear).

    python tools/record_poet_xq.py /path/to/exported/poet  OUT_DIR

``/path/to/exported/poet`` holds ``poet_torch/`` of https://github.com/Sphere-AI-Lab/poet at
the commit named below (``git archive 3a34bb6 poet_torch | tar -x``); it is imported
unmodified. Triton is hidden from it, so its Cayley–Neumann series is its PyTorch fallback
(``cayley_formula="taylor"``); QPOETLinear's forward needs Triton and the GPU, so this
records what runs without it: ``from_linear`` (row normalisation and
``quantize_tensor_int8``), ``_dequantize_weight``, ``get_effective_weight`` and
``merge_then_reinitialize`` (dequantise, merge, new ``torch.randperm`` permutations,
re-quantise) for three merges with seeded rotation vectors.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np

COMMIT = "3a34bb6acacfb67a034ff4d4ea0fbd2114bc12c0"
CASE = "xq_in64_out48_b16_g256"


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
    main(sys.argv[1], sys.argv[2])
