"""DeepBench-style benchmark of numbarnn's RNN ops against cuDNN: now `numbarnn bench` (numbarnn/bench.py).

    python bench/bench_rnn.py [ARGS]     # the same as `numbarnn bench [ARGS]` and `python -m numbarnn.bench`

Kept so that old commands still work; the code (and `--help`) lives in the installed package.
"""
from __future__ import annotations

import sys

from numbarnn.bench import main

if __name__ == "__main__":
    sys.exit(main())
