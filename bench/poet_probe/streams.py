"""The fast layer's GPU time with its second stream off (STREAMS 0) and on (1, 2), beside
nn.Linear, at the four shapes of bench/poet_layer.py, interleaved over ``--rounds``; and
the mem variant's peak with each (the side stream's record_stream defers frees).

    python3 bench/poet_probe/streams.py [--rounds 3]
"""

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from poet_layer import graph_ms, measure  # noqa: E402

from xopt.torch import poet  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for n_in, n_out, b in ((4096, 4096, 256), (4096, 4096, 512), (4096, 14336, 256),
                           (4096, 14336, 512)):
        torch.manual_seed(0)
        x = torch.randn(1, args.tokens, n_in, device=dev, dtype=dt, requires_grad=True)
        g = torch.randn(1, args.tokens, n_out, device=dev, dtype=dt)
        lin = nn.Linear(n_in, n_out, bias=False, device=dev, dtype=dt)
        fast = poet.POETLinear(n_in, n_out, b, variant="fast", impl="triton", device=dev,
                               dtype=dt)
        mem = poet.POETLinear(n_in, n_out, b, variant="mem", impl="triton", device=dev,
                              dtype=dt)
        for layer in (fast, mem):
            with torch.no_grad():
                layer.oft_R.normal_(0, 1e-3)
        tag = f"{n_in}->{n_out} b{b}"
        for r in range(args.rounds):
            line = [f"linear {graph_ms(lin, x, g, args.iters):.4f}"]
            for s in (0, 1, 2):
                poet.STREAMS = s
                line.append(f"fast/s{s} {graph_ms(fast, x, g, args.iters):.4f}")
            print(f"{tag} round {r}: graph ms " + "  ".join(line), flush=True)
        for s in (0, 1, 2):
            poet.STREAMS = s
            for name, layer in (("fast", fast), ("mem", mem)):
                eager, peak, piped, _ = measure(layer, x, g, 20, 5)
                print(f"{tag} {name}/s{s}: eager {eager:.4f} ms  pipelined {piped:.4f} ms  "
                      f"peak {peak:.1f} MiB", flush=True)
        poet.STREAMS = 1
        del x, g, lin, fast, mem
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
