#!/bin/bash
# final measurement of 78fbc03 (clean checkout builds in build/r17/{bench,gpu}); greedy-graph replay A/B against a46a20d's kernels (build/h)
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
B=build/r17/bench/v2-lite-q4f16_g128; L=.devcarry/tvm-lib
export PYTHONPATH=$PWD/build/r17/bench/src:$PWD/.site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/78fbc03; mkdir -p $R
python3 -P scripts/gpu_argmax_check.py $B --lib-dir $L --out $R 2>&1 | tail -1
python3 -P scripts/gpu_numerics.py --builds build/r17/gpu --lib-dir $L --out $R/gpu_numerics.json 2>&1 | tail -3
python3 -P scripts/gpu_v2lite_numerics.py --build $B --lib-dir $L --out $R/v2lite-q4f16_g128.json 2>&1 | grep -i "max_abs_diff\|top1" | tr '\n' ' '; echo
python3 -P scripts/gpu_graph_check.py $B --lib-dir $L --out $R 2>&1 | tail -1
for i in 1 2; do
  PYTHONPATH=$PWD/build/h/src-head:$PWD/.site python3 -P scripts/gpu_step_overhead.py build/h/lite --lib-dir $L --out $R/so-a46a20d-$i --replays 2000 2>&1 | tail -1 | cut -c1-330 | sed "s/^/a46a20d /"
  python3 -P scripts/gpu_step_overhead.py $B --lib-dir $L --out $R/so-78fbc03-$i --replays 2000 2>&1 | tail -1 | cut -c1-330 | sed "s/^/78fbc03 /"
done
for i in 1 2; do python3 -P -m dsv2_mlc.cli bench $B --prompt-len 512 --gen-len 128 --warmup 1 --repeat 5 --lib-dir $L --json $R/bench512-$i.json 2>&1 | grep -i "^prefill\|^decode:\|^memory" ; done
for i in 1 2 3; do python3 -P -m dsv2_mlc.cli bench $B --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 3 --compare-hf --hf-decode-tokens 32 --lib-dir $L --json $R/bench4k-$i.json 2>&1 | grep -i "^prefill\|^decode:\|^roofline\|^memory\|^HF transformers" ; done
cd $OUT && tar czf 78fbc03.tgz 78fbc03 && rm -rf 78fbc03
