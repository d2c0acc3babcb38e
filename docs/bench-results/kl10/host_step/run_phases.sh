#!/bin/bash
# host phases of a greedy decode step (build/h2), per process; one process with TVM/OMP threads 1
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib; export PYTHONUNBUFFERED=1
R=$OUT/r5; mkdir -p $R
export PYTHONPATH=$PWD/build/h2/src:$PWD/.site
nproc; cat /proc/cpuinfo | grep "model name" | head -1
for i in 1 2 3; do
  python3 -P build/h2/gpu_step_overhead.py build/h2/lite --lib-dir $L --out $R/ph-$i --phases --replays 200 2>&1 | tail -1 | cut -c1-250
done
TVM_NUM_THREADS=1 OMP_NUM_THREADS=1 python3 -P build/h2/gpu_step_overhead.py build/h2/lite --lib-dir $L --out $R/ph-t1 --phases --replays 200 2>&1 | tail -1 | cut -c1-250
taskset -c 2 python3 -P build/h2/gpu_step_overhead.py build/h2/lite --lib-dir $L --out $R/ph-cpu2 --phases --replays 200 2>&1 | tail -1 | cut -c1-250
cd $OUT && tar czf r5.tgz r5 && rm -rf r5
