"""Peak memory of training: numbarnn.torch's LSTM against torch.nn's, each in its own process.

    python bench/bench_memory.py                  # 2-layer LSTM T=400 B=32 I=H=512, two forward+backward calls
    python bench/bench_memory.py --T 100 --H 256

Each implementation runs in a fresh process (peak RSS is per process): the model is built and warmed up at a tiny
size (compiled code and libraries loaded), then the peak resident set is read before and after two
forward+backward calls at the size asked (ru_maxrss); reported is the growth, in MB.  Both sides keep what they
keep across calls (numbarnn's workspace, torch's allocator caches) inside the figure.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import gc, resource, sys
sys.path.insert(0, {root!r})
import torch
import numbarnn.torch as nt
nn = nt if {which!r} == "numbarnn.torch" else torch.nn
T, B, I, H, L = {T}, {B}, {I}, {H}, {L}
torch.manual_seed(0)
m = nn.LSTM(I, H, num_layers=L)
y, _ = m(torch.randn(2, 1, I)); y.sum().backward()
gc.collect()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
x = torch.randn(T, B, I)
for _ in range(2):
    xg = x.clone().requires_grad_()
    y, _ = m(xg)
    y.sum().backward()
    del y, xg
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""


def peak_growth_mb(which: str, T: int, B: int, I: int, H: int, L: int) -> float:
    code = CHILD.format(root=os.path.dirname(HERE), which=which, T=T, B=B, I=I, H=H, L=L)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=400)
    ap.add_argument("--B", type=int, default=32)
    ap.add_argument("--I", type=int, default=512)
    ap.add_argument("--H", type=int, default=512)
    ap.add_argument("--L", type=int, default=2)
    args = ap.parse_args(argv)
    shape = (args.T, args.B, args.I, args.H, args.L)
    mb = {which: peak_growth_mb(which, *shape) for which in ("numbarnn.torch", "torch.nn")}
    print(f"LSTM {args.L}-layer T={args.T} B={args.B} I={args.I} H={args.H} float32, two forward+backward calls: "
          f"peak RSS growth, MB")
    for which, v in mb.items():
        print(f"| {which} | {v:.0f} |")
    ratio = f"{mb['numbarnn.torch'] / mb['torch.nn']:.2f}x" if mb["torch.nn"] > 0 else "n/a (torch.nn grew 0 MB)"
    print(f"numbarnn.torch / torch.nn: {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
