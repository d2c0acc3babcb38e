#!/bin/bash
# One call: the third round of tiles (build/r41/{I,J,K,L}, E of the second round again), then
# run_final.sh's checks on the default build of the adopted tiles (build/r42/lite: E's tiles as
# MMA_GATE_UP_TILES / MMA_DOWN_TILES), with the runtime of build/r42/src(-gc).
# Carry .devcarry, build/r41, build/r42.
SRC=build/r42/src SKIP_BASE=1 R=build/r41 VARIANTS="I J K L E" bash docs/bench-results/kl17/mma_tiles/run.sh
R=build/r42 bash docs/bench-results/kl17/mma_tiles/run_final.sh
