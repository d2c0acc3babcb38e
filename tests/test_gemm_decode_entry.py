"""The decode entry point for large batches, ``batch_decode_gemm``: the absorbed attention of
``batch_decode`` (the cache's cross-attention over pages that already hold the new token, no
self-attention over the new tokens, which would count each token twice), the rest as the extend
path runs it (on CUDA the expert-sorted grouped GEMMs, not the fused decode kernels). Traced to
the fuse phase; its logits against HF are checked in test_sequences.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tvm

from dsv2_mlc.model.config import DeepseekV2Config
from dsv2_mlc.quant import get_quantization

sys.path.insert(0, str(Path(__file__).parent))
from hf_reference import CONFIG_A  # noqa: E402
from test_moe_grouped import _called  # noqa: E402

GROUPED = {"moe_align", "moe_grouped_q4_gate_up", "moe_grouped_q4_down", "moe_grouped_q4_combine"}
_PACKED_OPS = ("relax.call_pure_packed", "relax.call_dps_packed", "relax.call_packed")


def _packed(func) -> set[str]:
    """The packed functions ``func`` calls (the KV cache's builtins)."""
    found: set[str] = set()

    def visit(e):
        if isinstance(e, tvm.relax.Call) and isinstance(e.op, tvm.ir.Op):
            if e.op.name in _PACKED_OPS and isinstance(e.args[0], tvm.relax.ExternFunc):
                found.add(e.args[0].global_symbol)

    tvm.relax.analysis.post_order_visit(func, visit)
    return found


@pytest.mark.parametrize("kind", ["cuda", "llvm"])
def test_gemm_entry_is_decode_attention_with_the_extend_kernels(kind: str) -> None:
    from dsv2_mlc.compiler.compile import _export
    from dsv2_mlc.passes.pipeline import PHASES, PipelineOptions

    if kind == "cuda":
        target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    else:
        target = tvm.target.Target({"kind": "llvm"})
    mod, _, _ = _export(DeepseekV2Config.from_hf(CONFIG_A), target, get_quantization("q4f16_g32"))
    with target:
        passes = [p for name, make in PHASES[:3] for p in make(target, PipelineOptions())]
        mod = tvm.transform.Sequential(passes)(mod)
    packed = {e: _packed(mod[e]) for e in ("batch_decode", "batch_extend", "batch_decode_gemm")}
    self_attn = "vm.builtin.attention_kv_cache_self_attention"
    assert self_attn in packed["batch_extend"]
    assert packed["batch_decode_gemm"] == packed["batch_decode"], packed["batch_decode_gemm"]
    called = {e: {gv.name_hint for gv in _called(mod[e])} for e in packed}
    gemm, extend = called["batch_decode_gemm"], called["batch_extend"]
    if kind == "cuda":
        assert GROUPED <= gemm and "moe_decode_gate_up" not in gemm, sorted(gemm)
        assert "moe_decode_gate_up" in called["batch_decode"]
    else:  # the gathers of every entry on the CPU
        assert not gemm & GROUPED
    # its projections and experts are the extend entry's (a subset: no key/value decompression)
    assert {n for n in gemm if n.startswith("moe_")} == {n for n in extend if n.startswith("moe_")}


def test_gemm_threshold_must_be_a_sequence_count(compiled) -> None:
    from dsv2_mlc.bench import BenchError, BenchOptions
    from dsv2_mlc.runtime.engine import GEMM_DECODE_FROM, Engine

    with pytest.raises(ValueError, match="gemm_decode_from must be at least 1"):
        Engine(compiled["A"], context_window=64, max_batch_size=1, gemm_decode_from=0)
    with pytest.raises(BenchError, match="--gemm-decode-from"):
        BenchOptions(model="x", gemm_decode_from=0).check()
    eng = Engine(compiled["A"], context_window=64, max_batch_size=1)
    assert eng.gemm_decode_from == GEMM_DECODE_FROM  # builds have the entry on every target


SWAP = {"moe_swap_q4_gate_up", "moe_swap_q4_down", "moe_swap_q4_combine"}


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_swap_entry_is_the_gemm_entry_with_the_swap_experts(arch: str) -> None:
    """``batch_decode_swap``, traced for sm_90 where the experts' shapes take the wgmma kernels
    (hidden 128, expert width 64, INT4): the attention and projections of ``batch_decode_gemm``,
    the routed experts through moe_swap_cuda's grouped GEMMs instead of the 64-row ones. For
    sm_80 (no wgmma), and at CONFIG_A's width of 32 (not a multiple of 64), no such entry."""
    from dsv2_mlc.compiler.compile import _export
    from dsv2_mlc.passes.pipeline import PHASES, PipelineOptions

    target = tvm.target.Target({"kind": "cuda", "arch": arch}, host={"kind": "llvm"})
    quant = get_quantization("q4f16_g32")
    cfg = DeepseekV2Config.from_hf({**CONFIG_A, "hidden_size": 128, "moe_intermediate_size": 64})
    mod, _, _ = _export(cfg, target, quant)
    names = {gv.name_hint for gv in mod.functions}
    small, _, _ = _export(DeepseekV2Config.from_hf(CONFIG_A), target, quant)
    assert "batch_decode_swap" not in {gv.name_hint for gv in small.functions}
    if arch != "sm_90":
        assert "batch_decode_swap" not in names and "batch_decode_gemm" in names
        return
    with target:
        passes = [p for name, make in PHASES[:3] for p in make(target, PipelineOptions())]
        mod = tvm.transform.Sequential(passes)(mod)
    entries = ("batch_decode", "batch_decode_gemm", "batch_decode_swap")
    packed = {e: _packed(mod[e]) for e in entries}
    assert packed["batch_decode_swap"] == packed["batch_decode"], packed["batch_decode_swap"]
    called = {e: {gv.name_hint for gv in _called(mod[e])} for e in entries}
    swap, gemm = called["batch_decode_swap"], called["batch_decode_gemm"]
    assert SWAP <= swap and not swap & GROUPED, sorted(n for n in swap if "moe" in n)
    assert any(n.startswith("moe_align") for n in swap)  # (tiles of 32 rows: a second align)
    assert {n for n in swap if not n.startswith("moe_")} == {
        n for n in gemm if not n.startswith("moe_")
    }


def test_swap_threshold_must_be_a_sequence_count(compiled) -> None:
    from dsv2_mlc.bench import BenchError, BenchOptions, _expert_major
    from dsv2_mlc.runtime.engine import Engine

    with pytest.raises(ValueError, match="swap_decode_from must be at least 1"):
        Engine(compiled["A"], context_window=64, max_batch_size=1, swap_decode_from=0)
    with pytest.raises(BenchError, match="--swap-decode-from"):
        BenchOptions(model="x", swap_decode_from=0).check()
    assert _expert_major(BenchOptions(model="x", swap_decode_from=200)) == {"swap_decode_from": 200}
    off = _expert_major(BenchOptions(model="x", swap_decode_from=200, token_major=True))
    assert off == dict.fromkeys(("expert_major_from", "gemm_decode_from", "swap_decode_from"))
    eng = Engine(compiled["A"], context_window=64, max_batch_size=1)
    assert eng.swap_decode_from is None  # a CPU build has no batch_decode_swap
