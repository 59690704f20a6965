"""numbarnn.torch modules under torch.nn.parallel.DistributedDataParallel (gloo on the CPU).

Two worker processes (this file run as a script, ``--worker RANK``) join one gloo process group, each builds the
same models from a different seed (DDP broadcasts rank 0's weights at construction), wraps each in DDP and trains
3 SGD steps (momentum 0.9) on its half of a batch.  This test process trains the same models on the whole batch
alone and checks, per model:

* after the first backward, every parameter's gradient on both ranks equals the single-process gradient of the
  whole batch (DDP averages the ranks' gradients; each rank's loss is a mean over its own half, so the average
  is the mean over the batch);
* after the last step, the weights on both ranks equal the single-process weights, and each other bitwise;
* the check cannot pass by accident: the gradient of one half alone is far from the whole batch's.

Models (each a different DDP option, so one run covers them all):

* LSTM, 2 layers, bidirectional, float64, ragged lengths (PackedSequence, enforce_sorted=False), default DDP;
* GRU, batch_first, float64, with an initial state h_0, ``gradient_as_bucket_view=True``;
* a user cell: ``RNNBase(numbarnn.contrib.cifg_lstm.SPEC, proj_size=2)``, float64, (h_0, c_0) given,
  ``static_graph=True``;
* LSTM float32, ragged lengths, ``find_unused_parameters=True``.

Tolerances.  Single-process and DDP runs compute the same per-sample values; they differ only in summation
order (the batch sum of the weight gradients is done as two half sums plus an allreduce, not as one sum) and in
the factor 1/2 applied after the allreduce instead of 1/B before.  That is a few roundings per gradient entry,
amplified little by 3 steps: float64 gives |diff| ~ 1e-16 relative, float32 ~ 1e-7; we check rtol 1e-10 /
atol 1e-12 (float64) and rtol 1e-4 / atol 1e-5 (float32, left wide for a float32-computing backend summing in a
different order).  Any real fault (no allreduce, sum instead of mean, a parameter DDP does not see, weights not
broadcast) is O(1e-2) or more.

The workers use numbarnn's default backend (the NumPy reference on CPU tensors when there is no GPU; they inherit
NUMBA_ENABLE_CUDASIM=1 from tests/conftest.py).  The rendezvous store is a TCPStore this process opens on a free
port (no port race); the process group has a timeout, each worker's output goes to a file that a failure message
shows, and a worker that fails or outlives the deadline gets both killed.
"""
from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
STEPS = 3
B, T, I, H = 4, 5, 3, 4            # the whole batch; each rank trains on B // WORLD samples
LENGTHS = (5, 2, 4, 3)             # ragged models: sequence lengths of the B samples (each half unsorted or not)
PG_TIMEOUT_S = 120                 # a collective that waits longer than this fails (the worker then exits);
                                   # generous: a JIT-compiling backend may keep one rank busy for a while
DEADLINE_S = 240                   # the parent kills the workers (or the launcher) after this
TOLERANCE = {torch.float64: {"rtol": 1e-10, "atol": 1e-12}, torch.float32: {"rtol": 1e-4, "atol": 1e-5}}

# name -> (what it is, DDP keyword arguments)
MODELS = {
    "lstm_bidir_packed": ("LSTM 2 layers bidirectional float64, PackedSequence", {}),
    "gru_batch_first": ("GRU batch_first float64 with h_0", {"gradient_as_bucket_view": True}),
    "cifg_user_cell": ("RNNBase(cifg_lstm, proj_size=2) float64 with (h_0, c_0)", {"static_graph": True}),
    "lstm_float32_packed": ("LSTM float32, PackedSequence", {"find_unused_parameters": True}),
}


# ---------------------------------------------------------------------------------------------------
# models, data and the loss: the same code in the workers and in this process
# ---------------------------------------------------------------------------------------------------

def build(name: str, seed: int):
    """A fresh module (weights drawn after torch.manual_seed(seed))."""
    from numbarnn.torch import GRU, LSTM, RNNBase

    torch.manual_seed(seed)
    if name == "lstm_bidir_packed":
        return LSTM(I, H, num_layers=2, bidirectional=True, dtype=torch.float64)
    if name == "gru_batch_first":
        return GRU(I, H, batch_first=True, dtype=torch.float64)
    if name == "cifg_user_cell":
        from numbarnn.contrib import cifg_lstm
        return RNNBase(cifg_lstm.SPEC, I, H, proj_size=2, dtype=torch.float64)
    if name == "lstm_float32_packed":
        return LSTM(I, H, dtype=torch.float32)
    raise KeyError(name)


