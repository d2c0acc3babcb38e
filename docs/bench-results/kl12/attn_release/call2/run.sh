#!/bin/bash
# second call: E = our KV append releasing first + the split kernel waiting/releasing itself after
# its preamble and L2 page prefetches (the merge released at exit, as before), against C (= E with
# the merge releasing after its wait too) and base (the kernels of 2535af0, build/r17/bench).
# Graph check of E, replays alternating, bench at 4K, V2-Lite logits of E vs base vs HF, profile.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib; S=$PWD/build/r17/bench/src
declare -A B=([base]=build/r17/bench/v2-lite-q4f16_g128 [C]=build/r21/C [E]=build/r21/E)
export PYTHONUNBUFFERED=1 PYTHONPATH=$S:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/attn_release2; mkdir -p $R
python3 -P scripts/gpu_graph_check.py ${B[E]} --lib-dir $L --out $R/gc-E 2>&1 | tail -1 | cut -c1-200
for i in 1 2; do for v in base C E; do
  python3 -P scripts/gpu_step_overhead.py ${B[$v]} --lib-dir $L --out $R/so-$v-$i --replays 2000 > /dev/null 2>&1
  python3 -c "import json;d=json.load(open('$R/so-$v-$i/step_overhead.json'));print('$v $i', round(d['replay_us'],1))"
done; done
for i in 1 2; do for v in base E; do
  python3 -P -m dsv2_mlc.cli bench ${B[$v]} --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 3 --lib-dir $L --json $R/bench4k-$v-$i.json 2>&1 | grep -i "^decode:" | sed "s/^/$v /"
done; done
for v in base E; do
  python3 -P scripts/gpu_v2lite_numerics.py --build ${B[$v]} --lib-dir $L --out $R/v2lite-$v.json --save-logits /tmp/logits-$v.npy 2>&1 | grep -i "max_abs_diff\|top1" | tr '\n' ' ' | sed "s/^/$v /"; echo
done
python3 -c "import numpy as np;a=np.load('/tmp/logits-base.npy');b=np.load('/tmp/logits-E.npy');print('E vs base logits: identical', bool(np.array_equal(a,b)), 'max diff', float(np.abs(a-b).max()))"
python3 -P scripts/gpu_kernel_profile.py ${B[E]} --lib-dir $L --out $R/prof-E --prompt-len 4096 --steps 4 --graph > /dev/null 2>&1
python3 -c "
import json;d=json.load(open('$R/prof-E/kernel_profile.json'))
for r in d['chain']['rows']:
  if r['calls_per'] >= 26: print('E', r['kernel'][:40], round(r['mean_us'],2), round(r['mean_increment_us'],2))"
cd $OUT && tar czf attn_release2.tgz attn_release2 && rm -rf attn_release2
