"""The expert-sorted grouped MoE kernels (schedules/moe_grouped_cuda.py): the bookkeeping and the
grouped GEMMs' TE against NumPy on LLVM, the CUDA schedules compiling for sm_90 (nvcc, no GPU),
and the wiring (prefill / extend on CUDA only). The tensor-core GEMMs' numerics run under the CPU
emulation in test_moe_grouped_emulation.py; GPU numerics and speed:
schedules/lab/kernel_lab_moe.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te, tirx
from tvm.ir.expr import TensorLoad

from dsv2_mlc.model.config import DeepseekV2Config
from dsv2_mlc.quant import get_quantization, quantize_int4
from dsv2_mlc.quant.modules import dequantize_expr
from dsv2_mlc.schedules import moe_grouped_cuda as grouped
from dsv2_mlc.schedules.moe_mma_cuda import grouped_mma_kernel
from dsv2_mlc.schedules.tiles import GroupedMmaTiles

sys.path.insert(0, str(Path(__file__).parent))
from cuda_builds import needs_nvcc  # noqa: E402
from hf_reference import CONFIG_A  # noqa: E402

DEV = tvm.cpu()


# -- NumPy references ---------------------------------------------------------------------------
def ref_align(idx: np.ndarray, num_experts: int, tm: int) -> dict[str, np.ndarray]:
    """Stable sort of the (token, slot) pairs by expert, each segment padded to tm rows."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    counts = np.bincount(flat, minlength=num_experts).astype(np.int32)
    n_tiles = grouped.num_tiles(n, k, num_experts, tm)
    rows = np.zeros(n_tiles * tm, np.int32)
    tile_expert = np.full(n_tiles, -1, np.int32)
    inv = np.zeros(n * k, np.int32)
    start = 0
    for e in range(num_experts):
        pairs = np.nonzero(flat == e)[0]
        rows[start : start + len(pairs)] = pairs // k
        inv[pairs] = start + np.arange(len(pairs))
        padded = -(-len(pairs) // tm) * tm
        tile_expert[start // tm : (start + padded) // tm] = e
        start += padded
    return {
        "rows": rows.reshape(n_tiles, tm),
        "tile_expert": tile_expert,
        "inv": inv.reshape(n, k),
        "counts": counts,
    }


def dequantize(packed: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    shifts = np.arange(8, dtype=np.uint32) * 4
    q = ((packed[..., None] >> shifts) & 15).reshape(*packed.shape[:-1], -1).astype(np.float32)
    return (q - 8) * np.repeat(scale.astype(np.float32), group, axis=-1)[..., : q.shape[-1]]


def ref_moe(x, weights, idx, w_gu, w_dn):
    """Routed experts with the kernels' roundings: SwiGLU and down rows in fp16, fp32 sums."""
    inter = w_gu.shape[1] // 2
    out = np.zeros(x.shape, np.float32)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            gu = w_gu[e] @ x[t].astype(np.float32)
            g, u = gu[:inter], gu[inter:]
            hid = (g / (1 + np.exp(-g)) * u).astype(np.float16).astype(np.float32)
            out[t] += weights[t, j] * (w_dn[e] @ hid).astype(np.float16).astype(np.float32)
    return out.astype(x.dtype)


def random_routing(rng, n: int, num_experts: int, top_k: int, skew: bool) -> np.ndarray:
    """Distinct experts per token; ``skew``: only the first half of the experts get tokens."""
    pool = num_experts // 2 if skew else num_experts
    return np.stack([rng.choice(pool, top_k, replace=False) for _ in range(n)]).astype(np.int32)


# -- LLVM runs -----------------------------------------------------------------------------------
def _run(func: tirx.PrimFunc, inputs: list[np.ndarray], outs: list[tuple]) -> list[np.ndarray]:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    res = [tvm.runtime.empty(s, d, DEV) for s, d in outs]
    lib["main"](*[tvm.runtime.tensor(a, DEV) for a in inputs], *res)
    return [r.numpy() for r in res]


def _align(idx: np.ndarray, num_experts: int, tm: int) -> dict[str, np.ndarray]:
    n, k = idx.shape
    n_tiles = grouped.num_tiles(n, k, num_experts, tm)
    outs = [((n_tiles, tm), "int32"), ((n_tiles,), "int32"), ((n, k), "int32")]
    outs.append(((num_experts,), "int32"))
    got = _run(grouped.moe_align(num_experts, k, tm, gpu=False), [idx], outs)
    return dict(zip(("rows", "tile_expert", "inv", "counts"), got, strict=True))


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (64, 6)])
@pytest.mark.parametrize("n", [1, 2, 37, 200])
@pytest.mark.parametrize("tm", [4, 64])
def test_align_matches_numpy(num_experts: int, top_k: int, n: int, tm: int):
    rng = np.random.default_rng(n * 100 + tm)
    for skew in (False, True):
        idx = random_routing(rng, n, num_experts, top_k, skew)
        got, want = _align(idx, num_experts, tm), ref_align(idx, num_experts, tm)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        # every pair has its own row, which holds its token; the rest are padding (token 0)
        flat = got["rows"].reshape(-1)
        assert sorted(got["inv"].reshape(-1).tolist()) == sorted(set(got["inv"].reshape(-1)))
        np.testing.assert_array_equal(flat[got["inv"]], np.arange(n)[:, None].repeat(top_k, 1))
        padding = np.ones(flat.size, bool)
        padding[got["inv"].reshape(-1)] = False
        assert (flat[padding] == 0).all()
        assert grouped.num_tiles(n, top_k, num_experts, tm) * tm <= n * top_k + num_experts * (
            tm - 1
        )


def _gemm_funcs(n_tiles_var, n_var, hidden, inter, num_experts, top_k, tm, group):
    def read(ws, e, o, r):
        return dequantize_expr(ws[0], ws[1], (e, o), r, group)

    rows = te.placeholder((n_tiles_var, tm), "int32", name="rows")
    tile_expert = te.placeholder((n_tiles_var,), "int32", name="tile_expert")
    x = te.placeholder((n_var, hidden), "float16", name="x")
    qgu = te.placeholder((num_experts, 2 * inter, hidden // 8), "uint32", name="qgu")
    sgu = te.placeholder((num_experts, 2 * inter, hidden // group), "float16", name="sgu")
    hid = te.placeholder((n_tiles_var, tm, inter), "float16", name="hid")
    qdn = te.placeholder((num_experts, hidden, inter // 8), "uint32", name="qdn")
    sdn = te.placeholder((num_experts, hidden, inter // group), "float16", name="sdn")
    down = te.placeholder((n_tiles_var, tm, hidden), "float16", name="down")
    inv = te.placeholder((n_var, top_k), "int32", name="inv")
    w = te.placeholder((n_var, top_k), "float32", name="w")
    gu = grouped.grouped_gemm_te(x, rows, tile_expert, [qgu, sgu], read, inter, 2, True, "gu")
    dn = grouped.grouped_gemm_te(hid, rows, tile_expert, [qdn, sdn], read, hidden, 1, False, "dn")
    comb = grouped.combine_te(down, inv, w, "comb")
    return (
        te.create_prim_func([x, rows, tile_expert, qgu, sgu, gu]),
        te.create_prim_func([hid, rows, tile_expert, qdn, sdn, dn]),
        te.create_prim_func([down, inv, w, comb]),
    )


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("n,tm", [(1, 64), (5, 4), (37, 16), (70, 64)])
def test_grouped_gemm_te_matches_numpy(group: int, n: int, tm: int):
    hidden, inter, num_experts, top_k = (128, 128, 8, 2) if group == 128 else (64, 32, 8, 2)
    rng = np.random.default_rng(group + n)
    idx = random_routing(rng, n, num_experts, top_k, skew=True)  # experts 4..7 get nothing
    weights = rng.random((n, top_k)).astype(np.float32)
    x = rng.standard_normal((n, hidden)).astype(np.float16)
    w_gu = rng.standard_normal((num_experts, 2 * inter, hidden)).astype(np.float32) / 8
    w_dn = rng.standard_normal((num_experts, hidden, inter)).astype(np.float32) / 6
    qgu, sgu = quantize_int4(w_gu, group, "float16")
    qdn, sdn = quantize_int4(w_dn, group, "float16")
    want = ref_moe(x, weights, idx, dequantize(qgu, sgu, group), dequantize(qdn, sdn, group))

    a = _align(idx, num_experts, tm)
    n_tiles = a["rows"].shape[0]
    f_gu, f_dn, f_comb = _gemm_funcs(
        tirx.Var("nt", "int64"), tirx.Var("n", "int64"), hidden, inter, num_experts, top_k, tm,
        group,
    )  # fmt: skip
    (hid,) = _run(
        f_gu, [x, a["rows"], a["tile_expert"], qgu, sgu], [((n_tiles, tm, inter), "float16")]
    )
    (down,) = _run(
        f_dn, [hid, a["rows"], a["tile_expert"], qdn, sdn], [((n_tiles, tm, hidden), "float16")]
    )
    (out,) = _run(f_comb, [down, a["inv"], weights], [((n, hidden), "float16")])
    scale = float(np.abs(want.astype(np.float32)).max())
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=2e-2, atol=1e-2 * scale)


# -- CUDA ---------------------------------------------------------------------------------------
@needs_nvcc
def test_cuda_kernels_compile_for_sm90():
    from dsv2_mlc.compiler.compile import make_target
    from dsv2_mlc.compiler.cuda import cuda_codegen

    hidden, inter, num_experts, top_k, group = 256, 128, 16, 4, 128
    nt, n = tirx.Var("nt", "int64"), tirx.Var("n", "int64")
    funcs = _gemm_funcs(nt, n, hidden, inter, num_experts, top_k, grouped.TM, group)
    f_gu, f_dn, _ = funcs
    target = make_target("cuda", "sm_90")
    kernels = {
        "align": grouped.moe_align(num_experts, top_k),
        "gate_up": grouped.schedule_grouped_gemm(f_gu, grouped.pick_tiles(inter, hidden, halves=2)),
        "down": grouped.schedule_grouped_gemm(f_dn, grouped.pick_tiles(hidden, inter)),
    }
    comb_args = [te.placeholder((nt, grouped.TM, hidden), "float16", name="d")]
    comb_args += [te.placeholder((n, top_k), "int32", name="inv")]
    comb_args += [te.placeholder((n, top_k), "float32", name="w")]
    kernels["combine"] = grouped.combine_cuda(*comb_args, "comb")
    for name, func in kernels.items():
        assert func.attrs["tirx.is_scheduled"], name
    mod = tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in kernels.items()})
    with target, cuda_codegen():
        lib = tvm.compile(mod, target=target)
    assert "cuda" in {m.kind for m in lib.mod.imports_}


def _v2_lite_placeholders(group: int) -> dict:
    hidden, inter, num_experts = 2048, 1408, 64
    nt, n = tirx.Var("nt", "int64"), tirx.Var("n", "int64")
    return {
        "x": te.placeholder((n, hidden), "float16", name="x"),
        "rows": te.placeholder((nt, grouped.TM), "int32", name="rows"),
        "tile_expert": te.placeholder((nt,), "int32", name="tile_expert"),
        "gate_up": [
            te.placeholder((num_experts, 2 * inter, hidden // 8), "uint32", name="qgu"),
            te.placeholder((num_experts, 2 * inter, hidden // group), "float16", name="sgu"),
        ],
        "hid": te.placeholder((nt, grouped.TM, inter), "float16", name="hid"),
        "down": [
            te.placeholder((num_experts, hidden, inter // 8), "uint32", name="qdn"),
            te.placeholder((num_experts, hidden, inter // group), "float16", name="sdn"),
        ],
    }


def test_mma_dispatch():
    """V2-Lite INT4 shapes take the tensor-core kernels; float experts, small hidden sizes and
    groups that are not a multiple of 32 keep the SIMT schedule."""
    p = _v2_lite_placeholders(128)
    assert grouped.int4_group(p["gate_up"], 2048) == 128
    assert grouped.mma_supported(p["x"], p["rows"], p["gate_up"], 1408, 2)
    assert grouped.mma_supported(p["hid"], p["rows"], p["down"], 2048, 1)
    assert grouped.mma_supported(p["x"], p["rows"], _v2_lite_placeholders(32)["gate_up"], 1408, 2)
    wf = te.placeholder((64, 2 * 1408, 2048), "float16", name="w")
    assert grouped.int4_group([wf], 2048) is None
    assert not grouped.mma_supported(p["x"], p["rows"], [wf], 1408, 2)
    # the test configs: hidden 64 (reduction not a multiple of 64 for down: inter 32)
    nt, n = tirx.Var("nt", "int64"), tirx.Var("n", "int64")
    rows = te.placeholder((nt, grouped.TM), "int32", name="rows")
    hid = te.placeholder((nt, grouped.TM, 32), "float16", name="hid")
    qdn = te.placeholder((8, 64, 4), "uint32", name="qdn")
    sdn = te.placeholder((8, 64, 1), "float16", name="sdn")
    assert not grouped.mma_supported(hid, rows, [qdn, sdn], 64, 1)
    x = te.placeholder((n, 64), "float16", name="x")
    qgu = te.placeholder((8, 64, 8), "uint32", name="qgu")
    sgu = te.placeholder((8, 64, 2), "float16", name="sgu")
    assert not grouped.mma_supported(x, rows, [qgu, sgu], 32, 2)  # 32 columns per half
    with pytest.raises(ValueError):
        grouped.grouped_gemm_mma(hid, rows, rows, [qdn, sdn], 64, 1, False, "dn")


@needs_nvcc
@pytest.mark.parametrize(("group", "arch_specific"), [(32, True), (128, True), (128, False)])
def test_mma_kernels_compile_for_sm90(group: int, arch_specific: bool):
    """The tensor-core grouped GEMMs (every block shape) and the warp align kernel at V2-Lite
    shapes: nvcc fatbin for sm_90, compiled as sm_90a (the wgmma bodies) and as plain sm_90 (the
    mma.sync ones), and the wgmma bodies and the warp align in the source (what the emulation,
    which runs the mma.sync bodies at small shapes in test_moe_grouped_emulation.py, drops)."""
    from dsv2_mlc.compiler.compile import make_target
    from dsv2_mlc.compiler.cuda import cuda_codegen, cuda_sources

    p = _v2_lite_placeholders(group)

    def read(ws, e, o, r):
        return dequantize_expr(ws[0], ws[1], (e, o), r, group)

    kernels = {"align": grouped.moe_align(64, 6)}
    # one-tile blocks of 2 x 2 and 2 x 4 warps, pairs always, and pairs from 256 tiles on
    for warps_n, pair_from in ((2, None), (4, None), (2, 0), (2, 256)):
        tiles = GroupedMmaTiles(warps_n, pair_from)
        tag = f"w{warps_n}_p{pair_from}"
        kernels[f"gate_up_{tag}"] = grouped_mma_kernel(
            p["x"], p["rows"], p["tile_expert"], p["gate_up"], 1408, 2, True, "gu", tiles
        )
        kernels[f"down_{tag}"] = grouped_mma_kernel(
            p["hid"], p["rows"], p["tile_expert"], p["down"], 2048, 1, False, "dn", tiles
        )
    # the default dispatch (what grouped_experts builds): both mma kernels, picked on the host
    # by the tile count, the pair kernel with 64 KB of dynamic shared memory + the wgmma zero
    # tile (8 KB) + 1 KB to align them, 2 blocks an SM
    default = grouped.grouped_gemm_cuda(
        p["x"], p["rows"], p["tile_expert"], p["gate_up"], read, 1408, 2, True, "gu"
    ).script()
    assert "moe_mma_gemm_" in default and "moe_mma_pair_" in default
    assert "shared.dyn" in default and "launch_bounds_min_blocks_per_sm" in default
    assert "smem[37375]" in default  # the whole 73 KB stay allocated (not compacted to 1)
    target = make_target("cuda", "sm_90")
    mod = tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in kernels.items()})
    for name, func in kernels.items():
        assert func.attrs["tirx.is_scheduled"], name
    with target, cuda_codegen(arch_specific):
        lib = tvm.compile(mod, target=target)
    (src,) = cuda_sources(lib.mod)
    needles = ("__match_any_sync", "wgmma.mma_async.sync.aligned.m64n128k16", "fence.proxy.async")
    for needle in needles:
        assert needle in src, needle


def test_wiring_grouped_in_prefill_and_extend_only_on_cuda():
    """Traced for CUDA, prefill / extend call the grouped kernels and decode the fused decode
    kernels; the kernels come scheduled and survive the fuse phase; traced for LLVM, the
    gathers everywhere."""
    from dsv2_mlc.compiler.compile import _export
    from dsv2_mlc.passes.pipeline import PHASES, PipelineOptions

    cfg = DeepseekV2Config.from_hf(CONFIG_A)
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    llvm = tvm.target.Target({"kind": "llvm"})
    grouped_kernels = {"moe_align", "moe_grouped_q4_gate_up", "moe_grouped_q4_down"}
    grouped_kernels.add("moe_grouped_q4_combine")
    for target, expect in ((cuda, True), (llvm, False)):
        mod, _, _ = _export(cfg, target, get_quantization("q4f16_g32"))
        with target:
            passes = [p for name, make in PHASES[:3] for p in make(target, PipelineOptions())]
            mod = tvm.transform.Sequential(passes)(mod)
        for entry in ("batch_prefill", "batch_extend", "batch_decode"):
            called = {gv.name_hint for gv in _called(mod[entry])}
            uses = grouped_kernels <= called
            assert uses == (expect and entry != "batch_decode"), (target.kind.name, entry)
            assert not (called & grouped_kernels) or uses
            gather = any(name.startswith("moe_gate_up_q4") for name in called)
            fused = "moe_decode_gate_up" in called  # INT4 decode on CUDA: moe_decode_cuda
            if expect and entry == "batch_decode":
                assert fused and not gather, (entry, sorted(called))
            else:
                assert gather != uses and not fused, (entry, sorted(called))
        for gv, func in mod.functions_items():
            if gv.name_hint in grouped_kernels:
                assert func.attrs["tirx.is_scheduled"], gv.name_hint


def _called(func) -> set:
    found = set()

    def visit(e):
        if isinstance(e, tvm.relax.Call) and e.op == tvm.ir.Op.get("relax.call_tir"):
            found.add(e.args[0])

    tvm.relax.analysis.post_order_visit(func, visit)
    return found


def test_grouped_gemm_te_float_weights():
    """The float (q0f16) experts go through the same kernels with ``read_float_weight``."""
    from dsv2_mlc.model.moe import read_float_weight

    hidden, inter, num_experts, top_k, tm, n = 64, 32, 8, 2, 16, 9
    rng = np.random.default_rng(7)
    idx = random_routing(rng, n, num_experts, top_k, skew=False)
    weights = rng.random((n, top_k)).astype(np.float32)
    x = rng.standard_normal((n, hidden)).astype(np.float16)
    w_gu = (rng.standard_normal((num_experts, 2 * inter, hidden)) / 8).astype(np.float16)
    w_dn = (rng.standard_normal((num_experts, hidden, inter)) / 6).astype(np.float16)
    want = ref_moe(x, weights, idx, w_gu.astype(np.float32), w_dn.astype(np.float32))
    a = _align(idx, num_experts, tm)
    n_tiles = a["rows"].shape[0]
    nt, nv = tirx.Var("nt", "int64"), tirx.Var("n", "int64")
    rows = te.placeholder((nt, tm), "int32", name="rows")
    tile_expert = te.placeholder((nt,), "int32", name="tile_expert")
    xt = te.placeholder((nv, hidden), "float16", name="x")
    wgu = te.placeholder(w_gu.shape, "float16", name="wgu")
    hid_t = te.placeholder((nt, tm, inter), "float16", name="hid")
    wdn = te.placeholder(w_dn.shape, "float16", name="wdn")
    gu = grouped.grouped_gemm_te(
        xt, rows, tile_expert, [wgu], read_float_weight, inter, 2, True, "gu"
    )
    dn = grouped.grouped_gemm_te(
        hid_t, rows, tile_expert, [wdn], read_float_weight, hidden, 1, False, "dn"
    )
    f_gu = te.create_prim_func([xt, rows, tile_expert, wgu, gu])
    f_dn = te.create_prim_func([hid_t, rows, tile_expert, wdn, dn])
    f_comb = _gemm_funcs(nt, nv, hidden, inter, num_experts, top_k, tm, 32)[2]
    rt = [a["rows"], a["tile_expert"]]
    (hid,) = _run(f_gu, [x, *rt, w_gu], [((n_tiles, tm, inter), "float16")])
    (down,) = _run(f_dn, [hid, *rt, w_dn], [((n_tiles, tm, hidden), "float16")])
    (out,) = _run(f_comb, [down, a["inv"], weights], [((n, hidden), "float16")])
    scale = float(np.abs(want.astype(np.float32)).max())
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=2e-2, atol=1e-2 * scale)


# -- 64-bit offsets for stacked experts of 2**31 elements or more ------------------------------
def _nodes(root: object) -> list[object]:
    """Every TIR node reachable from ``root`` through its fields (not spans or types), once."""
    out, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if isinstance(node, tvm_ffi.Array):
            stack.extend(node)
            continue
        if not isinstance(node, tvm_ffi.Object) or isinstance(node, tvm_ffi.Map):
            continue
        if node.__chandle__() in seen:
            continue
        seen.add(node.__chandle__())
        out.append(node)
        info = type(node).__tvm_ffi_type_info__
        while info is not None:
            stack.extend(getattr(node, f.name) for f in info.fields if f.name not in ("span", "ty"))
            info = info.parent_type_info
    return out


def _weight_offset_dtypes(func: tirx.PrimFunc, weight: str) -> tuple[set[str], set[str]]:
    """Lower a scheduled CUDA PrimFunc through TVM's TIR pipeline (no codegen, no nvcc) and return
    the dtypes of the flat offsets of every load of buffer ``weight`` in the device kernel and of
    every product in them, let-bound subexpressions included."""
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    with target:
        mod = tvm.tirx.transform.BindTarget(target)(mod)
        mod = tvm.tirx.get_default_tir_pipeline(target)[0](mod)
    (kernel,) = [gv for gv in mod.get_global_vars() if gv.name_hint != "main"]
    nodes = _nodes(mod[kernel].body)
    lets = {n.var.__chandle__(): n.value for n in nodes if isinstance(n, tvm.tirx.stmt.Bind)}
    offsets = [n.indices[0] for n in nodes if isinstance(n, TensorLoad) and n.source.name == weight]
    assert offsets, f"no load of {weight}"
    products, stack, seen = set(), list(offsets), set()
    while stack:
        for node in _nodes(stack.pop()):
            if isinstance(node, tirx.Mul):
                products.add(str(node.ty))
            handle = node.__chandle__()
            if isinstance(node, tirx.Var) and handle in lets and handle not in seen:
                seen.add(handle)
                stack.append(lets[handle])
    return {str(o.ty) for o in offsets}, products


@pytest.mark.parametrize(
    ("experts", "hidden", "inter", "halves", "wide"),
    [
        (160, 5120, 1536, 2, True),  # V2 gate/up: 160 x 3072 x 5120 = 2.5e9 elements
        (160, 5120, 1536, 1, False),  # V2 down: 160 x 5120 x 1536 = 1.26e9
        (64, 2048, 1408, 2, False),  # V2-Lite gate/up: 64 x 2816 x 2048 = 3.7e8
    ],
)
def test_float_expert_offsets_are_64_bit_past_int32(
    experts: int, hidden: int, inter: int, halves: int, wide: bool
):
    """Float16 stacked experts (q0f16) come to the grouped GEMM with int32 shapes (Python ints,
    as ``grouped_experts`` builds them); the weight's flat offset ``expert * stride + ...`` must
    be 64-bit arithmetic where the tensor has 2**31 elements or more (in 32 bits it wraps from
    expert 137 of V2's gate/up: an illegal address on the GPU) and stays 32-bit below (V2-Lite's
    and V2's down kernels unchanged)."""
    from dsv2_mlc.model.moe import read_float_weight

    nt, n = tirx.Var("nt", "int64"), tirx.Var("n", "int64")
    rows = te.placeholder((nt, grouped.TM), "int32", name="rows")
    tile_expert = te.placeholder((nt,), "int32", name="tile_expert")
    gate_up = halves == 2
    red, out_dim = (hidden, inter) if gate_up else (inter, hidden)
    x_shape = (n, red) if gate_up else (nt, grouped.TM, red)
    x = te.placeholder(x_shape, "float16", name="x")
    w = te.placeholder((experts, halves * out_dim, red), "float16", name="w0")
    assert (grouped.wide_index(w) is w) is not wide
    func = grouped.grouped_gemm_cuda(
        x, rows, tile_expert, [w], read_float_weight, out_dim, halves, gate_up, "gemm"
    )
    offsets, products = _weight_offset_dtypes(func, "w0")
    want = {"int64"} if wide else {"int32"}
    assert offsets == want
    assert products == want
