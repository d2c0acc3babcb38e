#!/bin/bash
# The expert-major MoE decode kernels (schedules/moe_expert_major_cuda.py) wired as a second
# decode entry point, batch_decode_expert_major, against the fused per-token kernels. Not
# adopted (slower at every batch): to run it again, apply expert_major_wiring.patch (the entry
# point, the engine's switch expert_major_from, bench's --expert-major-from / --token-major,
# scripts/gpu_decode_batches.py) on the commit that adds the kernels, build (dsv2-mlc compile
# ../shared/notes/configs/config_v2_lite.json --random-weights -o build/r30/lite --device cuda
# --quantization q4f16_g128; scripts/make_gpu_refs.py --out build/r30/gpu --quantizations
# q4f16_g32) and copy the source to build/r30/src. Carry .devcarry, build/r30/{lite,src,gpu}.
# The measured build (r30) looked each chunk's expert up by a scan of the experts; the committed
# kernels read it from the plan's chunk -> expert table (emulation-tested, not re-measured).
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r30/src:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=build/r30/lite; L=.devcarry/tvm-lib
python3 -P scripts/gpu_numerics.py --builds build/r30/gpu --lib-dir $L --out $OUT/gpu_numerics.json 2>&1 | tail -4
mkdir -p $OUT/gc
python3 -P scripts/gpu_graph_check.py $B --lib-dir $L --out $OUT/gc 2>&1 | grep "^OK\|^MISMATCH\|launched\|rror" | cut -c1-300
python3 -P scripts/gpu_decode_batches.py $B --lib-dir $L --out $OUT --batches 1,2,3,4,8,16,31 2>&1 | cut -c1-420
python3 -P scripts/gpu_kernel_profile.py $B --lib-dir $L --out $OUT/prof-b8 --batch 8 --prompt-len 1024 --steps 4 --prefill-len 1024 --top 12 2>&1 | grep -A12 "== decode step"
# Nsight Compute of the two kernels at batch 8 (ncu-b8-details.txt):
# ncu --kernel-name regex:moe_expert_major --launch-skip 60 --launch-count 2 --set full -o $OUT/em \
#   python3 -P scripts/gpu_kernel_profile.py $B --lib-dir $L --out $OUT/p --batch 8 --prompt-len 1024 --steps 2 --prefill-len 64
