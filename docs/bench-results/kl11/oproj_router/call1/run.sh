#!/bin/bash
# o_proj + add + RMSNorm + routing in one kernel (build/r18, the working tree after dab93cd)
# against the kernels of 78fbc03 / dab93cd (build/r17/bench): numerics, graph check, replay A/B,
# bench A/B at 4K, per-kernel profile of both
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
A=build/r17/bench/v2-lite-q4f16_g128; B=build/r18/lite; L=.devcarry/tvm-lib
SA=$PWD/build/r17/bench/src; SB=$PWD/build/r18/src
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$OUT/oproj_router; mkdir -p $R
export PYTHONPATH=$SB:$PWD/.site
python3 -P scripts/gpu_numerics.py --builds build/r18/gpu --lib-dir $L --out $R/gpu_numerics.json 2>&1 | tail -3
python3 -P scripts/gpu_v2lite_numerics.py --build $B --lib-dir $L --out $R/v2lite-q4f16_g128.json 2>&1 | grep -i "max_abs_diff\|top1" | tr '\n' ' '; echo
python3 -P scripts/gpu_graph_check.py $B --lib-dir $L --out $R 2>&1 | tail -1
for i in 1 2; do
  PYTHONPATH=$SA:$PWD/.site python3 -P scripts/gpu_step_overhead.py $A --lib-dir $L --out $R/so-base-$i --replays 2000 2>&1 | tail -1 | cut -c1-330 | sed "s/^/base /"
  python3 -P scripts/gpu_step_overhead.py $B --lib-dir $L --out $R/so-new-$i --replays 2000 2>&1 | tail -1 | cut -c1-330 | sed "s/^/new  /"
done
PYTHONPATH=$SA:$PWD/.site python3 -P scripts/gpu_kernel_profile.py $A --lib-dir $L --out $R/prof-base --prompt-len 4096 --steps 4 --graph 2>&1 | tail -14 | sed "s/^/base /"
python3 -P scripts/gpu_kernel_profile.py $B --lib-dir $L --out $R/prof-new --prompt-len 4096 --steps 4 --graph 2>&1 | tail -14 | sed "s/^/new  /"
for i in 1 2; do
  PYTHONPATH=$SA:$PWD/.site python3 -P -m dsv2_mlc.cli bench $A --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 3 --lib-dir $L --json $R/bench4k-base-$i.json 2>&1 | grep -i "^decode:" | sed "s/^/base /"
  python3 -P -m dsv2_mlc.cli bench $B --prompt-len 4096 --gen-len 128 --warmup 1 --repeat 3 --lib-dir $L --json $R/bench4k-new-$i.json 2>&1 | grep -i "^decode:" | sed "s/^/new  /"
done
cd $OUT && tar czf oproj_router.tgz oproj_router && rm -rf oproj_router
