#!/bin/bash
# Review mend of abc02eb (the split kernel writes ws_n in one place, after every path's wait; the
# MLA prologue derives its tile indices once): its default build (build/r45/lite) against
# abc02eb's (build/r44/lite), both `dsv2-mlc compile ../shared/notes/configs/config_v2_lite.json
# --random-weights -o OUT --device cuda --quantization q4f16_g128`, model.so carried
# xz-compressed. Replays at ~4,000 (twice, alternating) and ~500, V2-Lite logits (128-token
# prompt) of both compared, the graph check, bench at 4K. Carry .devcarry, build/r43/src,
# build/r44, build/r45.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib
declare -A B=([abc02eb]=build/r44/lite [mend]=build/r45/lite)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r43/src:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for d in "${B[@]}"; do
  python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" $d/model.so.xz $d/model.so
done
R=$OUT/review; mkdir -p $R
so() {  # build, tag, prompt length
  python3 -P scripts/gpu_step_overhead.py ${B[$1]} --lib-dir $L --out $R/so-$1-$2 --replays 2000 \
    --prompt-len $3 > $R/so-$1-$2.log 2>&1 || tail -3 $R/so-$1-$2.log
  python3 -c "import json;d=json.load(open('$R/so-$1-$2/step_overhead.json'));print('$1 $2', round(d['replay_us'],1))"
}
for t in "4k1 4000" "512 500" "4k2 4000"; do for v in abc02eb mend; do so $v $t; done; done
for v in abc02eb mend; do
  timeout 200 python3 -P scripts/gpu_v2lite_numerics.py --build ${B[$v]} --lib-dir $L \
    --out $R/v2lite-$v.json --save-logits $R/logits-$v.npy > $R/v2lite-$v.log 2>&1 || tail -3 $R/v2lite-$v.log
done
python3 -c "
import numpy as np
a, b = np.load('$R/logits-abc02eb.npy'), np.load('$R/logits-mend.npy')  # [batch, steps, vocab]
print('mend vs abc02eb: max |diff|', float(np.abs(a - b).max()), 'argmax equal', int((a.argmax(-1) == b.argmax(-1)).sum()), 'of', a.shape[1])"
rm -f $R/logits-*.npy
timeout 240 python3 -P scripts/gpu_graph_check.py ${B[mend]} --lib-dir $L --out $R/gc 2>&1 | grep "^OK\|^MISMATCH\|rror" | cut -c1-200
for v in abc02eb mend; do
  python3 -P -m dsv2_mlc.cli bench ${B[$v]} --lib-dir $L --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 2 \
    --json $R/bench-$v-4096.json 2>&1 | grep "^decode:\|rror" | sed "s/^/$v /"
done
tar czf $OUT/review.tgz -C $OUT review && rm -rf $OUT/review
