#!/bin/bash
# Decode batches: the routed experts as grouped GEMMs (batch_decode_grouped) against the fused
# per-token decode kernels. Not adopted: to run it again, apply batch_decode_grouped.patch to
# 438905a (it adds scripts/gpu_decode_batches.py too). Builds of that tree
# (build/r26/lite: V2-Lite q4f16_g128 random weights; build/r26/gpu: the tiny configs + HF
# float32 references, scripts/make_gpu_refs.py). Carry .devcarry, build/r26/lite, build/r26/src,
# build/r26/gpu. (gpu_numerics.json here: its forced_batch on an Engine(..., grouped_decode_from=1).)
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r26/src:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=build/r26/lite; L=.devcarry/tvm-lib
python3 -P scripts/gpu_numerics.py --builds build/r26/gpu --lib-dir $L --out $OUT/gpu_numerics.json 2>&1 | tail -4
python3 -P scripts/gpu_decode_batches.py $B --lib-dir $L --out $OUT 2>&1 | cut -c1-400
