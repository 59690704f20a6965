"""numbarnn.torch against torch.nn (cuDNN) on CUDA tensors, as a training script meets them.

    python bench/gpu_torch.py [SHAPES...]       # HxBxT, default 64x1x200 256x4x1000 512x32x100
    python bench/gpu_torch.py profile HxBxT     # where a warm numbarnn.torch forward's host time goes

For each shape: both modules with the same weights, outputs and gradients compared first, then forward and
forward+backward alternating between the two in one process (median of warm rounds, synchronised). cuDNN's
TF32 is off (as in `numbarnn bench`): both compute in float32. Runs on the CPU too (device cpu), which is how it
is tested without a GPU.
"""
import cProfile
import pstats
import sys
import time

import torch

import numbarnn.torch as nt

TOLERANCE = 1e-4    # float32 outputs and gradients, relative to their largest element (TF32 off)


def _pair(H: int, device: str):
    torch.manual_seed(0)
    ref = torch.nn.LSTM(H, H).to(device)
    ours = nt.LSTM(H, H).to(device)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def compare(H: int, B: int, T: int, device: str, rounds: int = 15) -> dict:
    ref, ours = _pair(H, device)
    x = torch.randn(T, B, H, device=device, requires_grad=True)
    results = {}
    ys = []
    for m in (ref, ours):                        # validate first
        x.grad = None
        m.zero_grad()
        y, (h, c) = m(x)
        (y.square().sum() + h.sum()).backward()
        ys.append((y.detach(), x.grad.clone(), m.weight_hh_l0.grad.clone()))
    err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(ys[1], ys[0]))
    results["err"] = err
    if not err <= TOLERANCE:                     # not timed: a wrong result has no speed
        print(f"{H}x{B}x{T} {device}: max rel err {err:.1e} > {TOLERANCE:.0e}: FAILED, not timed", flush=True)
        return results

    def fwd(m):
        with torch.no_grad():
            m(x)

    def fwd_bwd(m):
        y, (h, c) = m(x)
        (y.square().sum() + h.sum()).backward()

    for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        for m in (ref, ours):
            fn(m)
            fn(m)
        times = {0: [], 1: []}
        for _ in range(rounds):
            for i, m in enumerate((ref, ours)):
                times[i].append(_time(lambda: fn(m), device))
        med = [sorted(times[i])[rounds // 2] * 1e3 for i in (0, 1)]
        results[name] = med
    print(f"{H}x{B}x{T} {device}: max rel err {err:.1e}; forward torch.nn {results['fwd'][0]:.3f} ms, numbarnn.torch "
          f"{results['fwd'][1]:.3f} ms ({results['fwd'][1] / results['fwd'][0]:.2f}x); forward+backward "
          f"{results['fwd+bwd'][0]:.3f} vs {results['fwd+bwd'][1]:.3f} ms "
          f"({results['fwd+bwd'][1] / results['fwd+bwd'][0]:.2f}x)", flush=True)
    return results


def profile(H: int, B: int, T: int, device: str, n: int = 30) -> None:
    _, ours = _pair(H, device)
    x = torch.randn(T, B, H, device=device)
    with torch.no_grad():
        for _ in range(3):
            ours(x)
        _sync(device)
        host = []
        for _ in range(n):
            t0 = time.perf_counter()
            ours(x)
            host.append(time.perf_counter() - t0)
            _sync(device)
        print(f"profile {H}x{B}x{T}: median {1e3 * sorted(host)[n // 2]:.3f} ms until the host returns")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            ours(x)
            _sync(device)
        prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(45)


def _shape(s: str) -> tuple:
    return tuple(int(n) for n in s.split("x"))


if __name__ == "__main__":
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = sys.argv[1:]
    if args and args[0] == "profile":
        profile(*_shape(args[1] if len(args) > 1 else "64x1x200"), device)
    else:
        failed = [s for s in args or ["64x1x200", "256x4x1000", "512x32x100"]
                  if "fwd" not in compare(*_shape(s), device)]
        sys.exit(1 if failed else 0)
