"""A training loop with numbarnn.torch's LSTM beside the same loop with torch.nn's, in one process.

    python bench/bench_train_loop.py                    # embedding -> 2-layer LSTM -> linear, Adam, 2 x 30 steps
    python bench/bench_train_loop.py --threads 1        # torch.set_num_threads(1) first (the budget numbarnn follows)
    NUMBA_THREADING_LAYER=workqueue python bench/bench_train_loop.py    # numba's other threading layers

What users meet: a model whose recurrent layer is the drop-in, trained with autograd and an optimizer, default
thread settings (or the count given), nothing else tuned.  The two models start from the same weights and see
the same batches; their steps alternate (numbarnn, torch, numbarnn, ...) so that both run on the same machine
state, after --warmup steps each.  Validated first: the two losses must agree (float32, 1e-4 relative) at every
step, or the bench stops.  Reported: median and best ms per training step of each, their ratio, the losses'
largest relative difference, the thread counts in use (torch's, numba's, BLAS's) and numba's threading layer.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))   # this checkout's numbarnn


def build(nn, T, B, I, H, vocab, seed):
    import torch

    torch.manual_seed(seed)
    emb, rnn, head = torch.nn.Embedding(vocab, I), nn.LSTM(I, H, num_layers=2), torch.nn.Linear(H, vocab)
    return torch.nn.ModuleList([emb, rnn, head])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--B", type=int, default=32)
    ap.add_argument("--I", type=int, default=128)
    ap.add_argument("--H", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per model")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before anything runs")
    args = ap.parse_args(argv)

    import numba
    import torch

    import numbarnn.torch as nt
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    vocab = 96
    models = {"numbarnn.torch": build(nt, args.T, args.B, args.I, args.H, vocab, 0),
              "torch.nn": build(torch.nn, args.T, args.B, args.I, args.H, vocab, 0)}
    models["numbarnn.torch"].load_state_dict(models["torch.nn"].state_dict())
    optims = {k: torch.optim.Adam(m.parameters(), lr=1e-3) for k, m in models.items()}
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (args.T + 1, args.B), generator=gen) for _ in range(8)]

    def step(name, k):
        emb, rnn, head = models[name]
        seq = batches[k % len(batches)]
        y, _ = rnn(emb(seq[:-1]))
        loss = torch.nn.functional.cross_entropy(head(y).reshape(-1, vocab), seq[1:].reshape(-1))
        optims[name].zero_grad(set_to_none=True)
        loss.backward()
        optims[name].step()
        return loss.item()

    times = {k: [] for k in models}
    worst = 0.0
    for k in range(args.warmup + args.steps):
        losses = {}
        for name in models:
            t0 = time.perf_counter()
            losses[name] = step(name, k)
            if k >= args.warmup:
                times[name].append(time.perf_counter() - t0)
        rel = abs(losses["numbarnn.torch"] - losses["torch.nn"]) / abs(losses["torch.nn"])
        worst = max(worst, rel)
        if rel > 1e-4:
            print(f"step {k}: losses differ ({losses}): not timed", file=sys.stderr)
            return 1
    try:
        from threadpoolctl import threadpool_info
        blas = ",".join(f"{i['internal_api']}:{i['num_threads']}" for i in threadpool_info() if i["user_api"] == "blas")
    except ImportError:
        blas = "?"
    try:
        layer = numba.threading_layer()
    except ValueError:                       # no parallel region ran (every call below the parallel threshold)
        layer = "none started"
    print(f"LSTM 2-layer T={args.T} B={args.B} I={args.I} H={args.H}, Adam, {args.steps} alternating steps each; "
          f"torch threads {torch.get_num_threads()}, numba threads {numba.get_num_threads()} "
          f"({layer} layer), BLAS {blas}; losses agree to {worst:.1e}")
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    for name, v in times.items():
        print(f"| {name} | {med[name]:.1f} ms median | {1e3 * min(v):.1f} ms best |")
    print(f"numbarnn.torch / torch.nn: {med['numbarnn.torch'] / med['torch.nn']:.2f}x (median per step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
