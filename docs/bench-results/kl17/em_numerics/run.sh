#!/bin/bash
# V2-Lite logits through the expert-major entry point against HF fp16 (the same random weights),
# and CUPTI profiles of expert-major decode steps at batch 16 and 31. build/r38 = 42f3e7c's tree
# (V2-Lite q4f16_g128, --random-weights, cuda). Carry .devcarry, build/r38/{lite,src}.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r38/src:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=build/r38/lite; L=.devcarry/tvm-lib; O=$OUT/em_numerics; mkdir -p $O
summ() { python3 -c "
import json,sys; r=json.load(open(sys.argv[1]))
print(sys.argv[1].split('/')[-1], 'batch', r['batch'], 'from', r['expert_major_from'], 'max', round(r['max_abs_diff'],4),
      'median', round(r['median_step_max_abs_diff'],4), 'top1', r['top1_agreement'], 'dis', r['disagreements'][:6], 'ours_s', round(r['ours_s'],1), 'hf_s', round(r['hf_s'],1))" $1; }
for cfg in "16 16 b16-expert" "16 0 b16-token" "1 1 b1-expert"; do
  set -- $cfg
  timeout 200 python3 -P scripts/gpu_v2lite_numerics.py --build $B --lib-dir $L --batch $1 \
    --expert-major-from $2 --steps 64 --out $O/v2lite-$3.json > $O/log-$3.txt 2>&1 || tail -5 $O/log-$3.txt
  summ $O/v2lite-$3.json
done
for b in 16 31; do
  timeout 150 python3 -P scripts/gpu_kernel_profile.py $B --lib-dir $L --out $O/prof-b$b --batch $b \
    --prompt-len 1024 --prefill-len 1024 --steps 4 --top 25 > $O/prof-b$b.txt 2>&1 || tail -5 $O/prof-b$b.txt
  grep -A28 "== decode" $O/prof-b$b.txt | head -32
done
