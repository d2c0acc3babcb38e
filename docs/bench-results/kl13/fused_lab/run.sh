#!/bin/bash
# The one-kernel MoE decode (schedules/moe_fused_decode_cuda.py) against the default gate/up +
# down pair, V2-Lite shape, lab libraries of build/lab_mf (kernel_lab_moe_decode.py prepare --only).
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/fused_lab; mkdir -p $R
python3 -P scripts/kernel_lab_moe_decode.py run --lab-dir build/lab_mf --lib-dir .devcarry/tvm-lib \
  --out $R 2>&1 | tee $R/log.txt | grep -v "^ *$"
