#!/bin/bash
# The attention's pages per split: base = 215b194's kernels (build/r22/lite, at least 2 pages a
# split), K4 / K8 = the same with min_pages_per_split 4 / 8 (build/r23/K4, K8, from
# docs/bench-results/kl12/attn_release/build.py release_first "{'min_pages_per_split': N}" OUT).
# Decode graph replays at context ~4,000 (twice, alternating) and ~512, the graph check and the
# V2-Lite logits of each (against HF and against base's).
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib; S=$PWD/build/r22/src
declare -A B=([base]=build/r22/lite [K4]=build/r23/K4 [K8]=build/r23/K8)
export PYTHONUNBUFFERED=1 PYTHONPATH=$S:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/split_pages; mkdir -p $R
so() {  # build, tag, prompt length
  python3 -P scripts/gpu_step_overhead.py ${B[$1]} --lib-dir $L --out $R/so-$1-$2 --replays 2000 \
    --prompt-len $3 > /dev/null 2>&1
  python3 -c "import json;d=json.load(open('$R/so-$1-$2/step_overhead.json'));print('$1 $2', round(d['replay_us'],1))"
}
for i in 1 2; do for v in base K4 K8; do so $v 4k$i 4000; done; done
for v in base K4 K8; do so $v 512 500; done
for v in K4 K8; do
  python3 -P scripts/gpu_graph_check.py ${B[$v]} --lib-dir $L --out $R/gc-$v 2>&1 | tail -1 | cut -c1-160 | sed "s/^/$v /"
done
for v in base K4 K8; do
  python3 -P scripts/gpu_v2lite_numerics.py --build ${B[$v]} --lib-dir $L --out $R/v2lite-$v.json \
    --save-logits $R/logits-$v.npy 2>&1 | grep -i "max_abs_diff\|top1" | tr '\n' ' ' | sed "s/^/$v /"; echo
done
python3 -c "
import numpy as np
a = np.load('$R/logits-base.npy')
for v in ('K4', 'K8'):
    b = np.load(f'$R/logits-{v}.npy')
    print(v, 'vs base: max |diff|', float(np.abs(a - b).max()), 'top-1 equal', int((a.argmax(-1) == b.argmax(-1)).sum()), 'of', a.shape[0])"
rm -f $R/logits-*.npy
