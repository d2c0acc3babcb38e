#!/bin/bash
# bench at 4K, base (215b194's kernels, build/r22/lite) and new (build/r24/lite) alternating, twice
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib; export PYTHONUNBUFFERED=1
declare -A B=([base]=build/r22/lite [new]=build/r24/lite) SRC=([base]=build/r22/src [new]=build/r24/src)
R=$OUT/bench_ab; mkdir -p $R
for i in 1 2; do for v in base new; do
  PYTHONPATH=$PWD/${SRC[$v]}:$PWD/.site python3 -P -m dsv2_mlc.cli bench ${B[$v]} --prompt-len 4096 --gen-len 128 \
    --warmup 1 --repeat 3 --lib-dir $L --json $R/bench4k-$v-$i.json 2>&1 | grep -i "^decode:" | sed "s/^/$v $i /"
done; done
