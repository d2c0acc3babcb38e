#!/bin/bash
# argmax multi-block (build/h2 = working tree) vs a46a20d (build/h): GPU correctness, graph check, bench A/B
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/r4; mkdir -p $R
H=$PWD/build/h/src-head:$PWD/.site; N=$PWD/build/h2/src:$PWD/.site
PYTHONPATH=$N python3 -P scripts/gpu_argmax_check.py build/h2/lite --lib-dir $L --out $R/argmax 2>&1 | tail -1
PYTHONPATH=$N python3 -P scripts/gpu_graph_check.py build/h2/lite --lib-dir $L --out $R/graph 2>&1 | tail -1
for i in 1 2; do
  PYTHONPATH=$N python3 -P scripts/gpu_step_overhead.py build/h2/lite --lib-dir $L --out $R/so-argmax-$i --replays 2000 2>&1 | tail -1 | cut -c1-400 | sed "s/^/argmax /"
  PYTHONPATH=$H python3 -P scripts/gpu_step_overhead.py build/h/lite --lib-dir $L --out $R/so-head-$i --replays 2000 2>&1 | tail -1 | cut -c1-400 | sed "s/^/head /"
done
for i in 1 2; do
  PYTHONPATH=$H python3 -P -m dsv2_mlc.cli bench build/h/lite --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 3 --lib-dir $L --json $R/bench4k-head-$i.json 2>&1 | grep -i "^decode:" | sed "s/^/head /"
  PYTHONPATH=$N python3 -P -m dsv2_mlc.cli bench build/h2/lite --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 3 --lib-dir $L --json $R/bench4k-argmax-$i.json 2>&1 | grep -i "^decode:" | sed "s/^/argmax /"
done
cd $OUT && tar czf r4.tgz r4 && rm -rf r4
