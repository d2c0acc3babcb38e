#!/bin/bash
# final measurement of cdfc158 (clean checkout builds in build/r16/{bench,gpu}); replay A/B against 12443b7's kernels (build/r12/ctl)
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
B=build/r16/bench/v2-lite-q4f16_g128; L=.devcarry/tvm-lib
export PYTHONPATH=$PWD/build/r16/bench/src:$PWD/.site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/cdfc158; mkdir -p $R
python3 -P scripts/gpu_numerics.py --builds build/r16/gpu --lib-dir $L --out $R/gpu_numerics.json 2>&1 | tail -3
python3 -P scripts/gpu_v2lite_numerics.py --build $B --lib-dir $L --out $R/v2lite-q4f16_g128.json 2>&1 | grep -i "max_abs_diff\|top1" | tr '\n' ' '; echo
python3 -P scripts/gpu_v2lite_numerics.py --build $B --lib-dir $L --prompt-len 3000 --steps 16 --out $R/v2lite-p3000.json 2>&1 | grep -i "max_abs_diff\|top1" | tr '\n' ' '; echo
python3 -P scripts/gpu_graph_check.py $B --lib-dir $L --out $R 2>&1 | tail -1
for i in 1 2; do
  PYTHONPATH=$PWD/build/r12/ctl/src:$PWD/.site python3 -P scripts/gpu_pdl_check.py build/r12/ctl/lite --lib-dir $L --out $R/pdl-12443b7-$i --variants programmatic --prompt-len 4000 --steps 40 --replays 2000 --checked-replays 20 2>&1 | tail -1 | sed "s/^/12443b7 /"
  python3 -P scripts/gpu_pdl_check.py $B --lib-dir $L --out $R/pdl-cdfc158-$i --variants programmatic --prompt-len 4000 --steps 40 --replays 2000 --checked-replays 20 2>&1 | tail -1 | sed "s/^/cdfc158 /"
done
for i in 1 2; do python3 -P -m dsv2_mlc.cli bench $B --prompt-len 512 --gen-len 128 --warmup 1 --repeat 5 --lib-dir $L --json $R/bench512-$i.json 2>&1 | grep -i "^prefill\|^decode:\|^memory" ; done
for i in 1 2 3; do python3 -P -m dsv2_mlc.cli bench $B --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 3 --compare-hf --hf-decode-tokens 32 --lib-dir $L --json $R/bench4k-$i.json 2>&1 | grep -i "^prefill\|^decode:\|^roofline\|^memory\|^HF transformers" ; done
cd $OUT && tar czf cdfc158.tgz cdfc158 && rm -rf cdfc158
