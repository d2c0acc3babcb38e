#!/bin/bash
# Review of the moved graphs (one replay path per kind, the engine's key helper shared): as kl14/prepare:
# the graph check, greedy decode over new buckets (moves on / off), the loop's p99 at ~4,000
# and ~32,000 tokens, bench at 4K + 512. Carry .devcarry, build/r25/lite, build/r25/src.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r25/src:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=build/r25/lite; L=.devcarry/tvm-lib
mkdir -p $OUT/gc $OUT/moves
python3 -P scripts/gpu_graph_check.py $B --lib-dir $L --out $OUT/gc 2>&1 | grep "^OK\|^MISMATCH\|launched" | cut -c1-400
python3 -P scripts/gpu_graph_moves.py $B --lib-dir $L --out $OUT/moves 2>&1 | grep -v "^ *$\|Warn\|warn_once" | cut -c1-330 | tail -10
for n in 4000 32000; do
  mkdir -p $OUT/so-$n
  python3 -P scripts/gpu_step_overhead.py $B --lib-dir $L --out $OUT/so-$n --prompt-len $n --replays 500 2>&1 | tail -1 | cut -c1-200
done
python3 -P -m dsv2_mlc.cli bench $B --lib-dir $L --prompt-len 4096 --gen-len 512 --warmup 1 --repeat 2 --json $OUT/bench4k-512.json 2>&1 | grep "^decode"
