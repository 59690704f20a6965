"""The small training loop of examples/ddp_train.py, numbarnn.torch.LSTM against torch.nn.LSTM in one process.

A 2-layer bidirectional LSTM (I=2, H=32, T=20, B=32: packed, ragged input), a linear head on the last layer's two
final states, Adam.  Both models start from the same weights; their first steps' losses must agree (validated
before timing), then their steps alternate in rounds of 10: median (and best) ms per step.  Run it as it is and
with OMP_NUM_THREADS=1 to see what the thread setting costs each (results: bench/results/cpu.md).

    python bench/bench_small_train.py [--rounds 5] [--hidden 32]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import numbarnn.torch as nt


def make(cls, I: int, H: int, L: int, state=None):
    """(rnn, head, optimizer); `state`: the (rnn, head) state_dicts to start from."""
    rnn = cls(I, H, num_layers=L, bidirectional=True, batch_first=True)
    head = torch.nn.Linear(2 * H, 1)
    if state is not None:
        rnn.load_state_dict(state[0])
        head.load_state_dict(state[1])
    return rnn, head, torch.optim.Adam(list(rnn.parameters()) + list(head.parameters()), 1e-2)


def step(model, x, lengths, y) -> float:
    rnn, head, opt = model
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    _, (h, _) = rnn(packed)                                  # h [L*2, B, H]
    loss = ((head(torch.cat([h[-2], h[-1]], 1)).squeeze(1) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps of each model per round")
    p.add_argument("--hidden", type=int, default=32)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    I, H, L, T, B = 2, args.hidden, 2, 20, 32
    x, lengths, y = torch.randn(B, T, I), torch.randint(4, T + 1, (B,)), torch.randn(B)   # [B, T, I], [B], [B]
    ours = make(nt.LSTM, I, H, L)
    models = {"numbarnn.torch": ours,
              "torch.nn": make(torch.nn.LSTM, I, H, L, (ours[0].state_dict(), ours[1].state_dict()))}
    losses = {name: [step(m, x, lengths, y) for _ in range(3)] for name, m in models.items()}   # also warms up
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(*losses.values()))
    if diff > 1e-4:
        print(f"the two models' losses differ ({losses}): not timed")
        return 1
    times: dict = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, m in models.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step(m, x, lengths, y)
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    print(f"I={I} H={H} L={L} bidirectional T={T} B={B}, torch threads {torch.get_num_threads()}, losses agree "
          f"to {diff:.1e}; ms per step, median (best) of {args.rounds} rounds of {args.steps}:")
    for name, t in times.items():
        print(f"  {name:15s} {np.median(t):8.2f} ({min(t):.2f})")
    ratio = np.median(times["numbarnn.torch"]) / np.median(times["torch.nn"])
    print(f"  numbarnn.torch / torch.nn: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
