#!/bin/bash
# the attention chain's releases: A = our KV append releasing before its wait, B = A + the split
# and merge kernels waiting/releasing themselves, C = B + the split's pages asked of L2 before its
# wait; base = the kernels of 2535af0 (build/r17/bench). Graph check of each, replays alternating,
# per-kernel profile of base and C.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib; S=$PWD/build/r17/bench/src
declare -A B=([base]=build/r17/bench/v2-lite-q4f16_g128 [A]=build/r21/A [B]=build/r21/B [C]=build/r21/C)
export PYTHONUNBUFFERED=1 PYTHONPATH=$S:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/attn_release; mkdir -p $R
for v in A B C; do
  python3 -P scripts/gpu_graph_check.py ${B[$v]} --lib-dir $L --out $R/gc-$v 2>&1 | tail -1 | cut -c1-200 | sed "s/^/$v /"
done
for i in 1 2; do for v in base A B C; do
  python3 -P scripts/gpu_step_overhead.py ${B[$v]} --lib-dir $L --out $R/so-$v-$i --replays 2000 > /dev/null 2>&1
  python3 -c "import json;d=json.load(open('$R/so-$v-$i/step_overhead.json'));print('$v $i', round(d['replay_us'],1))"
done; done
for v in base C; do
  python3 -P scripts/gpu_kernel_profile.py ${B[$v]} --lib-dir $L --out $R/prof-$v --prompt-len 4096 --steps 4 --graph > /dev/null 2>&1
  python3 -c "
import json;d=json.load(open('$R/prof-$v/kernel_profile.json'))
for r in d['chain']['rows']:
  if r['calls_per'] >= 26: print('$v', r['kernel'][:40], round(r['mean_us'],2), round(r['mean_increment_us'],2))"
done
cd $OUT && tar czf attn_release.tgz attn_release && rm -rf attn_release
