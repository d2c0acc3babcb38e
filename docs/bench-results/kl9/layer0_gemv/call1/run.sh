#!/bin/bash
# layer 0 / lm_head prefetch GEMVs: build/r12/{ctl,gemv,lmh} (ctl = 12443b7's kernels; gemv = the dense MLP, layer 0 qkv_a on gemv_q4_decode; lmh = gemv + lm_head on it)
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib; export PYTHONUNBUFFERED=1
R=$OUT/gemv; mkdir -p $R
for V in gemv lmh; do PYTHONPATH=$PWD/build/r12/$V/src:$PWD/.site python3 -P scripts/gpu_graph_check.py build/r12/$V/lite --lib-dir $L --out $R/gc-$V 2>&1 | tail -1 | sed "s/^/$V /"; done
for V in gemv lmh; do PYTHONPATH=$PWD/build/r12/$V/src:$PWD/.site python3 -P scripts/gpu_v2lite_numerics.py --build build/r12/$V/lite --lib-dir $L --out $R/v2lite-$V.json 2>&1 | grep -i "max_abs_diff\|top1" | tr '\n' ' ' | sed "s/^/$V /"; echo; done
for i in 1 2; do for V in ctl gemv lmh; do
  PYTHONPATH=$PWD/build/r12/$V/src:$PWD/.site python3 -P scripts/gpu_pdl_check.py build/r12/$V/lite --lib-dir $L --out $R/pdl-$V-$i --variants programmatic --prompt-len 4000 --steps 40 --replays 2000 --checked-replays 20 2>&1 | tail -1 | sed "s/^/$V /"
done; done
for i in 1 2; do for V in ctl gemv lmh; do
  PYTHONPATH=$PWD/build/r12/$V/src:$PWD/.site python3 -P -m dsv2_mlc.cli bench build/r12/$V/lite --prompt-len 4096 --gen-len 64 --warmup 1 --repeat 3 --lib-dir $L --json $R/bench-$V-$i.json 2>&1 | grep "^decode:" | sed "s/^/$V /"
done; done
for V in ctl gemv lmh; do PYTHONPATH=$PWD/build/r12/$V/src:$PWD/.site python3 -P scripts/gpu_kernel_profile.py build/r12/$V/lite --lib-dir $L --out $R/pgraph-$V --graph --prompt-len 4032 --steps 16 --top 3 2>&1 | grep "== decode" | sed "s/^/$V /"; done
cd $OUT && tar czf gemv.tgz gemv && rm -rf gemv
