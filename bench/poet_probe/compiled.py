"""Does xopt's fast layer run under ``torch.compile``, and what does it cost then?

    PYTHONPATH=$PWD/.orig:$PWD python3 bench/poet_probe/compiled.py

H100, bf16, 4096 tokens, 4096², b = 256 and 512: the layer as it is, under
``torch.compile`` (default mode) and under ``torch.compile(mode="reduce-overhead")``
(CUDA graphs), beside nn.Linear and the authors' fast layer (their ``forward_core`` under
``torch.compile(fullgraph=True)``, as shipped): output and gradients against the uncompiled
layer, then bench/poet_layer.py's ``measure`` (eager = one synchronized call, piped =
calls back to back, graph = one CUDA-graph replay), ms.
"""

import sys
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from poet_layer import authors_layer, measure  # noqa: E402

from xopt.torch.poet import POETLinear  # noqa: E402


def fwd_bwd(layer, x, g):
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    y = layer(x)
    y.backward(g)
    return y.detach().clone(), x.grad.clone(), layer.oft_R.grad.clone() \
        if hasattr(layer, "oft_R") and layer.oft_R.grad is not None else None


def main():
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(1, 4096, 4096, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(1, 4096, 4096, device=dev, dtype=dt)
    lin = nn.Linear(4096, 4096, bias=False, device=dev, dtype=dt)
    t, _, pl, gr = measure(lin, x, g, 20, 5)
    print(f"nn.Linear: eager {t:.3f} piped {pl:.3f} graph {gr:.3f}", flush=True)
    for b in (256, 512):
        layer = POETLinear(4096, 4096, b, variant="fast", impl="triton", device=dev, dtype=dt)
        with torch.no_grad():
            layer.oft_R.normal_(0, 1e-3)
        ref = fwd_bwd(layer, x, g)
        rows = {"xopt fast": layer}
        for mode in ("default", "reduce-overhead"):
            try:
                torch._dynamo.reset()
                comp = torch.compile(layer, mode=None if mode == "default" else mode)
                for _ in range(3):
                    got = fwd_bwd(comp, x, g)
                same = all(torch.equal(u, v) for u, v in zip(ref, got, strict=True))
                print(f"b={b} torch.compile({mode}): outputs and gradients equal to "
                      f"uncompiled: {same}", flush=True)
                rows[f"xopt fast, compile {mode}"] = comp
            except Exception:  # noqa: BLE001 - a probe: report and go on
                print(f"b={b} torch.compile({mode}) failed:")
                traceback.print_exc(limit=3)
        try:
            orig = authors_layer(4096, 4096, b, False, dt, dev)
            if orig is not None:
                with torch.no_grad():
                    orig.oft_R.normal_(0, 1e-3)
                rows["authors fast (compiled)"] = orig
        except Exception:  # noqa: BLE001
            traceback.print_exc(limit=2)
        for name, m in rows.items():
            try:
                t, _, pl, gr = measure(m, x, g, 20, 5)
                print(f"b={b} {name:32s} eager {t:.3f} piped {pl:.3f} graph "
                      f"{gr if gr is None else round(gr, 3)}", flush=True)
            except Exception:  # noqa: BLE001
                print(f"b={b} {name}: measure failed:")
                traceback.print_exc(limit=3)


if __name__ == "__main__":
    main()
