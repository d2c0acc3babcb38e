"""The tensor-core ragged prefill attention kernel (schedules/prefill_attention_cuda.py), no GPU.

Checks the shapes it takes, that ``MLAPagedKVCache`` puts it into the ragged-prefill slot of
TVM's ``TIRPagedKVCache`` for CUDA where it supports the shapes (and keeps TVM's kernel where it
does not), that a tiny CUDA build carries it (sm_90 machine code), and that the CPU cache is
unchanged. Its numerics run under the CPU emulation in test_prefill_attention_emulation.py (which
also compiles it with nvcc); its speed: schedules/results/prefill_attention.md.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from dsv2_mlc.schedules.prefill_attention_cuda import (
    build_prefill_attention,
    prefill_attention_cuda_supports,
)
from dsv2_mlc.schedules.tiles import PrefillAttentionTiles

sys.path.insert(0, str(Path(__file__).parent))
from cuda_builds import needs_nvcc  # noqa: E402
from hf_reference import CONFIG_A  # noqa: E402
from mla_cache_module import create_script  # noqa: E402

OURS = "batch_prefill_ragged_kv_mma"  # its global symbol
TVM_RAGGED = "batch_prefill_ragged_kv"
CUDA = {"kind": "cuda", "arch": "sm_90"}


def test_supported_shapes() -> None:
    assert prefill_attention_cuda_supports(16, 16, 192, 128, "float16")
    assert prefill_attention_cuda_supports(4, 4, 32, 16, "float16")
    assert not prefill_attention_cuda_supports(16, 16, 192, 128, "bfloat16")
    assert not prefill_attention_cuda_supports(2, 16, 192, 128, "float16")  # GQA
    assert not prefill_attention_cuda_supports(4, 4, 24, 16, "float16")  # d_qk % 16
    with pytest.raises(ValueError, match="shared memory"):
        build_prefill_attention(16, 16, 192, 128, "float16", PrefillAttentionTiles(64, 128))
    with pytest.raises(ValueError, match="block_m"):
        build_prefill_attention(16, 16, 192, 128, "float16", PrefillAttentionTiles(48, 32))


@pytest.mark.parametrize(("dtype", "flash"), [("float16", True), ("bfloat16", False)])
def test_cuda_cache_ragged_slot(dtype: str, flash: bool) -> None:
    """The ragged-prefill slot holds our kernel for float16 and TVM's for bfloat16 (which ours
    does not support)."""
    names, script = create_script(CUDA, dtype=dtype)
    slot, other = (OURS, TVM_RAGGED) if flash else (TVM_RAGGED, OURS)
    assert f'(R.str("tirx"), {slot})' in script
    assert f'(R.str("tirx"), {other})' not in script
    assert (OURS in names) == flash
    # the MLA slot keeps its own kernel either way (the split kernel takes bfloat16 too)
    assert '(R.str("tirx"), batch_mla_paged_attention_split_kv)' in script


def test_cpu_cache_unchanged() -> None:
    """The LLVM cache keeps TVM's CPU ragged kernel."""
    llvm = {"kind": "llvm"}
    names, script = create_script(llvm)
    assert OURS not in names
    assert '(R.str("tirx"), batch_prefill_ragged_kv)' in script  # _attention_prefill_ragged_cpu


@needs_nvcc
def test_tiny_cuda_build_carries_the_kernel(tmp_path: Path) -> None:
    """A tiny CUDA build (config only, random weights): the lowered cache-create call has our
    kernel in the ragged-prefill slot, and the fatbin holds it. CONFIG_A's q/k head dim 24 is not
    a multiple of 16 (TVM's kernel would stay), so this config uses 32. (TVM's unused kernels stay
    in the module: TIRPagedKVCache adds them before the slot is replaced, and nothing prunes TIR
    functions.)"""
    from dsv2_mlc.compiler.compile import compile_random_model
    from dsv2_mlc.compiler.cuda import check_fatbin
    from dsv2_mlc.layout import LIBRARY

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**CONFIG_A, "qk_nope_head_dim": 24}))
    dump = tmp_path / "ir"
    out = compile_random_model(
        cfg, tmp_path / "out", device="cuda", dtype="float16", dump_ir=dump
    ).out_dir
    slots = re.findall(r'\(R\.str\("tirx"\), cls\.(\w+)\)', (dump / "05-lower.py").read_text())
    assert slots == [OURS, "batch_mla_paged_attention_split_kv"]
    lib = out / LIBRARY
    check_fatbin(lib, "sm_90")
    assert f"{OURS}_kernel".encode() in lib.read_bytes()
