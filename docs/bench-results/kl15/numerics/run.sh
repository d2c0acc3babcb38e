#!/bin/bash
# GPU numerics of the tiny configs with the batched teacher-forced check (forced_batch: 4
# sequences a step through the default decode path). Builds of 438905a's tree with
# scripts/gpu_numerics.py's forced_batch (python scripts/make_gpu_refs.py --out build/r27/gpu
# --quantizations q4f16_g32). Carry .devcarry, build/r27/gpu, build/r27/src.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r27/src:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -P scripts/gpu_numerics.py --builds build/r27/gpu --lib-dir .devcarry/tvm-lib --out $OUT/gpu_numerics.json 2>&1 | tail -4
