#!/bin/bash
# The graph check on build/r38 with EXPERT_MAJOR_FROM = 2 in its source copy (build/r38/src-gc),
# so that its batch-2 cases replay the expert-major entry point. Carry .devcarry,
# build/r38/{lite,src-gc}.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r38/src-gc:$PWD/.site
python3 -P scripts/gpu_graph_check.py build/r38/lite --lib-dir .devcarry/tvm-lib --out $OUT/gc-r38 2>&1 | grep "^OK\|^MISMATCH\|batch2\|rror" | cut -c1-300
