#!/bin/bash
# Decode throughput against the batch size: bench at batch 1-31 (prompt 1024, 128 new tokens)
# and 4096 for batch 1-8, plus --profile at batch 16. Carry .devcarry, build/r25/lite,
# build/r25/src (the tree of 438905a; kernels of e22a115).
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r25/src:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=build/r25/lite; L=.devcarry/tvm-lib
for b in 1 2 4 8 16 31; do
  python3 -P -m dsv2_mlc.cli bench $B --lib-dir $L --batch $b --prompt-len 1024 --gen-len 128 \
    --warmup 1 --repeat 2 --json $OUT/bench-b$b-1024.json 2>&1 | grep "^decode\|^prefill\|rror"
done
for b in 4 8; do
  python3 -P -m dsv2_mlc.cli bench $B --lib-dir $L --batch $b --prompt-len 4096 --gen-len 128 \
    --warmup 1 --repeat 2 --json $OUT/bench-b$b-4096.json 2>&1 | grep "^decode\|^prefill\|rror"
done
python3 -P -m dsv2_mlc.cli bench $B --lib-dir $L --batch 16 --prompt-len 1024 --gen-len 32 \
  --warmup 1 --repeat 1 --profile --json $OUT/profile-b16.json > $OUT/profile-b16.txt 2>&1
tail -40 $OUT/profile-b16.txt
