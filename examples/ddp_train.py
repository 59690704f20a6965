"""Data-parallel training of a numbarnn LSTM with torch.nn.parallel.DistributedDataParallel (DDP).

    torchrun --nproc_per_node=2 examples/ddp_train.py             # 2 processes on this machine (gloo on the CPU)
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --quick   # a free port; a few small steps (CI)
    python examples/ddp_train.py                                  # 1 process, no launcher needed
    # several machines: the same command on each, --node_rank 0..nnodes-1, node 0's address as --master_addr
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=10.0.0.1 --master_port=29500 \\
        examples/ddp_train.py

torchrun starts one process per `--nproc_per_node` and gives each RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in its environment; `init_process_group` reads them (env://).  Backend: NCCL with one GPU per process
(LOCAL_RANK picks it) when CUDA is available, gloo on the CPU otherwise (`--dist-backend` overrides).  The
numbarnn LSTM runs on numbarnn's default backend for the tensors' device: the CUDA kernels on a GPU, the default
CPU backend otherwise (NUMBARNN_BACKEND picks another).  Nothing in the model is DDP-specific: numbarnn.torch.LSTM registers its weights as ordinary
parameters, so DDP broadcasts rank 0's at the start and averages the gradients in backward.

The task (synthetic, the same data on every process, so no download): a sequence of T_b steps of I=2 random
numbers, T_b ragged (4..T), and the target  y = sum_t x_t[0] / sqrt(T_b)  (variance 1 whatever the length):

    packed = pack_padded_sequence(x, lengths)      x [b, T, I], ragged lengths [b]
    _, (h_n, c_n) = LSTM(packed)                   numbarnn.torch.LSTM, bidirectional: h_n [L*2, b, H]
    pred = Linear(h_n[-2] ++ h_n[-1])              the last layer's two directions -> [b]
    loss = mean (pred - y)^2

Each step trains on a global batch of --batch sequences, split over the processes by DistributedSampler (every
process takes --batch / WORLD_SIZE).  The evaluation loss on a fixed held-out set (sharded, then summed over
processes with all_reduce) is printed before and after training (`first loss A -> final loss B`), and at the end
every process compares its weights with rank 0's (`replicas identical: True`).  `--save PATH`: rank 0 writes
the trained LSTM's state_dict (loadable by torch.nn.LSTM too).  The script exits non-zero if the replicas differ.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from numbarnn.torch import LSTM

I = 2                              # input features per step
QUICK = {"steps": 30, "hidden": 8, "layers": 2, "seq_len": 8, "batch": 8, "train_size": 256, "eval_size": 64}


# ---------------------------------------------------------------------------------------------------
# data and model
# ---------------------------------------------------------------------------------------------------

def make_data(n: int, T: int, seed: int) -> TensorDataset:
    """n sequences: x [n, T, I] (zero past each length), lengths [n] in 4..T, targets [n]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min(4, T), T + 1, (n,), generator=g)                 # [n]
    x = torch.randn(n, T, I, generator=g)                                         # [n, T, I]
    valid = (torch.arange(T)[None, :] < lengths[:, None]).float()                 # [n, T]
    x = x * valid[..., None]
    y = x[..., 0].sum(1) / lengths.float().sqrt()                                 # [n]
    return TensorDataset(x, lengths, y)


