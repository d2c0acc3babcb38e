#!/bin/bash
# The adopted tree (build/r38: the MMA expert-major kernels with items of 64 rows and no K split,
# staged rows in static shared memory as in build/r33; EXPERT_MAJOR_FROM = 16): decode batches
# 8 / 16 / 31 token- vs expert-major, bench at batch 31 (the default: expert-major). Carry
# .devcarry, build/r38.
R=build/r38 BATCHES=8,16,31 bash docs/bench-results/kl16/expert_mma/run.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r38/src:$PWD/.site
L=.devcarry/tvm-lib; B=build/r38/lite; O=$OUT/r38; mkdir -p $O
python3 -P -m dsv2_mlc.cli bench $B --lib-dir $L --batch 31 --prompt-len 1024 --gen-len 128 \
  --warmup 1 --repeat 2 --json $O/bench-b31-1024.json 2>&1 | grep "^decode\|^prefill\|rror"
