#!/bin/bash
# third call: the o_proj + router kernel releasing its dependents at exit (build/r20/lite) vs the
# acq_rel build (build/r19b/lite) vs the kernels of 78fbc03 / dab93cd (build/r17/bench)
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
A=build/r17/bench/v2-lite-q4f16_g128; B=build/r19b/lite; C=build/r20/lite; L=.devcarry/tvm-lib
SA=$PWD/build/r17/bench/src; SB=$PWD/build/r19b/src
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/oproj_router3; mkdir -p $R
export PYTHONPATH=$SB:$PWD/.site
python3 -P scripts/gpu_graph_check.py $C --lib-dir $L --out $R 2>&1 | tail -1 | cut -c1-200
for i in 1 2; do
  PYTHONPATH=$SA:$PWD/.site python3 -P scripts/gpu_step_overhead.py $A --lib-dir $L --out $R/so-base-$i --replays 2000 > /dev/null 2>&1
  python3 -P scripts/gpu_step_overhead.py $B --lib-dir $L --out $R/so-acqrel-$i --replays 2000 > /dev/null 2>&1
  python3 -P scripts/gpu_step_overhead.py $C --lib-dir $L --out $R/so-exit-$i --replays 2000 > /dev/null 2>&1
done
for f in $R/so-*/step_overhead.json; do python3 -c "import json;d=json.load(open('$f'));print('$f'.split('/')[-2], round(d['replay_us'],1))"; done
python3 -P scripts/gpu_kernel_profile.py $C --lib-dir $L --out $R/prof-exit --prompt-len 4096 --steps 4 --graph > /dev/null 2>&1
PYTHONPATH=$SA:$PWD/.site python3 -P scripts/gpu_kernel_profile.py $A --lib-dir $L --out $R/prof-base --prompt-len 4096 --steps 4 --graph > /dev/null 2>&1
for b in exit base; do python3 -c "
import json;d=json.load(open('$R/prof-$b/kernel_profile.json'))
for r in d['chain']['rows']:
  if any(k in r['kernel'] for k in ('oproj','gate_up','down','o_proj','router','absorb')): print('$b', r['kernel'], round(r['mean_us'],2), round(r['mean_increment_us'],2))"; done
cd $OUT && tar czf oproj_router3.tgz oproj_router3 && rm -rf oproj_router3
