#!/bin/bash
# argmax multi-block (build/h2 = working tree) vs a46a20d (build/h); MLA lab fifth round (float16 partials)
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib; export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/r3; mkdir -p $R
H=$PWD/build/h/src-head:$PWD/.site; N=$PWD/build/h2/src:$PWD/.site
PYTHONPATH=$N python3 -P scripts/gpu_argmax_check.py build/h2/lite --lib-dir $L --out $R/argmax 2>&1 | tail -2
for i in 1 2; do
  PYTHONPATH=$H python3 -P scripts/gpu_step_overhead.py build/h/lite --lib-dir $L --out $R/head-$i 2>&1 | tail -1 | sed "s/^/head /"
  PYTHONPATH=$N python3 -P scripts/gpu_step_overhead.py build/h2/lite --lib-dir $L --out $R/argmax-$i 2>&1 | tail -1 | sed "s/^/argmax /"
done
PYTHONPATH=$N python3 -P scripts/gpu_kernel_profile.py build/h2/lite --lib-dir $L --graph --greedy --prompt-len 4032 --steps 16 --prefill-len 512 --out $R/prof 2>&1 | grep -i "argmax\|kernels per step"
PYTHONPATH=$PWD/.site:$PWD timeout 240 python3 scripts/kernel_lab_mla.py run --lib-dir $L --out $R/lab --budget-per-case-s 0.15 --cupti --only ours,ours_p16,pipe3_pp2,pipe3_pp2_p16,pipe5_pp4,pipe5_pp4_p16 2>&1 | tail -40
cd $OUT && tar czf r3.tgz r3 && rm -rf r3