def whole_batch(name: str, module) -> dict:
    """The whole batch: name -> (tensor, its batch axis).  Same values in every process (its own generator)."""
    g = torch.Generator().manual_seed(1234)
    dtype = module.weight_ih_l0.dtype
    D = 2 if module.bidirectional else 1
    P = module.proj_size or module.hidden_size
    LD = module.num_layers * D
    bf = module.batch_first
    x_shape, y_shape = ((B, T, I), (B, T, D * P)) if bf else ((T, B, I), (T, B, D * P))
    batch = {"x": (torch.randn(x_shape, generator=g, dtype=dtype), 0 if bf else 1),
             "target": (torch.randn(y_shape, generator=g, dtype=dtype), 0 if bf else 1)}
    if "packed" in name:
        batch["lengths"] = (torch.tensor(LENGTHS, dtype=torch.int64), 0)
    if name in ("gru_batch_first", "cifg_user_cell"):
        batch["h0"] = (0.5 * torch.randn((LD, B, P), generator=g, dtype=dtype), 1)
    if name == "cifg_user_cell":
        batch["c0"] = (0.5 * torch.randn((LD, B, module.hidden_size), generator=g, dtype=dtype), 1)
    return batch


def part(batch: dict, rank: int, world: int) -> dict:
    """Rank `rank`'s share: samples [rank*b, (rank+1)*b) of every batch tensor, b = B // world."""
    b = B // world
    return {k: (t.narrow(axis, rank * b, b), axis) for k, (t, axis) in batch.items()}


def loss_of(model, batch: dict):
    """Mean over this batch's samples of: squared error of the valid outputs + 0.5 * |final states|²."""
    x = batch["x"][0]
    n = x.shape[batch["x"][1]]
    hx = None
    if "h0" in batch:
        hx = (batch["h0"][0], batch["c0"][0]) if "c0" in batch else batch["h0"][0]
    if "lengths" in batch:
        lengths = batch["lengths"][0]
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
        out, final = model(packed, hx)
        y, _ = torch.nn.utils.rnn.pad_packed_sequence(out, total_length=T)        # [T, b, D*P], zero padded
        valid = (torch.arange(T)[:, None] < lengths[None, :]).to(y.dtype)[..., None]   # [T, b, 1]
        err = ((y - batch["target"][0]) * valid).pow(2).sum()
    else:
        y, final = model(x, hx)
        err = (y - batch["target"][0]).pow(2).sum()
    finals = final if isinstance(final, tuple) else (final,)
    return (err + 0.5 * sum(f.pow(2).sum() for f in finals)) / n


