#!/bin/bash
# host overhead of a decode step: HEAD's runtime vs the working tree's follow chaining (same kernels: build/h/lite = a46a20d)
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
B=build/h/lite; L=.devcarry/tvm-lib; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/r; mkdir -p $R
H=$PWD/build/h/src-head:$PWD/.site; N=$PWD/build/h/src-new:$PWD/.site
for i in 1 2; do
  PYTHONPATH=$H python3 -P scripts/gpu_step_overhead.py $B --lib-dir $L --out $R/head-$i 2>&1 | tail -1 | sed "s/^/head /"
  PYTHONPATH=$N python3 -P scripts/gpu_step_overhead.py $B --lib-dir $L --out $R/follow-$i --follow 2>&1 | tail -1 | sed "s/^/follow /"
done
for i in 1 2; do
  PYTHONPATH=$H python3 -P -m dsv2_mlc.cli bench $B --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 3 --lib-dir $L --json $R/bench4k-head-$i.json 2>&1 | grep -i "^decode:" | sed "s/^/head /"
  PYTHONPATH=$N python3 -P -m dsv2_mlc.cli bench $B --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 3 --lib-dir $L --json $R/bench4k-follow-$i.json 2>&1 | grep -i "^decode:" | sed "s/^/follow /"
done
PYTHONPATH=$H python3 -P -m dsv2_mlc.cli bench $B --prompt-len 512 --gen-len 128 --warmup 1 --repeat 3 --lib-dir $L --json $R/bench512-head.json 2>&1 | grep -i "^decode:" | sed "s/^/head /"
PYTHONPATH=$N python3 -P -m dsv2_mlc.cli bench $B --prompt-len 512 --gen-len 128 --warmup 1 --repeat 3 --lib-dir $L --json $R/bench512-follow.json 2>&1 | grep -i "^decode:" | sed "s/^/follow /"
cd $OUT && tar czf r.tgz r && rm -rf r
