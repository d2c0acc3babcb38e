#!/bin/bash
# Tiles of the expert-major MMA MoE kernels: decode batches 8 / 16 / 31, token-major vs
# expert-major (gpu_decode_batches.py), and CUPTI kernel times of an eager batch-16 step, for
# build/r38 (42f3e7c's default tiles) and the variants of build.py in build/r39/{A,B,C,D}
# (model.so carried xz-compressed; R=build/r40 VARIANTS="E F G H" for the second call). Carry
# .devcarry, build/r38/{lite,src}, $R (SRC: another runtime; SKIP_BASE=1: no r38 run). Everything written under $OUT comes back as one tarball.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/${SRC:-build/r38/src}:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
L=.devcarry/tvm-lib
for v in ${VARIANTS:-A B C D}; do
  python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" \
    ${R:-build/r39}/$v/model.so.xz ${R:-build/r39}/$v/model.so
done
for v in ${VARIANTS:-A B C D} $([ -z "$SKIP_BASE" ] && echo base); do
  B=${R:-build/r39}/$v; [ $v = base ] && B=build/r38/lite
  O=$OUT/mma_tiles/$v; mkdir -p $O
  timeout 240 python3 -P scripts/gpu_decode_batches.py $B --lib-dir $L --out $O \
    --batches ${BATCHES:-8,16,31} > $O/log.txt 2>&1 || tail -3 $O/log.txt
  python3 -c "
import json
for r in json.load(open('$O/decode_batches.json'))['runs']:
    print('$v', r['batch'], 'token', round(r['token']['tok_s_median'], 1), 'expert',
          round(r['expert']['tok_s_median'], 1), r['check'])"
  timeout 120 python3 -P scripts/gpu_kernel_profile.py $B --lib-dir $L --out $O/prof-b16 --batch 16 \
    --prompt-len 1024 --prefill-len 1024 --steps 4 > $O/prof-b16.txt 2>&1 || tail -3 $O/prof-b16.txt
  grep "moe_expert_major\|== decode" $O/prof-b16.txt | head -3
done
tar czf $OUT/mma_tiles.tgz -C $OUT mma_tiles && rm -rf $OUT/mma_tiles
