#!/bin/bash
# CUPTI chain of a replayed decode graph, greedy (arg-max + token copies) vs logits, same build (a46a20d kernels)
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
B=build/h/lite; L=.devcarry/tvm-lib; export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/build/h/src-new:$PWD/.site
R=$OUT/p; mkdir -p $R
python3 -P scripts/gpu_kernel_profile.py $B --lib-dir $L --graph --greedy --prompt-len 4032 --steps 16 --prefill-len 512 --out $R/greedy 2>&1 | tail -30
python3 -P scripts/gpu_kernel_profile.py $B --lib-dir $L --graph --prompt-len 4032 --steps 16 --prefill-len 512 --out $R/logits 2>&1 | grep -i "kernels per\|argmax\|Memcpy" 
cd $OUT && tar czf p.tgz p && rm -rf p
