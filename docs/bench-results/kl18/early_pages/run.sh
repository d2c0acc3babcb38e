#!/bin/bash
# The attention's split blocks copy their old pages before the PDL wait (early_pages): base =
# the default build of 8d082ee's tree (build/r42/lite), e3 / e4 / e5 = the working tree after
# afe1b77 with mla_attention_cuda(early_pages=True) and 3 (the default) / 4 / 5 stages
# (docs/bench-results/kl12/attn_release/build.py release_first "{'early_pages': True, ...}" OUT,
# build/r43/e3, e4, e5), ep = e3 + the MLA prologue's W_UK tile in registers before its wait
# (docs/bench-results/kl18/early_pages/build.py "{'early_pages': True}" "{'preload': True}" OUT);
# model.so carried xz-compressed. Decode graph replays back to back at
# context ~4,000 (twice, alternating), ~500 and ~8,000. Carry .devcarry, build/r42/{lite,src},
# build/r43.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib; S=$PWD/build/r43/src
declare -A B=([base]=build/r42/lite [e3]=build/r43/e3 [e4]=build/r43/e4 [e5]=build/r43/e5 [ep]=build/r43/ep)
export PYTHONUNBUFFERED=1 PYTHONPATH=$S:$PWD/.site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for v in "${!B[@]}"; do
  d=${B[$v]}; [ -f $d/model.so ] || python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" $d/model.so.xz $d/model.so
done
R=$OUT/early_pages; mkdir -p $R
so() {  # build, tag, prompt length (skipped past 500 s, so that the tar below runs)
  [ $SECONDS -gt 500 ] && { echo "skip $1 $2"; return; }
  timeout 120 python3 -P scripts/gpu_step_overhead.py ${B[$1]} --lib-dir $L --out $R/so-$1-$2 \
    --replays 2000 --prompt-len $3 > $R/so-$1-$2.log 2>&1 || tail -3 $R/so-$1-$2.log
  python3 -c "import json;d=json.load(open('$R/so-$1-$2/step_overhead.json'));print('$1 $2', round(d['replay_us'],1))"
  echo "  t=$SECONDS s"
}
for i in 1 2; do for v in base e3 ep e4 e5; do so $v 4k$i 4000; done; done
for v in base e3 ep; do so $v 512 500; done
for v in base e3 ep; do so $v 8k 8000; done
tar czf $OUT/early_pages.tgz -C $OUT early_pages && rm -rf $OUT/early_pages
