#!/bin/bash
# Moved graphs with clones below capacity: the graph check, greedy decode over new buckets
# (moves on / off), the loop's p99 at ~4,000 tokens and bench at 4K + 512 (its timed runs should
# replay the buckets its warm-up cached). Carry .devcarry, build/r25/lite, build/r25/src.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r25/src:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=build/r25/lite; L=.devcarry/tvm-lib
mkdir -p $OUT/gc $OUT/moves $OUT/so-4000
python3 -P scripts/gpu_graph_check.py $B --lib-dir $L --out $OUT/gc 2>&1 | grep "^OK\|^MISMATCH" | cut -c1-400
python3 -P scripts/gpu_graph_moves.py $B --lib-dir $L --out $OUT/moves 2>&1 | grep -v "^ *$\|Warn\|warn_once" | cut -c1-330 | tail -10
python3 -P scripts/gpu_step_overhead.py $B --lib-dir $L --out $OUT/so-4000 --prompt-len 4000 --replays 500 2>&1 | tail -1 | cut -c1-300
python3 -P -m dsv2_mlc.cli bench $B --lib-dir $L --prompt-len 4096 --gen-len 512 --warmup 1 --repeat 2 --json $OUT/bench4k-512.json 2>&1 | grep "^decode"
