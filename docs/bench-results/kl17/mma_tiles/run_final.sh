#!/bin/bash
# The adopted tiles as the default build (R, default build/r42: `dsv2-mlc compile
# ../shared/notes/configs/config_v2_lite.json --random-weights -o $R/lite --device cuda
# --quantization q4f16_g128`, model.so carried xz-compressed; $R/src the runtime, $R/src-gc the same
# with EXPERT_MAJOR_FROM = 2): decode batches token- vs expert-major, bench at batch 31 / 16 / 8
# (the engine's threshold, and 8 with --expert-major-from 8), the graph check with the threshold
# at 2, V2-Lite logits at batch 16 through the expert-major kernels against HF fp16.
# B= another build folder (the call that picked the tiles: run_pick.sh). Carry .devcarry, $R.
R=${R:-build/r42}
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/$R/src:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
L=.devcarry/tvm-lib; B=${B:-$R/lite}; O=$OUT/final; mkdir -p $O
[ -f $B/model.so ] || python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" $B/model.so.xz $B/model.so
timeout 300 python3 -P scripts/gpu_decode_batches.py $B --lib-dir $L --out $O \
  --batches ${BATCHES:-1,2,4,8,16,31} > $O/batches-log.txt 2>&1 || tail -3 $O/batches-log.txt
python3 -c "
import json
for r in json.load(open('$O/decode_batches.json'))['runs']:
    print(r['batch'], 'token', round(r['token']['tok_s_median'], 1), 'expert',
          round(r['expert']['tok_s_median'], 1), r['check'])"
for b in 31 16; do
  python3 -P -m dsv2_mlc.cli bench $B --lib-dir $L --batch $b --prompt-len 1024 --gen-len 128 \
    --warmup 1 --repeat 2 --json $O/bench-b$b-1024.json 2>&1 | grep "^decode\|rror"
done
python3 -P -m dsv2_mlc.cli bench $B --lib-dir $L --batch 8 --prompt-len 1024 --gen-len 128 \
  --warmup 1 --repeat 2 --expert-major-from 8 --json $O/bench-b8-1024-em8.json 2>&1 | grep "^decode\|rror"
timeout 200 python3 -P scripts/gpu_v2lite_numerics.py --build $B --lib-dir $L --batch 16 --steps 64 \
  --out $O/v2lite-b16-expert.json > $O/v2lite-log.txt 2>&1 || tail -3 $O/v2lite-log.txt
python3 -c "
import json; r=json.load(open('$O/v2lite-b16-expert.json'))
print('v2lite b16 from', r['expert_major_from'], 'max', r['max_abs_diff'], 'median', r['median_step_max_abs_diff'],
      'top1', r['top1_agreement'], 'margins', sorted(d['hf_top2_margin'] for d in r['disagreements'])[-3:])"
PYTHONPATH=$PWD/$R/src-gc:$PWD/.site timeout 240 python3 -P scripts/gpu_graph_check.py $B --lib-dir $L \
  --out $O/gc 2>&1 | grep "^OK\|^MISMATCH\|batch2\|rror" | cut -c1-300
tar czf $OUT/final.tgz -C $OUT final && rm -rf $OUT/final
