#!/usr/bin/env bash
# One lease of a lent GPU, in as few calls as possible (each fresh machine costs minutes of device time).
#
#   bash bench/gpu_run.sh env      # versions, the GPU as numba-cuda sees it, numbarnn's default backend
#   bash bench/gpu_run.sh tests    # the CUDA test files with NUMBARNN_REAL_GPU=1 (the same tests as the simulator's)
#   bash bench/gpu_run.sh bench    # numbarnn bench: step kernels v1, v2, v3 beside cuDNN, DeepBench shapes
#   bash bench/gpu_run.sh proj     # the same with an LSTM projection (P = H/2): v2 vs v3 (two phases per step)
#   bash bench/gpu_run.sh profile  # bench/gpu_profile.py: host cost of a launch; ncu: device time of every kernel
#   bash bench/gpu_run.sh host     # a warm call at the host-bound 64x1x200: host vs device time, ncu per kernel
#   BASELINE=dir bash bench/gpu_run.sh host_compare   # the same call with an older numbarnn, alternating
#   bash bench/gpu_run.sh launch   # numbarnn bench with NUMBARNN_FAST_LAUNCH=0 and 1 (numba's launch / launch.py)
#   bash bench/gpu_run.sh wide     # v3 in blocks of 64 threads (NUMBARNN_V3_WIDE=0) and in the widest that fit
#   bash bench/gpu_run.sh narrow   # v2 in the GPU tiles (NUMBARNN_V2_NARROW=0) and, on a small grid, the narrow ones
#   bash bench/gpu_run.sh all      # env, bench, proj, tests
#   bash bench/gpu_run.sh check    # numbarnn check (the README's main job) on the GPU
#   bash bench/gpu_run.sh lease    # one device call of ~8 minutes for a 15-minute lease (see `run_lease`)
#
# Logs and CSVs go to $OUT (the device tool brings them back), else to ./gpu_out.  numbarnn is used from the
# checkout (PYTHONPATH), with the machine's numba, numba-cuda and torch.
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NUMBARNN_REAL_GPU=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

SHAPES=${SHAPES:-"512x32x100 1024x64x100 256x4x1000 768x16x1024 64x1x200"}
REPS=${REPS:-5}

