#!/bin/bash
# third call: E (the second call's winner) with the merge's lse prefetch (G), with 4-page splits on
# the 128 / 264 grid and 5 stages (J; on E's grid, K, was built but left out: the carry limit),
# against base (build/r17/bench). Graph
# checks, replays alternating, V2-Lite logits vs base and HF, bench at 4K of E and the fastest.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib; S=$PWD/build/r17/bench/src
declare -A B=([base]=build/r17/bench/v2-lite-q4f16_g128 [E]=build/r21/E [G]=build/r21/G [J]=build/r21/J)
export PYTHONUNBUFFERED=1 PYTHONPATH=$S:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/attn_release3; mkdir -p $R
for v in G J; do
  python3 -P scripts/gpu_graph_check.py ${B[$v]} --lib-dir $L --out $R/gc-$v 2>&1 | tail -1 | cut -c1-120 | sed "s/^/$v /"
done
for i in 1 2; do for v in base E G J; do
  python3 -P scripts/gpu_step_overhead.py ${B[$v]} --lib-dir $L --out $R/so-$v-$i --replays 2000 > /dev/null 2>&1
  python3 -c "import json;d=json.load(open('$R/so-$v-$i/step_overhead.json'));print('$v $i', round(d['replay_us'],1))"
done; done
for v in base G J; do
  python3 -P scripts/gpu_v2lite_numerics.py --build ${B[$v]} --lib-dir $L --out $R/v2lite-$v.json --save-logits /tmp/logits-$v.npy 2>&1 | grep -i "max_abs_diff\|top1" | tr '\n' ' ' | sed "s/^/$v /"; echo
done
python3 -c "
import numpy as np;a=np.load('/tmp/logits-base.npy')
for v in 'GJ': b=np.load(f'/tmp/logits-{v}.npy');print(v, 'vs base logits: identical', bool(np.array_equal(a,b)), 'max diff', float(np.abs(a-b).max()))"
W=$(python3 -c "
import json;r={v:json.load(open(f'$R/so-{v}-2/step_overhead.json'))['replay_us'] for v in 'GJ'};print(min(r,key=r.get))")
for v in E $W; do
  python3 -P -m dsv2_mlc.cli bench ${B[$v]} --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 3 --lib-dir $L --json $R/bench4k-$v.json 2>&1 | grep -i "^decode:" | sed "s/^/$v /"
done
cd $OUT && tar czf attn_release3.tgz attn_release3 && rm -rf attn_release3
