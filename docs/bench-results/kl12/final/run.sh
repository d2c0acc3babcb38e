#!/bin/bash
# final measurement of this change (builds in build/r22/{lite,gpu,src} from the working tree of
# the commit), replay A/B against the kernels of 2535af0 (build/r17/bench)
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
B=build/r22/lite; A=build/r17/bench/v2-lite-q4f16_g128; L=.devcarry/tvm-lib
export PYTHONPATH=$PWD/build/r22/src:$PWD/.site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/final; mkdir -p $R
python3 -P scripts/gpu_graph_check.py $B --lib-dir $L --out $R 2>&1 | tail -1 | cut -c1-200
python3 -P scripts/gpu_numerics.py --builds build/r22/gpu --lib-dir $L --out $R/gpu_numerics.json 2>&1 | tail -3
python3 -P scripts/gpu_v2lite_numerics.py --build $B --lib-dir $L --out $R/v2lite-q4f16_g128.json 2>&1 | grep -i "max_abs_diff\|top1" | tr '\n' ' '; echo
for i in 1 2; do
  PYTHONPATH=$PWD/build/r17/bench/src:$PWD/.site python3 -P scripts/gpu_step_overhead.py $A --lib-dir $L --out $R/so-2535af0-$i --replays 2000 > /dev/null 2>&1
  python3 -P scripts/gpu_step_overhead.py $B --lib-dir $L --out $R/so-new-$i --replays 2000 > /dev/null 2>&1
  for v in 2535af0 new; do python3 -c "import json;d=json.load(open('$R/so-$v-$i/step_overhead.json'));print('$v $i', round(d['replay_us'],1))"; done
done
for i in 1 2; do python3 -P -m dsv2_mlc.cli bench $B --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 3 --compare-hf --hf-decode-tokens 32 --lib-dir $L --json $R/bench4k-$i.json 2>&1 | grep -i "^prefill\|^decode:\|^roofline\|^memory\|^HF transformers" ; done
python3 -P -m dsv2_mlc.cli bench $B --prompt-len 512 --gen-len 128 --warmup 1 --repeat 5 --lib-dir $L --json $R/bench512-1.json 2>&1 | grep -i "^prefill\|^decode:\|^memory"
cd $OUT && tar czf final.tgz final && rm -rf final
