#!/bin/bash
# What differs between decode graphs of neighbouring buckets (the warm-up's greedy graphs).
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r25/src:$PWD/.site
B=build/r25/lite; L=.devcarry/tvm-lib
python3 -P scripts/gpu_graph_moves.py $B --lib-dir $L --out $OUT/diag --diagnose 2>&1 | grep -v "^ *$\|Warn\|warn_once" | tail -30
