#!/bin/bash
# The working tree with the expert-major entry point wired (expert_major_wiring.patch of kl15 on
# 64b2732, the MMA kernels in passes/quantize_int4.py with fp16 dynamic shared memory, as the
# module's other kernels declare it; EXPERT_MAJOR_FROM = 2 while measuring),
# built as build/r36 (lite: V2-Lite q4f16_g128 random weights; gpu: the tiny refs; src; the
# script gpu_decode_batches.py). Decode batches token- vs expert-major, then the graph check
# (its batch-2 cases run the expert-major entry point). Carry .devcarry,
# build/r36/{lite,src,gpu_decode_batches.py}.
R=build/r36 bash docs/bench-results/kl16/expert_mma/run.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r36/src:$PWD/.site
L=.devcarry/tvm-lib
python3 -P scripts/gpu_graph_check.py build/r36/lite --lib-dir $L --out $OUT/gc-r36 2>&1 | grep "^OK\|^MISMATCH\|launched\|rror" | cut -c1-300
