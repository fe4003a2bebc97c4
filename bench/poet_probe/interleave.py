"""Why the fast layer's graph time depends on what ran before it (4096², b = 512, H200).

    PYTHONPATH=$PWD python3 bench/poet_probe/interleave.py [--rounds 8] [--b 512]

bench/poet_layer.py's table times each layer's CUDA graph once, right after that layer's
eager calls; its ``--rounds`` section replays all the layers' graphs in interleaved rounds.
The two disagreed on the H200 (xopt fast, 4096², b = 512: 0.693 ms in the table, a median
of 0.751 ms interleaved). This probe times the same two graphs (nn.Linear and xopt fast)
under five schedules, 20 replays per round, and samples the SM clock and power (NVML)
after each round:

* ``alone``: xopt's graph only, rounds back to back;
* ``alone+idle``: the same with 50 ms of idle GPU before each round;
* ``after-linear``: each xopt round right after an nn.Linear round (the interleaved order);
* ``after-linear+idle``: the same with 50 ms idle between them;
* ``linear``: nn.Linear's graph alone, rounds back to back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from poet_layer import capture, replay_ms  # noqa: E402

from xopt.torch.poet import POETLinear  # noqa: E402


def nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())

        def sample():
            clk = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
            watts = pynvml.nvmlDeviceGetPowerUsage(h) / 1e3
            return clk, watts

        return sample
    except Exception as e:  # no NVML: timings only
        print(f"note: no NVML samples ({e!r})")
        return lambda: (float("nan"), float("nan"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--b", type=int, default=512)
    ap.add_argument("--width", type=int, default=4096)
    args = ap.parse_args()
    dev, dt, n = torch.device("cuda"), torch.bfloat16, args.width
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    x = torch.randn(1, 4096, n, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(1, 4096, n, device=dev, dtype=dt)
    lin = nn.Linear(n, n, bias=False, device=dev, dtype=dt)
    poet = POETLinear(n, n, args.b, variant="fast", impl="triton", device=dev, dtype=dt)
    with torch.no_grad():
        poet.oft_R.normal_(0, 1e-3)
    glin, _ = capture(lin, x, g)
    gpoet, _ = capture(poet, x, g)
    sample = nvml()

    def idle():
        torch.cuda.synchronize()
        time.sleep(0.05)

    def run(name, steps):
        times = {"lin": [], "xopt": []}
        clocks = []
        for _ in range(args.rounds):
            for what, pre in steps:
                if pre:
                    idle()
                times[what].append(replay_ms(glin if what == "lin" else gpoet, args.iters))
                clocks.append(sample())
        text = f"{name:18s}"
        for what, ts in times.items():
            if ts:
                text += (f" | {what} median {statistics.median(ts) * 1e3:7.1f} us "
                         f"[{min(ts) * 1e3:6.1f}, {max(ts) * 1e3:6.1f}]")
        mhz = [c for c, _ in clocks]
        watts = [w for _, w in clocks]
        text += (f" | SM MHz {min(mhz):.0f}-{max(mhz):.0f}, W {min(watts):.0f}-"
                 f"{max(watts):.0f}")
        print(text, flush=True)

    for _ in range(2):  # two passes, to see the drift over the run
        run("alone", [("xopt", False)])
        run("alone+idle", [("xopt", True)])
        run("after-linear", [("lin", False), ("xopt", False)])
        run("after-linear+idle", [("lin", True), ("xopt", True)])
        run("linear", [("lin", False)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
