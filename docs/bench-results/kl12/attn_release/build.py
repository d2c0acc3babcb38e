"""Compile a lab variant of the attention chain: the latent append and the split kernel's options.

    python docs/bench-results/kl12/attn_release/build.py APPEND OPTIONS OUT
    (APPEND: release_first | tvm; OPTIONS: a Python dict of mla_attention_cuda keywords)

V2-Lite shape, random weights, q4f16_g128, CUDA sm_90 (the CLI's defaults otherwise).
"""

import ast
import sys

import dsv2_mlc.model.kv_cache as kv_cache
from dsv2_mlc.cli import main

append, options, out = sys.argv[1], ast.literal_eval(sys.argv[2]), sys.argv[3]
init = kv_cache.MLAPagedKVCache.__init__


def patched(self, **kwargs):
    kwargs.setdefault("append_kernel", append)
    kwargs.setdefault("split_kv_options", options)
    init(self, **kwargs)


kv_cache.MLAPagedKVCache.__init__ = patched
sys.exit(main([
    "compile", "../shared/notes/configs/config_v2_lite.json", "--random-weights", "-o", out,
    "--device", "cuda", "--quantization", "q4f16_g128",
]))  # fmt: skip
