"""Packed weights kept between the calls of a loop over few rows (the fused forward's panels).

The fused forward reads W, R and W_proj as panels packed by unit tiles (`microkernel.pack`), packed from the opaque
buffer at every call.  Packing streams the weights about three times; a call's products stream them once per
row and step.  So at T*B = 1 (an inference loop over one step, a reinforcement-learning rollout, sampling)
packing is most of the call, and at T*B in the thousands it is nothing.

For calls of at most `KEEP_ROWS` rows (T*B) the panels of each configuration are kept per thread, with the
bits of the opaque buffer they were packed from.  The next call compares its buffer with those bits (one
sequential pass, about a third of a pack) and packs again only where they differ.  A check of content, not of
identity or of torch's version counters: a write through a NumPy view or a tensor's `.data` changes neither,
and a stale weight would be a silently wrong result.  Larger calls pack into scratch as before (there packing
is a small share, and keeping would hold weight-sized memory for nothing).

    kept, packed = KEPT.lookup(key, params, shapes)   # packed: the panels already hold params
    ... pack into kept.layers[p] unless packed ...
    KEPT.commit(kept, params)                          # after every pseudo-layer was packed

`KEPT.release()` (and `numbarnn.release_workspaces()`) frees them; a pack that did not finish is never trusted.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..workspace import track
from .jitcache import njit_cached
from .workspace import aligned_empty

#: keep the packed panels of calls with at most this many rows (T*B): there packing is >= ~5% of the call
#: (LSTM H=512: a pack ~1.5 ms, a row's step ~0.13 ms)
KEEP_ROWS = 256
#: ... and at least this many weights: below, a pack costs less than the look-up (LSTM H=16: ~5 us)
KEEP_WEIGHTS = 16384
#: configurations kept per thread (the least recently used one goes first)
KEEP_CONFIGS = 4

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(a: np.ndarray) -> np.ndarray:
    """a's memory as unsigned words, 8 bytes each where its size allows (compared bit for bit: NaN equals its
    own bits, -0.0 differs from 0.0; wide words compare in half the time of float32's)."""
    return a.view(np.uint64) if a.nbytes % 8 == 0 else a.view(_UNSIGNED[a.dtype.itemsize])


@njit_cached
def same_bits(
    a,        # [N] unsigned
    b,        # [N] unsigned
):
    """Whether a and b are equal, block by block (a vectorised OR of XORs: no temporary, half the time of
    np.array_equal): weights a training step changed differ in the first block, and the rest is skipped."""
    n = a.shape[0]
    for start in range(0, n, 4096):
        diff = a[start] ^ a[start]
        for i in range(start, min(n, start + 4096)):
            diff |= a[i] ^ b[i]
        if diff:
            return False
    return True


@dataclass
class Kept:
    """One configuration's kept panels (in this thread)."""
    owner: object           # what the panels were made for (the key's object: kept alive, so its id stays)
    bits: np.ndarray        # [N] unsigned: the opaque buffer the panels were packed from
    layers: list            # per pseudo-layer: its arrays, allocated by the caller's shapes
    valid: bool = False     # whether `layers` hold `bits` (False from a lookup that missed until `commit`)

    def nbytes(self) -> int:
        return self.bits.nbytes + sum(a.nbytes for arrays in self.layers for a in arrays)


class KeptPanels:
    """Per thread, up to KEEP_CONFIGS configurations' `Kept` panels, least recently used first."""

    def __init__(self):
        self._local = threading.local()
        track(self)

    def _store(self) -> OrderedDict:
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._local.store = OrderedDict()
        return store

    def lookup(self, owner, params: np.ndarray, shapes) -> tuple[Kept, bool]:
        """(the kept panels of `owner`, whether they already hold `params` [N]): a hit needs the same bits as the
        last `commit`; a miss marks the entry invalid until the caller has packed and committed.
        owner: any object standing for the configuration (the caller's plan: its identity is the key);
        shapes: per pseudo-layer the shapes of its arrays (allocated on the owner's first use)."""
        store = self._store()
        kept = store.pop(id(owner), None)        # (an entry keeps its owner alive: its id is not reused)
        if kept is None:
            kept = Kept(owner, np.empty_like(bits(params)),
                        [tuple(aligned_empty(shape, params.dtype) for shape in layer) for layer in shapes])
        store[id(owner)] = kept                             # the most recently used, last
        if len(store) > KEEP_CONFIGS:
            store.popitem(last=False)
        if kept.valid and same_bits(bits(params), kept.bits):
            return kept, True
        kept.valid = False
        return kept, False

    @staticmethod
    def commit(kept: Kept, params: np.ndarray) -> None:
        """The panels of `kept` now hold `params`: remember its bits."""
        np.copyto(kept.bits, bits(params))
        kept.valid = True

    def held_bytes(self) -> int:
        """Bytes this thread keeps."""
        return sum(kept.nbytes() for kept in self._store().values())

    def release(self) -> int:
        """Free this thread's kept panels; returns the bytes they held."""
        held = self.held_bytes()
        self._store().clear()
        return held


KEPT = KeptPanels()
