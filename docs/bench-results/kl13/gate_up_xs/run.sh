#!/bin/bash
# The gate/up kernel with each warp's x in shared memory (GateUpTiles.x_shared) at 2-4 blocks an
# SM, against the default; lab libraries of build/lab_gx (kernel_lab_moe_decode.py prepare --only),
# the lab run twice.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/gate_up_xs; mkdir -p $R/run1 $R/run2
for i in 1 2; do
  python3 -P scripts/kernel_lab_moe_decode.py run --lab-dir build/lab_gx --lib-dir .devcarry/tvm-lib \
    --out $R/run$i 2>&1 | tee $R/run$i/log.txt | grep -v "^ *$\|Warn\|warn_once"
done
