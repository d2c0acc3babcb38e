#!/bin/bash
# The adopted tree (build/r37: the MMA expert-major kernels with items of 64 rows, fp16 dynamic
# shared memory; EXPERT_MAJOR_FROM = 16): decode batches 8 / 16 / 31 token- vs expert-major,
# bench at batch 31 and 16 (the default: expert-major) and at batch 1, 4K (unchanged kernels),
# the tiny configs against HF. Carry .devcarry, build/r37.
R=build/r37 BATCHES=8,16,31 bash docs/bench-results/kl16/expert_mma/run.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r37/src:$PWD/.site
L=.devcarry/tvm-lib; B=build/r37/lite; O=$OUT/r37; mkdir -p $O
for b in 31 16; do
  python3 -P -m dsv2_mlc.cli bench $B --lib-dir $L --batch $b --prompt-len 1024 --gen-len 128 \
    --warmup 1 --repeat 2 --json $O/bench-b$b-1024.json 2>&1 | grep "^decode\|^prefill\|rror"
done
python3 -P -m dsv2_mlc.cli bench $B --lib-dir $L --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 2 --json $O/bench4k.json 2>&1 | grep "^decode\|^prefill\|^roofline\|rror"
python3 -P scripts/gpu_numerics.py --builds build/r37/gpu --lib-dir $L --out $O/gpu_numerics.json 2>&1 | tail -3
