#!/bin/bash
# The rebuilt CUDA artifact of the default model (dist/), pulled into an empty cache and chatting
# on the H200 with only apache-tvm-ffi installed (the runtime from build/r25/src, no compiler).
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r25/src:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import importlib.util as u; print('tvm importable:', u.find_spec('tvm') is not None)"
python3 -P -m dsv2_mlc.cli pull dsv2-coder-tiny-q4f16_g32-cuda-sm_90 --index dist/index.json --cache-dir /tmp/empty-cache --quiet
DSV2_MLC_CACHE_DIR=/tmp/empty-cache python3 -P -m dsv2_mlc.cli chat dsv2-coder-tiny-q4f16_g32-cuda-sm_90 --prompt 'def fibonacci(n):' --max-tokens 48; echo "exit $?"
