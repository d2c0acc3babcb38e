#!/bin/bash
# Long contexts: the splits' cap (max_split, the grid's splits a row) on top of e22a115's default
# (build/r24/lite: 256) -> 128 / 64 (build/r25/S128, S64, from docs/bench-results/kl12/attn_release/
# build.py release_first "{'max_split': N}" OUT). Decode graph replays at ~8,000 and ~32,000 tokens.
rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .devcarry/wheels/*.whl
L=.devcarry/tvm-lib; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build/r24/src:$PWD/.site
declare -A B=([s256]=build/r24/lite [s128]=build/r25/S128 [s64]=build/r25/S64)
R=$OUT/max_split; mkdir -p $R
so() {
  python3 -P scripts/gpu_step_overhead.py ${B[$1]} --lib-dir $L --out $R/so-$1-$2 --replays 1000 --warmup 40 --steps 60 --prompt-len $3 > $R/so-$1-$2.log 2>&1
  python3 -c "import json;d=json.load(open('$R/so-$1-$2/step_overhead.json'));print('$1 $2', round(d['replay_us'],1))"
}
for t in "8k 8000" "32k 32000" "16k 16000"; do for v in s256 s128 s64; do so $v $t; done; done
