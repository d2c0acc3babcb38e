"""Compile V2-Lite with other tiles for the expert-major MMA MoE kernels (lab variants).

    python docs/bench-results/kl17/mma_tiles/build.py "GATE_UP" "DOWN" OUT
    (GATE_UP, DOWN: MmaTiles fields as a Python tuple: warps, blocks, rows[, depth])

V2-Lite shape, random weights, q4f16_g128, CUDA sm_90 (the CLI's defaults otherwise).
"""

import ast
import functools
import sys

import dsv2_mlc.passes.quantize_int4 as q
from dsv2_mlc.cli import main
from dsv2_mlc.schedules.moe_expert_mma_cuda import MmaTiles

gate_up, down = (MmaTiles(*ast.literal_eval(a)) for a in sys.argv[1:3])
out = sys.argv[3]
q.moe_gate_up_expert_mma = functools.partial(q.moe_gate_up_expert_mma, tiles=gate_up)
q.moe_down_expert_mma = functools.partial(q.moe_down_expert_mma, tiles=down)
print("tiles", gate_up, down, flush=True)
sys.exit(main([
    "compile", "../shared/notes/configs/config_v2_lite.json", "--random-weights", "-o", out,
    "--device", "cuda", "--quantization", "q4f16_g128",
]))  # fmt: skip