class Regressor(torch.nn.Module):
    """numbarnn LSTM (bidirectional, ragged input) + a linear head on the last layer's final states."""

    def __init__(self, hidden: int, layers: int):
        super().__init__()
        self.rnn = LSTM(I, hidden, num_layers=layers, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(2 * hidden, 1)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, (h_n, _) = self.rnn(packed)                            # h_n [L*2, b, H]
        last = torch.cat([h_n[-2], h_n[-1]], dim=1)               # [b, 2H]: last layer, forward ++ backward
        return self.head(last).squeeze(1)                         # [b]


# ---------------------------------------------------------------------------------------------------
# distributed set-up
# ---------------------------------------------------------------------------------------------------

def setup(dist_backend: str, timeout_s: float):
    """init_process_group from torchrun's environment (or a 1-process group without torchrun) -> device."""
    if "RANK" not in os.environ:   # plain `python examples/ddp_train.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:                  # a free port (29500, torchrun's default, may be taken)
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if dist_backend == "auto":
        dist_backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if dist_backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(dist_backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return device


def all_mean(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


@torch.no_grad()
def evaluate(model, data: TensorDataset, device) -> float:
    """Mean squared error over the whole held-out set: each process its shard, then all_reduce."""
    shard = DistributedSampler(data, shuffle=False, drop_last=True)
    total = torch.zeros(2, dtype=torch.float64, device=device)          # [sum of squared errors, count]
    for x, lengths, y in DataLoader(data, batch_size=64, sampler=shard):
        pred = model(x.to(device), lengths)
        total[0] += (pred - y.to(device)).pow(2).sum()
        total[1] += len(y)
    dist.all_reduce(total)
    return float(total[0] / total[1])


@torch.no_grad()
def replicas_identical(module, device) -> bool:
    """Every process holds rank 0's weights, bit for bit."""
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).double()
    mine = flat.clone()
    dist.broadcast(flat, src=0)
    diff = (mine - flat).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff) == 0.0


# ---------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="global batch (split over the processes)")
    parser.add_argument("--train-size", type=int, default=4096)
    parser.add_argument("--eval-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dist-backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait")
    parser.add_argument("--save", default=None, help="rank 0 saves the trained LSTM's state_dict here")
    parser.add_argument("--quick", action="store_true", help=f"tiny run: {QUICK}")
    args = parser.parse_args(argv)
    if args.quick or os.environ.get("NUMBARNN_QUICK") == "1":
        for k, v in QUICK.items():
            setattr(args, k, v)

    device = setup(args.dist_backend, args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch}: expected a multiple of the world size {world}")
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"world size {world}, process group backend {dist.get_backend()}, device {device.type}, "
        f"global batch {args.batch} ({args.batch // world} per process)", flush=True)

    torch.manual_seed(args.seed)       # the same initial weights everywhere (DDP would broadcast rank 0's anyway)
    model = DDP(Regressor(args.hidden, args.layers).to(device), device_ids=[device] if device.type == "cuda" else None)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    train = make_data(args.train_size, args.seq_len, seed=args.seed)
    held_out = make_data(args.eval_size, args.seq_len, seed=args.seed + 1)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch // world, sampler=sampler, drop_last=True)

    first = evaluate(model, held_out, device)
    say(f"step    0  eval loss {first:.4f}", flush=True)
    t0, step, epoch = time.perf_counter(), 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)       # a different shuffle each epoch, the same on every process
        for x, lengths, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x.to(device), lengths), y.to(device))
            loss.backward()            # DDP all-reduces (averages) the gradients here
            opt.step()
            step += 1
            if step % max(1, args.steps // 10) == 0 or step == args.steps:
                say(f"step {step:4d}  train loss {all_mean(loss.item(), device):.4f}  "
                    f"({(time.perf_counter() - t0) / step * 1e3:.0f} ms/step)", flush=True)
            if step == args.steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - t0
    final = evaluate(model, held_out, device)
    same = replicas_identical(model.module, device)
    say(f"first loss {first:.4f} -> final loss {final:.4f}  ({args.steps} steps in {elapsed:.1f} s, "
        f"{world} process{'es' if world > 1 else ''})", flush=True)
    say(f"replicas identical: {same}", flush=True)
    if args.save and rank == 0:
        torch.save(model.module.rnn.state_dict(), args.save)
        say(f"saved the LSTM's state_dict to {args.save}")
    # Shut down while Python is fully alive.  DDP's reducer sits in reference cycles that keep the process group
    # (and its gloo worker threads) alive until the interpreter's last garbage collection; a worker thread that
    # touches a Python object then is killed mid-C++ and the process aborts ("terminate called without an active
    # exception") after printing everything.  Drop the references, collect, then destroy the group.
    del model, opt, loader
    gc.collect()
    dist.destroy_process_group()
    return 0 if same and math.isfinite(final) else 1


if __name__ == "__main__":
    raise SystemExit(main())