def train(model, module, batch: dict, steps: int = STEPS):
    """`steps` SGD steps of `model` (`module`, or DDP(module)) on `batch`

    -> ({name: gradient after the first backward}, {name: final weight}), named as in `module`.
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    first = None
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, batch).backward()
        if step == 0:
            first = {k: p.grad.detach().clone() for k, p in module.named_parameters()}
        opt.step()
    return first, {k: p.detach().clone() for k, p in module.named_parameters()}


# ---------------------------------------------------------------------------------------------------
# the worker (this file run as a script)
# ---------------------------------------------------------------------------------------------------

def worker(rank: int, world: int, port: int, out: Path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=PG_TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    try:
        results = {}
        for name, (_, ddp_kwargs) in MODELS.items():
            module = build(name, seed=100 + rank)          # different on each rank: DDP must broadcast rank 0's
            model = DDP(module, **ddp_kwargs)
            start = {k: p.detach().clone() for k, p in module.named_parameters()}
            grads, weights = train(model, module, part(whole_batch(name, module), rank, world))
            results[name] = {"start": start, "grads": grads, "weights": weights}
            del model                                      # see the shutdown note in examples/ddp_train.py
        torch.save(results, out / f"rank{rank}.pt")
        dist.barrier()
    finally:
        gc.collect()      # DDP's reference cycles hold the process group: free it while Python is fully alive
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# the test
# ---------------------------------------------------------------------------------------------------

def _distributed_unavailable() -> str | None:
    import torch.distributed as dist
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend in this torch build"
    return None


def run_workers(tmp_path: Path) -> list[dict]:
    """Start WORLD workers, wait for them (killing both on a failure or after DEADLINE_S), load their results."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, timeout=timedelta(seconds=PG_TIMEOUT_S),
                          wait_for_workers=False)                       # port 0: the OS picks a free one
    path_var = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path_var, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    logs, procs = [], []
    for rank in range(WORLD):
        log = (tmp_path / f"rank{rank}.log").open("w+")   # closed in the finally below
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(rank), str(WORLD),
                                       str(store.port), str(tmp_path)],
                                      cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))

    def stop_and_report(why: str) -> str:
        for p in procs:      # stop the survivors first: a worker left alone waits in a collective until its timeout
            if p.poll() is None:
                p.kill()
                p.wait()
        parts = [why]
        for rank, log in enumerate(logs):
            log.flush()
            log.seek(0)
            parts.append(f"--- rank {rank} (exit code {procs[rank].returncode}; negative: killed by that signal) "
                         f"---\n{log.read()[-6000:]}")
        return "\n".join(parts)

    deadline = time.monotonic() + DEADLINE_S
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                pytest.fail(stop_and_report(f"worker rank {failed[0]} failed; the other was stopped"))
            if time.monotonic() > deadline:
                pytest.fail(stop_and_report(f"the workers did not finish within {DEADLINE_S} s; both were stopped"))
            time.sleep(0.05)
        if any(p.returncode != 0 for p in procs):
            pytest.fail(stop_and_report("a worker failed"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
        del store
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]


def assert_close(what: str, got: dict, want: dict, dtype) -> None:
    assert got.keys() == want.keys(), f"{what}: parameter names {sorted(got)} != {sorted(want)}"
    for k, expected in want.items():
        torch.testing.assert_close(got[k], expected, **TOLERANCE[dtype], msg=lambda m, k=k: f"{what} {k}: {m}")


def test_ddp_two_processes_match_one_process_on_the_whole_batch(tmp_path):
    why = _distributed_unavailable()
    if why:
        pytest.skip(why)
    t0 = time.perf_counter()
    ranks = run_workers(tmp_path)
    elapsed = time.perf_counter() - t0

    for name, (what, ddp_kwargs) in MODELS.items():
        label = f"{name} ({what}; DDP{ddp_kwargs or ''})"
        module = build(name, seed=100)                       # rank 0's initial weights
        params = dict(module.named_parameters())
        dtype = next(iter(params.values())).dtype
        start = {k: p.detach().clone() for k, p in params.items()}
        batch = whole_batch(name, module)
        grads, weights = train(module, module, batch)
        for rank, result in enumerate(ranks):
            r = result[name]
            for k, w in start.items():   # rank 1 drew other weights: DDP's construction copied rank 0's over them
                assert torch.equal(r["start"][k], w), f"{label}: rank {rank} {k} after DDP(...) is not rank 0's"
            assert_close(f"{label}: rank {rank} gradient after step 1 vs one process on the whole batch",
                         r["grads"], grads, dtype)
            assert_close(f"{label}: rank {rank} weights after {STEPS} steps vs one process on the whole batch",
                         r["weights"], weights, dtype)
        for k in weights:   # the replicas hold the same bits (both ranks apply the same all-reduced gradient)
            assert torch.equal(ranks[0][name]["weights"][k], ranks[1][name]["weights"][k]), f"{label}: {k}"

        # not vacuous: one half's own gradient (what a rank has before DDP's all-reduce) is far from the batch's
        half = build(name, seed=100)
        half_grads, _ = train(half, half, part(batch, 0, WORLD), steps=1)
        gap = max(float((half_grads[k] - grads[k]).abs().max()) for k in grads)
        assert gap > 1e-3, f"{label}: half 0's gradient equals the whole batch's (gap {gap}): the test proves nothing"
        worst = {what: max(float((r[what][k] - want[k]).abs().max()) for r in (x[name] for x in ranks) for k in want)
                 for what, want in (("grads", grads), ("weights", weights))}
        print(f"{name}: max |DDP - one process| gradient {worst['grads']:.1e}, weights {worst['weights']:.1e}; "
              f"one half's gradient is {gap:.1e} away")
    print(f"2 workers: {elapsed:.1f} s")


def test_example_ddp_train_under_torchrun():
    """examples/ddp_train.py --quick under `python -m torch.distributed.run --standalone --nproc_per_node=2`."""
    why = _distributed_unavailable()
    if why:
        pytest.skip(why)
    path_var = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path_var, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / "ddp_train.py"), "--quick", "--timeout", str(PG_TIMEOUT_S)]
    t0 = time.perf_counter()
    # its own session: on a timeout, the launcher and the workers it started are killed together
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[1:])}: no exit after {DEADLINE_S} s (killed); output:\n{out[-6000:]}")
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, f"{' '.join(cmd[1:])} exited with {proc.returncode}; output:\n{out[-6000:]}"
    assert "world size 2, process group backend gloo" in out, out[-3000:]
    assert "replicas identical: True" in out, out[-3000:]
    match = re.search(r"first loss ([0-9.]+) -> final loss ([0-9.]+)", out)
    assert match, f"no 'first loss A -> final loss B' line in:\n{out[-3000:]}"
    first, final = float(match.group(1)), float(match.group(2))
    assert final < 0.5 * first, f"the loss did not fall: {first} -> {final}\n{out[-3000:]}"
    print(f"torchrun --nproc_per_node=2 examples/ddp_train.py --quick: {elapsed:.1f} s, loss {first} -> {final}")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
    else:
        sys.exit(f"usage: {sys.argv[0]} --worker RANK WORLD PORT OUTDIR (started by the test; run pytest instead)")
