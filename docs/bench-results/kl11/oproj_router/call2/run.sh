#!/bin/bash
# second call: the tail's loads in one round trip; fence + atomicAdd (build/r19/lite) vs one
# acq_rel atomic (build/r19b/lite) vs the kernels of 78fbc03 / dab93cd (build/r17/bench)
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
A=build/r17/bench/v2-lite-q4f16_g128; B=build/r19/lite; C=build/r19b/lite; L=.devcarry/tvm-lib
SA=$PWD/build/r17/bench/src; SB=$PWD/build/r19b/src
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/oproj_router2; mkdir -p $R
export PYTHONPATH=$SB:$PWD/.site
python3 -P scripts/gpu_numerics.py --builds build/r19/gpu --lib-dir $L --out $R/gpu_numerics.json 2>&1 | tail -3
python3 -P scripts/gpu_v2lite_numerics.py --build $C --lib-dir $L --out $R/v2lite-q4f16_g128.json 2>&1 | grep -i "max_abs_diff\|top1" | tr '\n' ' '; echo
python3 -P scripts/gpu_graph_check.py $C --lib-dir $L --out $R 2>&1 | tail -1 | cut -c1-200
for i in 1 2; do
  PYTHONPATH=$SA:$PWD/.site python3 -P scripts/gpu_step_overhead.py $A --lib-dir $L --out $R/so-base-$i --replays 2000 2>&1 | tail -1 | cut -c1-120 | sed "s/^/base /"
  python3 -P scripts/gpu_step_overhead.py $B --lib-dir $L --out $R/so-fence-$i --replays 2000 2>&1 | tail -1 | cut -c1-120 | sed "s/^/fence /"
  python3 -P scripts/gpu_step_overhead.py $C --lib-dir $L --out $R/so-acqrel-$i --replays 2000 2>&1 | tail -1 | cut -c1-120 | sed "s/^/acqrel /"
done
for f in $R/so-*/step_overhead.json; do python3 -c "import json;d=json.load(open('$f'));print('$f'.split('/')[-2], round(d['replay_us'],1))"; done
python3 -P scripts/gpu_kernel_profile.py $B --lib-dir $L --out $R/prof-fence --prompt-len 4096 --steps 4 --graph > /dev/null 2>&1
python3 -P scripts/gpu_kernel_profile.py $C --lib-dir $L --out $R/prof-acqrel --prompt-len 4096 --steps 4 --graph > /dev/null 2>&1
for b in fence acqrel; do python3 -c "
import json;d=json.load(open('$R/prof-$b/kernel_profile.json'))
for r in d['chain']['rows']:
  if any(k in r['kernel'] for k in ('oproj','gate_up','down','o_proj','router')): print('$b', r['kernel'], round(r['mean_us'],2), round(r['mean_increment_us'],2))"; done
for i in 1 2; do
  PYTHONPATH=$SA:$PWD/.site python3 -P -m dsv2_mlc.cli bench $A --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 3 --lib-dir $L --json $R/bench4k-base-$i.json 2>&1 | grep -i "^decode:" | sed "s/^/base /"
  python3 -P -m dsv2_mlc.cli bench $C --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 3 --lib-dir $L --json $R/bench4k-acqrel-$i.json 2>&1 | grep -i "^decode:" | sed "s/^/acqrel /"
done
cd $OUT && tar czf oproj_router2.tgz oproj_router2 && rm -rf oproj_router2
