#!/bin/bash
# greedy generation with overlapped steps vs without (same process), working tree's runtime on 78fbc03's kernels
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/h3/src:$PWD/.site
B=build/r17/bench/v2-lite-q4f16_g128
R=$OUT/ov; mkdir -p $R
for i in 1 2; do
  python3 -P build/h3/gpu_generate_overlap.py $B --lib-dir $L --out $R/p$i --consumer-us 0,100,300,1000 --rounds 3 2>&1 | tail -5 | sed "s/^/p$i /"
done
python3 -P scripts/gpu_graph_check.py $B --lib-dir $L --out $R/graph 2>&1 | tail -1
cd $OUT && tar czf ov.tgz ov && rm -rf ov
