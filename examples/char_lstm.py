"""A character-level LSTM language model, trained end to end with numbarnn.

    python examples/char_lstm.py                       # 300 steps on examples/data/alice_ch1.txt
    python examples/char_lstm.py --steps 1000 --units 256
    python examples/char_lstm.py --quick               # a few dozen small steps (CI; also NUMBARNN_QUICK=1)
    python examples/char_lstm.py --backend cuda        # the numba.cuda kernels (a GPU, or the slow simulator:
                                                       # there use --quick, which picks H=4, T=4, B=2, 3 steps)

The model reads one character at a time and predicts the next:

    x_t = one_hot(char_t)                    [T, B, V]       V = vocabulary size
    y, _ = CudnnLSTM(x)                      [T, B, H]       numbarnn.layers.CudnnLSTM (the cuDNN op)
    logits = y @ W_out + b_out               [T, B, V]       a NumPy softmax output layer
    loss = mean cross-entropy(softmax(logits), char_{t+1})

Backward: the softmax layer by hand, then `lstm.backward(dy)`, which runs ops.cudnn_rnn_backprop_v3
and leaves the gradient of the LSTM's opaque params buffer in `lstm.params_grad`.  A plain NumPy
Adam updates both the output layer and the buffer `lstm.weights[0]` in place.  Each step trains on
B random windows of T+1 characters (zero initial state).  The loss on a fixed evaluation batch is
printed before and after training (`first loss A -> final loss B`), then a sample is drawn from the
model, one character per call, carrying (h, c) from call to call.  `--seed` fixes everything:
weights, batches and the sample.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from numbarnn.device import use_simulator_unless_gpu  # imports no numba

# numba reads NUMBA_ENABLE_CUDASIM once, at import: without a GPU, choose the simulator before importing it.
use_simulator_unless_gpu()

import numpy as np  # noqa: E402

from numbarnn.layers import CudnnLSTM  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "alice_ch1.txt"
#: --quick sizes, and those of --quick with the cuda backend in the simulator (the size that is practical there)
QUICK = dict(steps=40, units=48, seq_len=24, batch=16, sample_chars=80)
SIMULATOR_QUICK = dict(steps=3, units=4, seq_len=4, batch=2, sample_chars=5)



# ---------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------

class Corpus:
    """The text as integer ids, and the windows we train on."""

    def __init__(self, path: Path):
        text = path.read_text(encoding="utf-8")
        self.text = text.split("\n\n", 1)[1] if "\n\n" in text else text     # skip the header paragraph
        self.chars = sorted(set(self.text))                                  # the vocabulary, V characters
        self.index = {ch: k for k, ch in enumerate(self.chars)}
        self.ids = np.array([self.index[ch] for ch in self.text], dtype=np.int64)   # [N]

    @property
    def V(self) -> int:
        return len(self.chars)

    def windows(self, rng, T: int, B: int):
        """B random windows -> (inputs [T, B] ids, targets [T, B] ids = inputs shifted by one)."""
        starts = rng.integers(0, len(self.ids) - T - 1, size=B)
        block = np.stack([self.ids[s:s + T + 1] for s in starts], axis=1)   # [T+1, B]
        return block[:-1], block[1:]

    def one_hot(self, ids, dtype):
        """ids [T, B] -> [T, B, V]."""
        return np.eye(self.V, dtype=dtype)[ids]


# ---------------------------------------------------------------------------------------------------
# output layer and optimiser (NumPy)
# ---------------------------------------------------------------------------------------------------

def softmax_cross_entropy(logits, targets):
    """logits [T, B, V], targets [T, B] -> (mean loss, dloss/dlogits [T, B, V]); stable (max subtracted)."""
    z = logits - logits.max(axis=-1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))                    # [T, B, V]
    n = targets.size
    picked = np.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]     # [T, B]
    dlogits = np.exp(log_p)
    np.put_along_axis(dlogits, targets[..., None], np.take_along_axis(dlogits, targets[..., None], -1) - 1.0, -1)
    return float(-picked.mean()), (dlogits / n).astype(logits.dtype)


class Adam:
    """Adam (Kingma & Ba) on a list of NumPy arrays, updated in place."""

    def __init__(self, params, lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8):
        self.params, self.lr, self.b1, self.b2, self.eps = params, lr, beta1, beta2, eps
        self.m = [np.zeros_like(p, dtype=np.float64) for p in params]
        self.v = [np.zeros_like(p, dtype=np.float64) for p in params]
        self.t = 0

    def step(self, grads):
        self.t += 1
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            g = np.asarray(g, dtype=np.float64)
            m *= self.b1
            m += (1 - self.b1) * g
            v *= self.b2
            v += (1 - self.b2) * g * g
            m_hat = m / (1 - self.b1 ** self.t)
            v_hat = v / (1 - self.b2 ** self.t)
            p -= (self.lr * m_hat / (np.sqrt(v_hat) + self.eps)).astype(p.dtype)


def clip_global_norm(grads, max_norm):
    """Scale all gradients together so that their joint norm is at most max_norm (exploding-gradient guard)."""
    norm = np.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads))
    scale = min(1.0, max_norm / (norm + 1e-12))
    return [g * scale for g in grads], norm


# ---------------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------------

class CharLSTM:
    def __init__(self, V: int, H: int, seed: int, backend: str, dtype=np.float32):
        rng = np.random.default_rng(seed)
        self.dtype = np.dtype(dtype)
        self.lstm = CudnnLSTM(num_layers=1, num_units=H, dtype=str(self.dtype), seed=seed, backend=backend)
        self.lstm.build((None, None, V))                                          # creates lstm.weights[0]
        limit = np.sqrt(6.0 / (H + V))
        self.W_out = rng.uniform(-limit, limit, (H, V)).astype(dtype)              # [H, V]
        self.b_out = np.zeros(V, dtype)                                            # [V]

    @property
    def parameters(self):
        return [self.lstm.weights[0], self.W_out, self.b_out]

    def logits(self, x, state=None, training=True):
        """x [T, B, V] -> logits [T, B, V], y [T, B, H], (h, c)."""
        y, state = self.lstm(x, initial_state=state, training=training)
        return y @ self.W_out + self.b_out, y, state

    def loss_and_grads(self, x, targets):
        logits, y, _ = self.logits(x)
        loss, dlogits = softmax_cross_entropy(logits, targets)
        H = y.shape[-1]
        dW_out = y.reshape(-1, H).T @ dlogits.reshape(-1, dlogits.shape[-1])      # [H, V]
        db_out = dlogits.sum(axis=(0, 1))                                          # [V]
        dy = (dlogits @ self.W_out.T).astype(self.dtype)                           # [T, B, H]
        self.lstm.backward(dy)                                                     # -> lstm.params_grad
        return loss, [self.lstm.params_grad, dW_out, db_out]

    def loss(self, x, targets) -> float:
        return softmax_cross_entropy(self.logits(x, training=False)[0], targets)[0]

    def sample(self, corpus: Corpus, prompt: str, n: int, rng, temperature: float) -> str:
        """Feed the prompt, then draw n characters, one call per character, carrying (h, c)."""
        state, out = None, []
        logits = None
        for ch in prompt:
            x = corpus.one_hot(np.array([[corpus.index[ch]]]), self.dtype)          # [1, 1, V]
            logits, _, state = self.logits(x, state, training=False)
        for _ in range(n):
            z = logits[0, 0].astype(np.float64) / temperature
            p = np.exp(z - z.max())
            k = int(rng.choice(len(p), p=p / p.sum()))
            out.append(corpus.chars[k])
            logits, _, state = self.logits(corpus.one_hot(np.array([[k]]), self.dtype), state, training=False)
        return prompt + "".join(out)


# ---------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 300, --quick 40)")
    parser.add_argument("--quick", action="store_true", help="small model, few steps (CI)")
    parser.add_argument("--seed", type=int, default=0, help="seeds weights, batches and the sample")
    parser.add_argument("--backend", default=None, choices=["reference", "cpu", "cuda"],
                        help="numbarnn backend of the LSTM (default: numbarnn's default: NUMBARNN_BACKEND, else "
                             "cuda with a GPU, else cpu)")
    parser.add_argument("--units", type=int, default=None, help="LSTM units H (default 128, --quick 48)")
    parser.add_argument("--seq-len", type=int, default=None, help="characters per window T (default 48, --quick 24)")
    parser.add_argument("--batch", type=int, default=None, help="windows per step B (default 32, --quick 16)")
    parser.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate")
    parser.add_argument("--sample-chars", type=int, default=None, help="characters to sample (default 300, quick 80)")
    parser.add_argument("--data", type=Path, default=DATA, help="a UTF-8 text file")
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("NUMBARNN_QUICK") == "1"
    from numba import config as numba_config
    simulator = args.backend == "cuda" and bool(numba_config.ENABLE_CUDASIM)
    # the simulator runs one Python thread per CUDA thread: ~4 s per step at H=4, T=4, B=2 on 2 cores (~7.5 s at
    # H=8) and far longer at the default sizes, so --quick there picks SIMULATOR_QUICK
    small = SIMULATOR_QUICK if simulator else QUICK
    pick = lambda given, key, full: given if given is not None else (small[key] if quick else full)   # noqa: E731
    steps, H = pick(args.steps, "steps", 300), pick(args.units, "units", 128)
    T, B = pick(args.seq_len, "seq_len", 48), pick(args.batch, "batch", 32)
    n_sample = pick(args.sample_chars, "sample_chars", 300)
    if simulator:
        s = SIMULATOR_QUICK
        print(f"note: no GPU, so the cuda backend runs in numba's CUDA simulator, which is very slow (about 4 s per "
              f"training step at H={s['units']}, T={s['seq_len']}, B={s['batch']}, far more at the default "
              f"sizes); practical there: --quick (H={s['units']}, T={s['seq_len']}, B={s['batch']}, "
              f"{s['steps']} steps). Every step is reported.", flush=True)
    if steps < 1:
        parser.error(f"--steps: expected at least 1, got {steps}")

    corpus = Corpus(args.data)
    rng = np.random.default_rng(args.seed)
    model = CharLSTM(corpus.V, H, args.seed, args.backend)
    optimiser = Adam(model.parameters, lr=args.lr)
    eval_x, eval_y = corpus.windows(np.random.default_rng(args.seed + 1), T, B)     # fixed evaluation batch
    eval_x = corpus.one_hot(eval_x, model.dtype)
    where = args.backend or __import__("numbarnn").get_default_backend()
    if args.backend == "cuda":
        where += " (numba CUDA simulator: slow, for checking only)" if simulator else " (GPU)"
    print(f"corpus: {args.data.name}, {len(corpus.ids)} characters, vocabulary V={corpus.V}")
    print(f"model: one-hot [T, B, V] -> CudnnLSTM(H={H}) -> softmax [V]; {model.lstm.count_params()} LSTM params "
          f"+ {model.W_out.size + model.b_out.size} output params; backend={where}; float32")
    print(f"training: {steps} steps of B={B} windows x T={T} characters, Adam lr={args.lr}, seed={args.seed}")
    first = model.loss(eval_x, eval_y)
    print(f"eval loss before training {first:.4f} (uniform guess: ln V = {np.log(corpus.V):.4f})", flush=True)
    log_every = 1 if simulator else max(1, steps // 10)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        ids, targets = corpus.windows(rng, T, B)
        loss, grads = model.loss_and_grads(corpus.one_hot(ids, model.dtype), targets)
        grads, _ = clip_global_norm(grads, 5.0)
        optimiser.step(grads)
        if step % log_every == 0 or step == 1 or step == steps:
            took = f"  ({time.perf_counter() - t0:.1f} s)" if simulator else ""
            print(f"step {step:5d}  train loss {loss:.4f}{took}", flush=True)

    elapsed = time.perf_counter() - t0
    final = model.loss(eval_x, eval_y)
    print(f"trained {steps} steps in {elapsed:.1f} s ({1e3 * elapsed / steps:.1f} ms/step)")
    print(f"first loss {first:.4f} -> final loss {final:.4f}  (eval batch)")
    text = model.sample(corpus, "Alice ", n_sample, np.random.default_rng(args.seed + 2), temperature=0.8)
    print("sample (temperature 0.8):")
    print("    " + text.replace("\n", "\n    "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
