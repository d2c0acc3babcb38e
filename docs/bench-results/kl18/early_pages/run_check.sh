#!/bin/bash
# Run as V=build/r43/ep (early pages + the prologue preload, the adopted pair). (As run, the
# last print said "of 1": it counted the batch, not the 64 steps; fixed since.)
# The chosen variant V (default build/r43/e3) against base (build/r42/lite): V2-Lite logits
# against HF fp16 after a 128-token and a 2,100-token prompt and against base's (same greedy
# steps), the graph check, bench at prompt 4096 (two processes each, alternating; the last of V's
# with --compare-hf) and at 512. Carry .devcarry, build/r42/{lite,src}, build/r43.
V=${V:-build/r43/e3}
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib; S=$PWD/build/r43/src
declare -A B=([base]=build/r42/lite [new]=$V)
export PYTHONUNBUFFERED=1 PYTHONPATH=$S:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for v in "${!B[@]}"; do
  d=${B[$v]}; [ -f $d/model.so ] || python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" $d/model.so.xz $d/model.so
done
R=$OUT/check; mkdir -p $R
for p in 128 2100; do for v in base new; do
  timeout 200 python3 -P scripts/gpu_v2lite_numerics.py --build ${B[$v]} --lib-dir $L --prompt-len $p \
    --out $R/v2lite-$v-$p.json --save-logits $R/logits-$v-$p.npy > $R/v2lite-$v-$p.log 2>&1 || tail -3 $R/v2lite-$v-$p.log
  python3 -c "
import json; r=json.load(open('$R/v2lite-$v-$p.json'))
print('$v $p', 'max', r['max_abs_diff'], 'median', r['median_step_max_abs_diff'], 'top1', r['top1_agreement'])"
done
python3 -c "
import numpy as np
a, b = np.load('$R/logits-base-$p.npy'), np.load('$R/logits-new-$p.npy')  # [batch, steps, vocab]
print('$p new vs base: max |diff|', float(np.abs(a - b).max()), 'argmax equal', int((a.argmax(-1) == b.argmax(-1)).sum()), 'of', a.shape[1])"
done
rm -f $R/logits-*.npy
timeout 240 python3 -P scripts/gpu_graph_check.py ${B[new]} --lib-dir $L --out $R/gc 2>&1 | grep "^OK\|^MISMATCH\|rror" | cut -c1-300
for i in 1 2; do for v in base new; do
  python3 -P -m dsv2_mlc.cli bench ${B[$v]} --lib-dir $L --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 2 \
    --json $R/bench-$v-4096-$i.json 2>&1 | grep "^decode:\|^prefill\|rror" | sed "s/^/$v $i /"
done; done
python3 -P -m dsv2_mlc.cli bench ${B[new]} --lib-dir $L --prompt-len 512 --gen-len 128 --warmup 1 --repeat 2 \
  --json $R/bench-new-512.json 2>&1 | grep "^decode:\|^prefill\|^memory\|rror" | sed "s/^/new 512 /"
timeout 280 python3 -P -m dsv2_mlc.cli bench ${B[new]} --lib-dir $L --prompt-len 4096 --gen-len 128 --warmup 1 \
  --repeat 2 --compare-hf --json $R/bench-new-4096-hf.json 2>&1 | grep -v "^\s*$" | tail -14
tar czf $OUT/check.tgz -C $OUT check && rm -rf $OUT/check
