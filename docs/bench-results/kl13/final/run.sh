#!/bin/bash
# The two-tier pages per split (rows past 128 pages: >= 4 pages a split): new = the working tree's
# default (build/r24/lite, src build/r24/src), base = 215b194's kernels (build/r22/lite). Replays
# at ~4,000 (twice), ~500 and ~8,000 tokens, alternating; graph check; V2-Lite logits vs HF at a
# 2,100-token prompt (past the tier: new vs base) and at 128 (below it); tiny configs vs HF; bench.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib
declare -A B=([base]=build/r22/lite [new]=build/r24/lite) SRC=([base]=build/r22/src [new]=build/r24/src)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/final; mkdir -p $R
py() { PYTHONPATH=$PWD/${SRC[$1]}:$PWD/.site python3 -P "${@:2}"; }
so() {  # build, tag, prompt length
  py $1 scripts/gpu_step_overhead.py ${B[$1]} --lib-dir $L --out $R/so-$1-$2 --replays 2000 --prompt-len $3 > /dev/null 2>&1
  python3 -c "import json;d=json.load(open('$R/so-$1-$2/step_overhead.json'));print('$1 $2', round(d['replay_us'],1))"
}
for t in "4k1 4000" "512 500" "4k2 4000" "8k 8000"; do for v in base new; do so $v $t; done; done
py new scripts/gpu_graph_check.py ${B[new]} --lib-dir $L --out $R/gc-new 2>&1 | tail -1 | cut -c1-160
for v in base new; do
  py $v scripts/gpu_v2lite_numerics.py --build ${B[$v]} --lib-dir $L --prompt-len 2100 --out $R/v2lite-2100-$v.json \
    --save-logits $R/logits-$v.npy 2>&1 | grep -i "max_abs_diff\|top1" | tr '\n' ' ' | sed "s/^/$v 2100 /"; echo
done
python3 -c "
import numpy as np
a, b = np.load('$R/logits-base.npy'), np.load('$R/logits-new.npy')
print('new vs base (2100): max |diff|', float(np.abs(a - b).max()), 'same top-1', int((a.argmax(-1) == b.argmax(-1)).sum()), 'of', len(a))"
rm -f $R/logits-*.npy
py new scripts/gpu_v2lite_numerics.py --build ${B[new]} --lib-dir $L --out $R/v2lite-128-new.json 2>&1 | grep -i "max_abs_diff\|top1" | tr '\n' ' '; echo
py new scripts/gpu_numerics.py --builds build/r24/gpu --lib-dir $L --out $R/gpu_numerics.json 2>&1 | tail -3
py new -m dsv2_mlc.cli bench ${B[new]} --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 3 --compare-hf --hf-decode-tokens 32 --lib-dir $L --json $R/bench4k.json 2>&1 | grep -i "^prefill\|^decode:\|^roofline\|^memory\|^HF transformers"
py new -m dsv2_mlc.cli bench ${B[new]} --prompt-len 512 --gen-len 128 --warmup 1 --repeat 5 --lib-dir $L --json $R/bench512.json 2>&1 | grep -i "^prefill\|^decode:\|^memory"
