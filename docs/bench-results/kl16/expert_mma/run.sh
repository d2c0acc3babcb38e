#!/bin/bash
# The tensor-core expert-major MoE decode kernels (schedules/moe_expert_mma_cuda.py, df04e11)
# wired as the second decode entry point of docs/bench-results/kl15/expert_major/ (apply
# expert_major_wiring.patch on df04e11, then in passes/quantize_int4.py import
# expert_mma_unsupported / moe_gate_up_expert_mma / moe_down_expert_mma from
# ..schedules.moe_expert_mma_cuda under the patch's three names), built as build/r33/lite
# (config_v2_lite.json, --random-weights, cuda, q4f16_g128), the patched source in build/r33/src,
# scripts/gpu_decode_batches.py (from the patch) in build/r33/. Carry .devcarry, build/r33.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
R=${R:-build/r33}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/$R/src:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=$R/lite; L=.devcarry/tvm-lib
O=$OUT/expert_mma-$(basename $R); mkdir -p $O
python3 -P $R/gpu_decode_batches.py $B --lib-dir $L --out $O --batches ${BATCHES:-1,2,4,8,16,31} > $O/log.txt 2>&1
python3 -c "
import json
for r in json.load(open('$O/decode_batches.json'))['runs']:
    print('$R', r['batch'], 'token', round(r['token']['tok_s_median'], 1), 'expert',
          round(r['expert']['tok_s_median'], 1), r['check'])"
