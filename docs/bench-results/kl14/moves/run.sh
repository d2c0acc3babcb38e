#!/bin/bash
# Decode graphs moved between page buckets (runtime/graph_relocation.py): the graph check (every
# replay against an eager engine) and greedy decode over new buckets, moves on / off alternating.
# Carry .devcarry, build/r25/lite, build/r25/src (dsv2_mlc with passes/schedules resolved).
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r25/src:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=build/r25/lite; L=.devcarry/tvm-lib
mkdir -p $OUT/gc $OUT/moves
python3 -P scripts/gpu_graph_check.py $B --lib-dir $L --out $OUT/gc 2>&1 | grep -v "^ *$\|Warn\|warn_once" | tail -12
python3 -P scripts/gpu_graph_moves.py $B --lib-dir $L --out $OUT/moves 2>&1 | grep -v "^ *$\|Warn\|warn_once" | tail -14