env_check() {
    nvidia-smi -L; nvidia-smi --query-gpu=driver_version,clocks.max.sm --format=csv,noheader
    python3 - <<'EOF'
import sys, numpy, numba, torch
import numba_cuda
from numba import cuda
print("python", sys.version.split()[0], "numpy", numpy.__version__, "numba", numba.__version__,
      "numba-cuda", numba_cuda.__version__, "torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
d = cuda.get_current_device()
print("device", d.name, "cc", d.compute_capability, "SMs", d.MULTIPROCESSOR_COUNT)
import numbarnn
print("numbarnn default backend:", numbarnn.backends.get_default_backend())
EOF
}

run_bench() {     # step kernels v1, v2, v3 and cuDNN side by side, validated first
    timeout ${BENCH_TIMEOUT:-500} python3 -m numbarnn bench --backends cuda cudnn --modes lstm \
        --step-versions ${VERSIONS:-1 2 3} --shapes $SHAPES --reps "$REPS" --warmup 1 --csv "$OUT/bench.csv" \
        2>&1 | tee "$OUT/bench.log"
}

run_bench_proj() {     # an LSTM with a projection: v2 (project launches per step) vs v3, beside cuDNN
    for HBT in ${PROJ_SHAPES:-512x32x100 1024x64x100}; do
        timeout 300 python3 -m numbarnn bench --backends cuda cudnn --modes lstm --step-versions 2 3 \
            --num-proj $(( ${HBT%%x*} / 2 )) --shapes "$HBT" --reps "$REPS" --warmup 1 --csv "$OUT/bench_proj_$HBT.csv" \
            2>&1 | tee -a "$OUT/bench_proj.log"
    done
}

run_launch() {   # whole calls with numba's launch and with numbarnn's (kernels/launch.py), host-bound shapes first
    for FAST in 0 1; do
        NUMBARNN_FAST_LAUNCH=$FAST timeout 300 python3 -m numbarnn bench --backends cuda --modes lstm \
            --step-versions 2 3 --shapes ${LAUNCH_SHAPES:-64x1x200 256x4x1000 512x32x100} --reps "$REPS" --warmup 1 \
            --csv "$OUT/bench_launch_fast$FAST.csv" 2>&1 | tee "$OUT/bench_launch_fast$FAST.log"
    done
    python3 bench/gpu_profile.py launch 2>&1 | tee "$OUT/launch.log"
}

run_wide() {   # v3 (step_v3.choose) in plan's blocks of 64 threads, then in the widest co-resident ones
    for WIDE in 0 1; do
        NUMBARNN_V3_WIDE=$WIDE timeout 400 python3 -m numbarnn bench --backends cuda --modes lstm --step-versions 3 \
            --shapes ${WIDE_SHAPES:-768x16x1024 256x4x1000 512x32x100} --reps "$REPS" --warmup 1 \
            --csv "$OUT/bench_wide$WIDE.csv" 2>&1 | tee "$OUT/bench_wide$WIDE.log"
    done
}

run_narrow() {   # v2 (step_v2.tiles) in the GPU tiles, then in the narrow ones where the grid is smaller than the SMs
    for NARROW in 0 1; do
        NUMBARNN_V2_NARROW=$NARROW timeout 400 python3 -m numbarnn bench --backends cuda --modes lstm \
            --step-versions 2 --shapes ${NARROW_SHAPES:-768x16x1024 256x4x1000 512x32x100} --reps "$REPS" \
            --warmup 1 --csv "$OUT/bench_narrow$NARROW.csv" 2>&1 | tee "$OUT/bench_narrow$NARROW.log"
    done
}

run_tests() {
    timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -rs -n ${WORKERS:-12} -p no:cacheprovider \
        ${TESTS:-tests/test_rnn_cuda.py tests/test_step_v2.py tests/test_step_v3.py tests/test_block_lstm_cuda.py \
        tests/test_gemm.py tests/test_column_sums.py tests/test_philox.py tests/test_torch_dropin.py tests/test_launch.py \
        tests/test_torch_cuda.py tests/test_modulated_cells.py tests/test_indrnn.py tests/test_zoneout.py \
        tests/test_layer_norm_cells.py} \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -60
}

run_profile() {
    python3 bench/gpu_profile.py launch 2>&1 | tee "$OUT/launch.log"
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    echo "ncu: $NCU"
    timeout 200 "$NCU" --profile-from-start off --csv --metrics gpu__time_duration.sum \
        python3 bench/gpu_profile.py kernels ${PROFILE_ARGS:-} > "$OUT/ncu_times.csv" 2> "$OUT/ncu_times.err"
    grep "^kernels" "$OUT/ncu_times.csv"; tail -3 "$OUT/ncu_times.err"
    [ -n "${SECTIONS:-1}" ] || return 0
    # the v2/v3 step kernels only ("v2|v3" alone also matches gemm_v4's mangled name: seen on the H100)
    timeout 150 "$NCU" --profile-from-start off -k regex:"step_v2|persistent_v3" -c 3 --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section InstructionStats \
        python3 bench/gpu_profile.py kernels 23 768x16 > "$OUT/ncu_sections.txt" 2>&1
    tail -3 "$OUT/ncu_sections.txt"
}

run_host() {   # the host-bound shape: host vs device time of a warm call, then ncu's device time of every kernel
    local SHAPE=${HOST_SHAPE:-64x1x200}
    python3 bench/gpu_profile.py call 3 "$SHAPE" 2>&1 | tee "$OUT/call_$SHAPE.log" | grep -v "^ *[0-9]"
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    timeout 150 "$NCU" --profile-from-start off --csv --metrics gpu__time_duration.sum \
        python3 bench/gpu_profile.py kernels 3 "$SHAPE" > "$OUT/ncu_$SHAPE.csv" 2> "$OUT/ncu_$SHAPE.err"
    grep "^kernels" "$OUT/ncu_$SHAPE.csv"; tail -3 "$OUT/ncu_$SHAPE.err"
}

run_host_compare() {   # the host-bound call with this checkout and with an older numbarnn (BASELINE: a folder
    # holding its numbarnn/ package, e.g. `git archive REV numbarnn | tar -x -C gpu_baseline`), alternating
    local SHAPE=${HOST_SHAPE:-64x1x200}
    for round in 1 2; do
        for tree in "$BASELINE" "$PWD"; do
            echo "== round $round, numbarnn from $tree"
            PYTHONPATH=$tree:$PWD python3 bench/gpu_profile.py call 3 "$SHAPE" 2>&1 | grep "^call"
        done
    done 2>&1 | tee "$OUT/host_compare_$SHAPE.log"
}

run_check() {   # the README's main job on the GPU: every backend against the float64 reference
    timeout ${CHECK_TIMEOUT:-240} python3 -m numbarnn check > "$OUT/check.log" 2>&1
    echo "numbarnn check: exit $?" >> "$OUT/check.log"
}

run_lease() {   # what a 15-minute lease (machine start included) decides first, in one call of ~8 minutes:
    # 1. the targets: v2, v3 and cuDNN at 256x4x1000, 768x16x1024, 512x32x100 and the host-bound 64x1x200,
    #    alone on the GPU (the bench validates every kernel it times against the float64 reference first);
    # 2. then side by side (16 cores): `numbarnn check` and the CUDA test files (the persistent backward, the
    #    projection, the wide and narrow blocks, the fast launch, split-K, numbarnn.torch with CUDA tensors).
    # Each step writes its log as it goes, so a timeout still brings back what ran.
    SHAPES=${LEASE_SHAPES:-"256x4x1000 768x16x1024 512x32x100 64x1x200"} VERSIONS=${VERSIONS:-"2 3"} \
        REPS=${LEASE_REPS:-3} BENCH_TIMEOUT=${BENCH_TIMEOUT:-220} run_bench
    run_check &
    TEST_TIMEOUT=${TEST_TIMEOUT:-240} WORKERS=${WORKERS:-10} run_tests
    wait
    tail -5 "$OUT/check.log"
}

case "${1:-all}" in
    env) env_check ;;
    tests) env_check; run_tests ;;
    bench) env_check; run_bench ;;
    proj) env_check; run_bench_proj ;;
    profile) env_check; run_profile ;;
    host) env_check; run_host ;;
    host_compare) env_check; run_host_compare ;;
    launch) env_check; run_launch ;;
    wide) env_check; run_wide ;;
    narrow) env_check; run_narrow ;;
    profile+tests) env_check; run_profile; run_tests ;;
    profile+bench+tests) env_check; run_profile; run_bench; run_tests ;;
    all) env_check; run_bench; run_bench_proj; run_tests ;;
    check) env_check; run_check; cat "$OUT/check.log" ;;
    lease) env_check 2>&1 | tee "$OUT/env.log"; run_lease ;;
    *) echo "usage: $0 env|tests|bench|proj|profile|host|host_compare|launch|wide|narrow|profile+tests|profile+bench+tests|all|check|lease" >&2
       exit 2 ;;
esac
