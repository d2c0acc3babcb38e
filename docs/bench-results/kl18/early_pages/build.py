"""Compile a lab variant: the split kernel's options and the MLA prologue's.

    python docs/bench-results/kl18/early_pages/build.py SPLIT_OPTIONS PROLOGUE_OPTIONS OUT
    (each a Python dict of mla_attention_cuda / mla_prologue_cuda keywords)

V2-Lite shape, random weights, q4f16_g128, CUDA sm_90 (the CLI's defaults otherwise).
"""

import ast
import functools
import sys

import dsv2_mlc.model.kv_cache as kv_cache
import dsv2_mlc.model.mla_ops as mla_ops
from dsv2_mlc.cli import main

split, prologue, out = ast.literal_eval(sys.argv[1]), ast.literal_eval(sys.argv[2]), sys.argv[3]
init = kv_cache.MLAPagedKVCache.__init__


def patched(self, **kwargs):
    kwargs.setdefault("split_kv_options", split)
    init(self, **kwargs)


kv_cache.MLAPagedKVCache.__init__ = patched
mla_ops.mla_prologue_cuda = functools.partial(mla_ops.mla_prologue_cuda, **prologue)
sys.exit(main([
    "compile", "../shared/notes/configs/config_v2_lite.json", "--random-weights", "-o", out,
    "--device", "cuda", "--quantization", "q4f16_g128",
]))  # fmt: skip
