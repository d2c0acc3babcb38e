#!/bin/bash
# The decode loop's step p99 with graphs moved between buckets (8c3817b): gpu_step_overhead at
# ~4,000 and ~32,000 tokens (200 timed steps after 160: 3-4 new buckets in the timed steps), and
# bench at 4K with 512 generated tokens (its first run crosses 8 buckets).
# Carry .devcarry, build/r25/lite, build/r25/src.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r25/src:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=build/r25/lite; L=.devcarry/tvm-lib
for n in 4000 32000; do
  mkdir -p $OUT/so-$n
  python3 -P scripts/gpu_step_overhead.py $B --lib-dir $L --out $OUT/so-$n --prompt-len $n --replays 500 2>&1 | grep -v "^ *$\|Warn\|warn_once" | tail -2 | cut -c1-600
done
python3 -P -m dsv2_mlc.cli bench $B --lib-dir $L --prompt-len 4096 --gen-len 512 --warmup 1 --repeat 2 --json $OUT/bench4k-512.json 2>&1 | grep -v "^ *$\|Warn\|warn_once" | tail -12
