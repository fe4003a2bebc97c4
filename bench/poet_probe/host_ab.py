"""Host µs per forward+backward of the fast layer (bf16, 4096², b = 256, 256 tokens: the GPU
waits on the host) for two checkouts of xopt, in alternating child processes, so that a
drift of the host's speed hits both alike.

    PYTHONPATH=$PWD python3 bench/poet_probe/host_ab.py OLD_ROOT [NEW_ROOT] [--rounds 4]

Each child builds the layer, warms up, and prints the median over 7 batches of 100 calls
(perf_counter per batch); nn.Linear's figure is printed beside each.
"""

import argparse
import os
import statistics
import subprocess
import sys

CHILD = r'''
import statistics, time, torch
from torch import nn
from xopt.torch.poet import POETLinear
dev, dt = torch.device("cuda"), torch.bfloat16
x = torch.randn(1, 256, 4096, device=dev, dtype=dt, requires_grad=True)
g = torch.randn(1, 256, 4096, device=dev, dtype=dt)
out = {}
for name, layer in (("linear", nn.Linear(4096, 4096, bias=False, device=dev, dtype=dt)),
                    ("poet", POETLinear(4096, 4096, 256, variant="fast", impl="triton",
                                        device=dev, dtype=dt))):
    def call():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        layer(x).backward(g)
    for _ in range(30):
        call()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(100):
            call()
        ts.append((time.perf_counter() - t0) / 100 * 1e6)
        torch.cuda.synchronize()
    out[name] = statistics.median(ts)
print(out["poet"], out["linear"])
'''


def child(root: str) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
    res = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, check=True)
    poet, lin = map(float, res.stdout.split()[-2:])
    return poet, lin


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default=".")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    res = {"old": [], "new": []}
    for r in range(args.rounds):
        for label, root in (("old", args.old), ("new", args.new)):
            poet, lin = child(root)
            res[label].append(poet)
            print(f"round {r} {label}: poet fast fwd+bwd {poet:8.1f} us (nn.Linear {lin:6.1f})",
                  flush=True)
    for label, v in res.items():
        print(f"{label}: median {statistics.median(v):.1f} us over {len(v)} rounds")


if __name__ == "__main__":
    main()
