"""Kernel lab, MLA attention over the paged latent cache: TVM 0.27's kernel vs our variants.

``python schedules/lab/kernel_lab_mla.py prepare`` (build box, TVM + nvcc, no GPU): compiles
TIR-only libraries for CUDA sm_90 (precompiled fatbins, :mod:`dsv2_mlc.compiler.cuda`) into the
lab folder: ``mla_tvm.so`` (TVM's ``batch_prefill_paged_kv_mla``, what
``TIRPagedKVCache(attn_kind="mla")`` uses for decode and extend) and one ``mla_<variant>.so`` per
entry of :data:`VARIANTS` (:func:`dsv2_mlc.schedules.mla_attention_cuda.build_mla_attention`
with the shipped tiles of ``schedules/tiles.py`` changed by those fields; ``ours`` = the shipped
tiles, what the model uses), ``mla_extend.so`` (the row-tiled extend kernel of
:mod:`dsv2_mlc.schedules.mla_extend_cuda` alone) and ``mla_slot.so`` (``ours`` with the extend
branch: what the cache builds), all for V2-Lite's shapes (16 heads, latent 512, rope 64, fp16, page
size 16), plus ``manifest.json`` (which lists them).

``python3 schedules/lab/kernel_lab_mla.py run --lib-dir LIBS`` (GPU machine, ``LIBS`` holding
TVM's runtime libraries; needs torch and ``tvm_ffi``, compiles nothing, never imports tvm):
random q / pages / page tables for decode
(batch 1, 4, 16 x context 512, 4K, 32K), an extend case (several rows per sequence, causal 0
and 1) and a batch with an empty sequence; runs every kernel of the manifest, checks it against a
float32 torch reference (relative L2 of ``out``, max ``lse`` error over finite entries, ``-inf``
rows), times it with CUDA events (median of several loops of back-to-back calls) and prints one
table (case x kernel, us; ``!`` marks a wrong result) plus an error summary per kernel.
``--only a,b`` restricts the kernels, ``--cases substr`` the cases. ``--cupti`` adds a second
table, the GPU kernel time per call (split + merge kernels, CUPTI through ``torch.profiler``,
one profiler session per case): what a CUDA-graph decode step pays besides ~1.1 us per launch,
without the ``tvm_ffi`` call overhead that dominates the event times of calls below ~15 us.

``--kv fp8`` (both commands): the split-KV kernel over the FP8 (e4m3) latent cache
(:mod:`dsv2_mlc.schedules.kv_fp8`'s storage) at long decode contexts (:data:`FP8_CASES`: batch 1
at 4K, 32K, 128K, batch 4 at 32K), in its own small folder (``schedules/build/lab_mla8``;
``--lab-dir``).
``prepare --kv fp8 [--kv-scale S]`` first runs :func:`selfcheck` (the pages and reference the
GPU run builds against the model's quantisation kernel, ml_dtypes, a float64 NumPy reference and
the product's CPU FP8 attention, with a control that must fail; ``--check-only``: that alone),
then builds :data:`FP8_VARIANTS` (the shipped FP8 tiles with fields changed; a variant the
builder refuses is skipped with its message) and ``ours16`` (the shipped float16 kernel over a
float16 cache, the reference bytes/s), recording each one's kv dtype and scale, tiles, shared
memory, registers (read from the cubin), blocks an SM holds and grid at each case
(``mla_lab_fp8.grid``: the builder's formulas). ``run --kv fp8`` checks every kernel against the
float32 torch reference over the dequantized rows (``!`` if wrong), times it with CUDA events
hot (one page pool) and cold (rotating over copies of the pool totalling >= 256 MB, so the
pages come from HBM as in a decode step, where each layer has its own cache) and with
``--cupti`` the split and merge kernels apart, and prints one table with the split kernel's
bytes/s (split bytes = tokens x row bytes / split time, cold); ``--out``: ``mla_lab_fp8.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lab_common  # noqa: E402
import mla_lab_fp8 as fp8  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAB_DIR = ROOT / "build" / "lab"
HEADS, LATENT, ROPE, PAGE = fp8.HEADS, fp8.LATENT, fp8.ROPE, fp8.PAGE
# name -> MLAAttentionTiles fields changed from the shipped tiles ("ours": none): the pipelined
# split block's ring depth, pages per split and the grid's splits (schedules/results/
# mla_attention.md has what each measured)
VARIANTS: dict[str, dict] = {
    "ours": {},
    "pipe2": dict(stages=2, min_pages_per_split=1),
    "pipe3_pp2": dict(min_pages_per_split=2, max_split=128, target_blocks=264),
    "pipe3_pp2_s256": dict(min_pages_per_split=2),
    "pipe5_pp4": dict(stages=5, min_pages_per_split=4, max_split=128, target_blocks=264),
    "pipe5_pp2_s256": dict(stages=5, min_pages_per_split=2),
}
# A variant that sets its own pages per split keeps them at every length (no long-row tier).
NO_LONG_TIER = 1 << 30
for _kwargs in VARIANTS.values():
    if "min_pages_per_split" in _kwargs:
        _kwargs.setdefault("long_pages", NO_LONG_TIER)
BAD_REL, BAD_LSE = 2e-3, 1e-3  # a result worse than this is flagged "!"

# --kv fp8: the split-KV kernel over the FP8 (e4m3) latent cache at long contexts, in its own
# small lab folder (carried to the GPU machine). name -> fields changed from the shipped FP8
# tiles (tiles.py, key (16, 512, 64, "e4m3"): G=2 pages a step, 4 stages); "ours16" is the
# shipped float16 kernel over a float16 cache at the same cases (its bytes/s for comparison).
FP8_LAB_DIR = ROOT / "build" / "lab_mla8"
# The first round (ring depth, splits; schedules/results/mla_attention.md, "The FP8 cache's split
# kernel at batch 1") found the block latency-bound at 2 blocks an SM, capped by registers; this
# round caps the registers (min_blocks) so that 3 or 4 blocks fit, with the splits to fill them.
FP8_VARIANTS: dict[str, dict] = {
    "ours8": {},
    "f8_g1_s3": dict(pages_per_step=1, stages=3),
    "f8_g1_s3_b3": dict(pages_per_step=1, stages=3, min_blocks=3, max_split=396,
                        target_blocks=396),
    "f8_t256_mc128": dict(target_blocks=256, merge_cols=128),
    # the lab's streams block (schedules/lab/mla_streams_cuda.py): independent page streams of
    # 2 or 4 warps, one split a block for one wave of 1 or 2 blocks an SM
    "f8_w2_s2_t132": dict(pages_per_step=1, stages=2, stream_warps=2, target_blocks=132,
                          max_split=132),
    "f8_w4_s2_t264": dict(pages_per_step=1, stages=2, stream_warps=4, target_blocks=264,
                          max_split=264),
    "f8_w4_s3_t132": dict(pages_per_step=1, stages=3, stream_warps=4, target_blocks=132,
                          max_split=132),
    # the register-staged wgmma block (schedules/lab/mla_wgmma_rs.py, shipped for sm_90 as
    # f8_wgc_t132 before the warp-specialized block) and its lab variants
    # (schedules/lab/mla_wgmma_variants.py, BLOCKS): 64 tokens a step, one block an SM, one wave
    **{
        f"f8_{name}_t132": dict(pages_per_step=4, stages=8, block=block, target_blocks=132,
                                max_split=132)
        for name, block in (("wg_s8", "wgmma"), ("wgs", "wgmmas"), ("wgc", "wgmmac"),
                            ("wgd", "wgmmad"), ("wg2", "wgmma2"), ("wgw", "wgmmaw"),
                            ("wgh", "wgmmah"))
    },
    # the shipped block (schedules/mla_wgmma_cuda.py: a producer warpgroup loads and converts
    # the rows into two key tiles, two consume them), its merge over 32 columns, and its lab
    # variant with a step's P V overlapping the next step's scores (schedules/lab/mla_wgmma_rs.py)
    "f8_ws_t132": dict(pages_per_step=4, stages=8, block="shipped", target_blocks=132,
                       max_split=132),
    "f8_ws_t132_mc32": dict(pages_per_step=4, stages=8, block="shipped", target_blocks=132,
                            max_split=132, merge_cols=32),
    "f8_wso_t132": dict(pages_per_step=4, stages=8, block="ws_overlap", target_blocks=132,
                        max_split=132),
    "f8_ws1_t132": dict(pages_per_step=4, stages=8, block="ws_one", target_blocks=132,
                        max_split=132),
    "f8_wgc_t264": dict(pages_per_step=4, stages=8, block="wgmmac", target_blocks=264,
                        max_split=264),
    "f8_wgc_t264_b2": dict(pages_per_step=4, stages=8, block="wgmmac", target_blocks=264,
                           max_split=264, min_blocks=2),
}  # fmt: skip
F16_KERNEL = "ours16"
# the float16 cache's kernel with its registers capped likewise (its name -> fields changed)
F16_VARIANTS: dict[str, dict] = {
    "f16_b3": dict(min_blocks=3, max_split=396, target_blocks=396),
    # fewer splits at large batches (256 blocks: one a row at 256 rows), fewer merge blocks
    "f16_t256": dict(target_blocks=256),
    "f16_mc128": dict(merge_cols=128),
    "f16_t256_mc128": dict(target_blocks=256, merge_cols=128),
    "f16_w2_s2_t132": dict(stages=2, stream_warps=2, target_blocks=132, max_split=132),
    "f16_w4_s2_t264": dict(
        stages=2, stream_warps=4, target_blocks=264, max_split=264, min_blocks=2
    ),
    "f16_w4_s3_t132": dict(stages=3, stream_warps=4, target_blocks=132, max_split=132),
    "f16_wg_s8_t132": dict(
        pages_per_step=4, stages=8, block="wgmma", target_blocks=132, max_split=132
    ),
}
FP8_CASES: list[tuple[str, list[int]]] = [
    ("b1 4K", [4096]),
    ("b1 32K", [32768]),
    ("b1 128K", [131072]),
    ("b4 32K", [32768] * 4),
    ("b256 1K", [1024] * 256),  # a large decode batch (the float16 cache at 256 sequences)
]


# -- here: builds ----------------------------------------------------------------------------------
def variant(base, kw: dict) -> tuple:
    """``(tiles, block)`` of a variant's fields over ``base``: ``block`` the lab's streams block
    of that many warps a stream (schedules/lab/mla_streams_cuda.py), ``"wgmma"`` the lab's
    wgmma block (schedules/lab/mla_wgmma_variants.py), 0 the shipped pipelined block."""
    kw = dict(kw)
    sw = kw.pop("stream_warps", 0)
    block = kw.pop("block", None)  # a name of mla_wgmma_variants.BLOCKS, + ":parts" cut out
    if block == "shipped":  # the product's wgmma block: its tile field
        kw["block"] = "wgmma"
    elif block is not None:
        sw = block + (f":{kw.pop('ablate')}" if "ablate" in kw else "")
    return replace(base, **kw), sw


def build_variant(tiles, stream_warps: int, kv_scale: float | None):
    """The split-KV PrimFunc of a variant at V2-Lite's shapes (float16 q; ``kv_scale``: FP8)."""
    from dsv2_mlc.schedules.mla_attention_cuda import build_mla_attention

    if str(stream_warps).startswith("ws_"):  # the shipped block's lab variants
        from mla_wgmma_rs import build_ws_variant

        name, _, parts = stream_warps.partition(":")
        return build_ws_variant(
            HEADS, LATENT, ROPE, "float16", replace(tiles, block="wgmma"), kv_scale,
            overlap=name == "ws_overlap", parts=parts or None,
            producers=1 if name == "ws_one" else 2,
        )  # fmt: skip
    if str(stream_warps).startswith("wgmma"):
        from mla_wgmma_variants import build_wgmma_variant

        block, _, parts = stream_warps.partition(":")
        return build_wgmma_variant(
            HEADS, LATENT, ROPE, "float16", tiles, block, kv_scale, parts or None
        )
    if stream_warps:
        from mla_streams_cuda import build_streams_variant

        return build_streams_variant(HEADS, LATENT, ROPE, "float16", tiles, stream_warps, kv_scale)
    return build_mla_attention(HEADS, LATENT, ROPE, "float16", tiles, kv_scale)


def prepare(args: argparse.Namespace) -> int:
    """Compile TVM's kernel and every variant for CUDA into build/lab (no GPU needed); with
    ``--kv fp8`` the FP8 lab (:func:`prepare_fp8`)."""
    if args.kv == "fp8":
        return prepare_fp8(args)
    from dsv2_mlc.compiler.cuda import make_cuda_target

    target = make_cuda_target(args.arch)
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_mla

    from dsv2_mlc.schedules.mla_attention_cuda import build_mla_attention
    from dsv2_mlc.schedules.tiles import tuned

    lab_common.fresh_lab_dir(LAB_DIR, "mla_*.so")
    funcs = {"tvm": _attention_prefill_mla(HEADS, LATENT, ROPE, "float16", False, target)}
    for name, kwargs in VARIANTS.items():
        tiles = replace(tuned("mla_attention"), **kwargs)
        funcs[name] = build_mla_attention(HEADS, LATENT, ROPE, "float16", tiles)
    from dsv2_mlc.schedules.mla_extend_cuda import mla_extend_cuda, with_extend_path

    # the row-tiled extend kernel alone, and the slot function as the cache builds it
    funcs["extend"] = mla_extend_cuda(HEADS, LATENT, ROPE, "float16")
    funcs["slot"] = with_extend_path(funcs["ours"], HEADS, LATENT, ROPE, "float16")
    built = lab_common.build_libraries(
        funcs, LAB_DIR, "mla", args.arch, target, VARIANTS, "TVM _attention_prefill_mla"
    )
    manifest = {
        **lab_common.manifest_header(args.arch),
        "shapes": {"heads": HEADS, "latent": LATENT, "rope": ROPE, "page_size": PAGE},
        "kernels": built,
    }
    lab_common.write_manifest(LAB_DIR, manifest)
    return 0


# -- there: measurement ----------------------------------------------------------------------------
def _case(
    torch, kv_lens: list[int], q_lens: list[int], causal: int, seed: int, dev: str = "cuda"
) -> dict:
    """Random inputs of one case: sequence i has kv_lens[i] cached tokens and q_lens[i] rows."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    n_pages = [math.ceil(n / PAGE) for n in kv_lens]
    total_pages = max(sum(n_pages), 1)
    perm = torch.randperm(total_pages, generator=gen, device=dev).to(torch.int32)
    page_indptr = torch.tensor([0, *torch.tensor(n_pages).cumsum(0).tolist()], dtype=torch.int32)
    qo_indptr = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    last = [(n - 1) % PAGE + 1 if n > 0 else 0 for n in kv_lens]
    d = LATENT + ROPE
    total = int(qo_indptr[-1])
    pages = torch.randn(total_pages, PAGE, d, generator=gen, device=dev).to(torch.float16)
    q = (torch.randn(total, HEADS, d, generator=gen, device=dev) * 0.5).to(torch.float16)
    return {
        "q": q,
        "qo_indptr": qo_indptr.to(dev),
        "pages": pages,
        "page_indptr": page_indptr.to(dev),
        "page_indices": perm[: sum(n_pages)].contiguous() if sum(n_pages) else perm[:1],
        "length_info": torch.tensor(last, dtype=torch.int32, device=dev),
        "causal": causal,
        "sm_scale": 1.0 / math.sqrt(128 + 64),
        "kv_lens": kv_lens,
        "q_lens": q_lens,
    }


def _reference(torch, c: dict):
    """float32 attention per sequence: (out[total, H, L], lse[total, H] base 2). The keys are
    the case's pages (float16) or, for an FP8 case, its dequantized rows ``c["kv"]``."""
    q, pages = c.get("q_ref", c["q"]).float(), c["pages"]
    dev = q.device
    out = torch.zeros(q.shape[0], HEADS, LATENT, device=dev)
    lse = torch.full((q.shape[0], HEADS), -math.inf, device=dev)
    pin, qin = c["page_indptr"].tolist(), c["qo_indptr"].tolist()
    idx = c["page_indices"].long()
    for i, kv_len in enumerate(c["kv_lens"]):
        rows = slice(qin[i], qin[i + 1])
        if kv_len == 0 or qin[i + 1] == qin[i]:
            continue
        if "kv" in c:
            kv = c["kv"][i]
        else:
            kv = pages[idx[pin[i] : pin[i + 1]]].reshape(-1, LATENT + ROPE)[:kv_len].float()
        s = torch.einsum("rhd,kd->rhk", q[rows], kv) * c["sm_scale"]
        if c["causal"]:
            n = qin[i + 1] - qin[i]
            r = torch.arange(n, device=dev)[:, None, None]
            k = torch.arange(kv_len, device=dev)[None, None, :]
            s = s.masked_fill(k >= kv_len - n + r + 1, -math.inf)
        ln = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - ln[..., None]).nan_to_num(0.0)
        out[rows] = torch.einsum("rhk,kd->rhd", p, kv[:, :LATENT])
        lse[rows] = ln / math.log(2)
    return out, lse


def _args(c: dict, out, lse, pages=None) -> list:
    """The ABI's arguments, tensors as tvm_ffi tensors (DLPack, no copy); ``pages``: another
    copy of the case's page pool (the cold-cache timing rotates over copies)."""
    names = ("q", "qo_indptr", "pages", "page_indptr", "page_indices", "length_info")
    tensors = [c[k] for k in names] + [out, lse]
    if pages is not None:
        tensors[2] = pages
    return lab_common.ffi_tensors(*tensors) + [c["causal"], c["sm_scale"]]


def _outputs(torch, c: dict):
    """Fresh ``out`` and ``lse`` (filled with 7) of the ABI's shapes (FP8: pseudo-heads)."""
    n, heads, width = c["q"].shape[0], c["q"].shape[1], c.get("out_width", LATENT)
    dev = c["q"].device
    out = torch.full((n, heads, width), 7.0, dtype=torch.float16, device=dev)
    return out, torch.full((n, heads), 7.0, dtype=torch.float32, device=dev)


def _call(torch, func, c: dict):
    out, lse = _outputs(torch, c)
    func(*_args(c, out, lse))
    return out, lse


def _errors(torch, got, ref) -> dict:
    """Errors of ``got`` (the ABI's out / lse; FP8: pseudo-heads, each carrying its head's lse)
    against ``ref`` (out[total, H, L], lse[total, H])."""
    out, lse = got
    r_out, r_lse = ref
    out = out.reshape(r_out.shape)
    lse = lse.reshape(*r_lse.shape, -1)  # [total, H, pseudo-heads a head]
    rel = float((out.float() - r_out).norm() / r_out.norm().clamp_min(1e-30))
    fin = torch.isfinite(r_lse)
    lse_err = float((lse[fin] - r_lse[fin][:, None]).abs().max()) if bool(fin.any()) else 0.0
    empty_ok = bool((lse[~fin] == -math.inf).all()) and bool((out[~fin] == 0).all())
    nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
    return {"rel_l2": rel, "lse_max_err": lse_err, "empty_rows_ok": empty_ok, "nan": nan}


def _time(torch, func, c: dict, budget_s: float) -> float:
    """Median seconds per call over loops of back-to-back calls (CUDA events)."""
    return lab_common.time_call(torch, func, _args(c, *_call(torch, func, c)), budget_s)


def _kernel_times(torch, kernels: dict, c: dict, reps: int = 32) -> dict[str, float]:
    """Seconds of GPU kernel time per call (CUPTI via ``torch.profiler``: the durations of a
    kernel's split and merge launches, no launch gaps or host overhead), ``key -> s``, for all
    kernels of one case in one profiler session (``reps`` calls each, after a warm-up call)."""
    calls = {k: (f, [_args(c, *_call(torch, f, c))]) for k, f in kernels.items()}
    return {k: sum(v) for k, v in _split_merge_times(torch, calls, reps).items()}


def _split_merge_times(torch, calls: dict, reps: int = 32) -> dict[str, tuple[float, float]]:
    """``key -> (split s, merge s)`` per call (CUPTI via ``torch.profiler``), for ``calls`` of
    ``key -> (function, [argument lists])`` in one profiler session: ``reps`` calls each,
    rotating over its argument lists (after a warm-up call on each)."""
    import re

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for f, argsets in calls.values():
        for a in argsets:
            f(*a)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for f, argsets in calls.values():
            for i in range(reps):
                f(*argsets[i % len(argsets)])
        torch.cuda.synchronize()
    # The library of kernel `key` exports `mla_<key>`; its kernels are `mla_<key>_kernel` (the
    # split kernel, the PrimFunc's first) and `mla_<key>_kernel_1` (the merge kernel).
    pattern = re.compile(r"mla_(.+)_kernel(_\d+)?$")
    sums = {k: [0.0, 0.0] for k in calls}
    for e in prof.events():
        m = pattern.match(e.name) if e.device_type == DeviceType.CUDA else None
        if m and m.group(1) in sums:
            sums[m.group(1)][1 if m.group(2) else 0] += e.time_range.elapsed_us()
    return {k: (v[0] / reps / 1e6, v[1] / reps / 1e6) for k, v in sums.items()}


def _bad(e: dict) -> bool:
    return (
        not e["rel_l2"] <= BAD_REL
        or not e["lse_max_err"] <= BAD_LSE
        or not e["empty_rows_ok"]
        or e["nan"]
    )


def run(args: argparse.Namespace) -> int:
    """Check and time every kernel on every case; print the table, write results JSON; with
    ``--kv fp8`` the FP8 lab (:func:`run_fp8`)."""
    if args.kv == "fp8":
        return run_fp8(args)
    import torch

    kernels = lab_common.load_kernels(args.lib_dir, LAB_DIR, args.only)
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    cases: list[tuple[str, list[int], list[int], int]] = []
    for batch in (1, 4, 16):
        for ctx in (512, 4096, 32768):
            cases.append((f"dec b{batch} {ctx}", [ctx] * batch, [1] * batch, 0))
    cases.append(("ext b2 q37 1000 c0", [1000, 1000], [37, 37], 0))
    cases.append(("ext b2 q37 1000 c1", [1000, 1000], [37, 37], 1))
    cases.append(("ext b1 q512 4096 c0", [4096], [512], 0))
    cases.append(("mixed q[1,3,2] [77,0,300]", [77, 0, 300], [1, 3, 2], 0))
    # long extends (the chunks of a long prompt; schedules/results/mla_extend.md)
    cases.append(("ext b1 q2048 16384 c0", [16384], [2048], 0))
    cases.append(("ext b1 q4096 16384 c0", [16384], [4096], 0))
    cases.append(("ext b2 q1024 8192 c0", [8192, 3000], [1024, 1024], 0))
    keys = list(kernels)
    width = max(8, *(len(k) + 1 for k in keys))
    print("us per call ('!' = wrong result)")
    print(f"{'case':26s}" + "".join(f"{k:>{width}s}" for k in keys), flush=True)
    results = []
    for i, (name, kv_lens, q_lens, causal) in enumerate(cases):
        if args.cases and args.cases not in name:
            continue
        c = _case(torch, kv_lens, q_lens, causal, seed=i)
        ref = _reference(torch, c)
        row: dict = {"case": name, "kv_lens": kv_lens, "q_lens": q_lens, "causal": causal}
        n_tok = sum(kv_lens)
        total = sum(q_lens)
        row["bytes"] = n_tok * (LATENT + ROPE) * 2 + total * HEADS * (LATENT + ROPE + LATENT) * 2
        cells = []
        for key, func in kernels.items():
            try:
                got = _call(torch, func, c)
                torch.cuda.synchronize()
                row[key] = _errors(torch, got, ref)
                budget = args.budget_per_case_s / (4 if key == "tvm" else 1)
                row[key]["s"] = _time(torch, func, c, budget)
                mark = "!" if _bad(row[key]) else " "
                cells.append(f"{row[key]['s'] * 1e6:{width - 1}.1f}{mark}")
            except Exception as err:  # noqa: BLE001 - report and go on with the next kernel
                row[key] = {"error": str(err)[:300]}
                cells.append(f"{'ERR':>{width}s}")
        if args.cupti:  # ours only (TVM's kernel takes up to 0.25 s a call)
            ok = {k: f for k, f in kernels.items() if k != "tvm" and "rel_l2" in row[k]}
            try:
                for key, sec in _kernel_times(torch, ok, c).items():
                    row[key]["kernel_s"] = sec
            except Exception as err:  # noqa: BLE001 - the event times stand without it
                print(f"  (profiler failed: {str(err)[:200]})")
        del c, ref
        torch.cuda.empty_cache()
        results.append(row)
        print(f"{name:26s}" + "".join(cells), flush=True)
    print("errors: max rel L2 / max lse err / empty rows ok / nan")
    for key in keys:
        errs = [r[key] for r in results if key in r and "rel_l2" in r[key]]
        failed = sum(1 for r in results if key in r and "error" in r[key])
        if errs:
            print(
                f"  {key:12s} {max(e['rel_l2'] for e in errs):.1e} "
                f"{max(e['lse_max_err'] for e in errs):.1e} "
                f"{all(e['empty_rows_ok'] for e in errs)} {any(e['nan'] for e in errs)}"
                + (f"  ({failed} cases raised)" if failed else "")
            )
        else:
            print(f"  {key:12s} all cases raised")
    if args.cupti:
        print("GPU kernel time per call, us (CUPTI: split + merge kernels, no launch gaps)")
        print(f"{'case':26s}" + "".join(f"{k:>{width}s}" for k in keys))
        for r in results:
            cells = [r.get(k, {}).get("kernel_s") for k in keys]
            print(
                f"{r['case']:26s}"
                + "".join(f"{x * 1e6:{width}.2f}" if x else f"{'-':>{width}s}" for x in cells)
            )
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "mla_lab.json").write_text(
            json.dumps({"gpu": props.name, "torch": torch.__version__, "cases": results}, indent=1)
        )
    return 0


def prepare_fp8(args: argparse.Namespace) -> int:
    """The FP8 lab: :func:`selfcheck` (the pages the GPU run builds are the model's), then the
    FP8 variants and the float16 kernel (``ours16``, for its bytes/s) compiled into the FP8 lab
    folder, with their shared memory, registers and launch at each case in the manifest."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("FP8 self-check skipped: no torch here")
    else:
        if not selfcheck(args.kv_scale):
            print("FP8 self-check FAILED: the lab's FP8 pages or reference are wrong")
            return 1
    if args.check_only:
        return 0
    from mla_streams_cuda import streams_shared_halves
    from mla_wgmma_variants import block_shared_halves

    from dsv2_mlc.compiler.cuda import make_cuda_target
    from dsv2_mlc.errors import Dsv2Error
    from dsv2_mlc.schedules.mla_cuda_helpers import pipe_shared_halves
    from dsv2_mlc.schedules.mla_wgmma_cuda import layout as ws_layout
    from dsv2_mlc.schedules.tiles import tuned

    target = make_cuda_target(args.arch)
    lab_dir = Path(args.lab_dir) if args.lab_dir else FP8_LAB_DIR
    lab_common.fresh_lab_dir(lab_dir, "mla_*.so")
    base8, base16 = (
        tuned("mla_attention", shape=(HEADS, LATENT, ROPE, "e4m3")),
        tuned("mla_attention"),
    )

    wanted = [(k, *variant(base8, kw), args.kv_scale) for k, kw in FP8_VARIANTS.items()]
    wanted.append((F16_KERNEL, base16, 0, None))
    wanted += [(k, *variant(base16, kw), None) for k, kw in F16_VARIANTS.items()]
    from mla_wgmma_variants import CUT_OUT

    if args.only:  # the shipped kernels and the variants (or timing studies) named
        keep = {"ours8", F16_KERNEL, *args.only.split(",")}
        wanted = [w for w in wanted if w[0] in keep]
        wanted += [
            (k, *variant(base8 if fp8_ else base16, kw), args.kv_scale if fp8_ else None)
            for k, (fp8_, kw) in CUT_OUT.items()
            if k in keep
        ]
    funcs, info, skipped = {}, {}, {}
    for name, tiles, sw, scale in wanted:
        try:
            funcs[name] = build_variant(tiles, sw, scale)
        except (Dsv2Error, ValueError) as err:  # the builder's smem / multiple rules
            skipped[name] = str(err)
            change = {**FP8_VARIANTS, **F16_VARIANTS}.get(name, CUT_OUT.get(name, (0, {}))[1])
            print(f"{name}: SKIPPED, the builder refuses {change}: {err}", flush=True)
            continue
        g = tiles.pages_per_step
        if (tiles.block == "wgmma" and not sw) or str(sw).startswith("ws_"):
            smem = ws_layout(LATENT + ROPE, LATENT)["bytes"]
        elif str(sw).startswith("wgmma"):
            block = sw.partition(":")[0]
            smem = 2 * block_shared_halves(block, LATENT + ROPE, LATENT, tiles.stages, bool(scale))
        elif sw:
            smem = 2 * streams_shared_halves(LATENT + ROPE, LATENT, tiles.stages, sw, bool(scale))
        else:
            smem = 2 * pipe_shared_halves(LATENT + ROPE, tiles.stages, LATENT if scale else 0, g)
        info[name] = {
            "kv": "float16" if scale is None else "e4m3",
            "kv_scale": scale,
            "row_bytes": fp8.F16_ROW_BYTES if scale is None else fp8.FP8_ROW_BYTES,
            "tiles": {**asdict(tiles), "stream_warps": sw},
            "smem_bytes": smem,
            "grid": {c: fp8.grid(tiles, lens) for c, lens in FP8_CASES},
        }
    kwargs = {**FP8_VARIANTS, F16_KERNEL: "the shipped float16 tiles", **F16_VARIANTS}
    kwargs.update({k: kw for k, (_, kw) in CUT_OUT.items()})
    built = lab_common.build_libraries(funcs, lab_dir, "mla", args.arch, target, kwargs, "")
    for key, entry in built.items():
        entry.update(info[key])
        res = fp8.kernel_resources(lab_dir / entry["library"])
        entry["split_kernel"] = res.get(f"mla_{key}_kernel", {})
        entry["merge_kernel"] = res.get(f"mla_{key}_kernel_1", {})
        entry.update(fp8.occupancy(entry["smem_bytes"], entry["split_kernel"].get("regs")))
    manifest = {
        **lab_common.manifest_header(args.arch),
        "shapes": {"heads": HEADS, "latent": LATENT, "rope": ROPE, "page_size": PAGE},
        "kv_scale": args.kv_scale,
        "cases": dict(FP8_CASES),
        "kernels": built,
        "skipped": skipped,
    }
    lab_common.write_manifest(lab_dir, manifest)
    total = sum(f.stat().st_size for f in lab_dir.iterdir())
    print(f"{lab_dir}: {len(built)} libraries, {total / 1e6:.1f} MB")
    return 0


def _time_rotating(torch, func, argsets: list, budget_s: float) -> float:
    """Median seconds per call of ``func`` over loops of back-to-back calls rotating over
    ``argsets`` (CUDA events)."""
    one = max(lab_common.wall_seconds(torch, lambda: func(*argsets[0])), 1e-6)
    inner, loops = lab_common.loop_counts(one, budget_s, max_inner=64, fill_s=0.02)

    def run_loop() -> None:
        for i in range(inner):
            func(*argsets[i % len(argsets)])

    return lab_common.event_median(torch, run_loop, inner, loops)


def run_fp8(args: argparse.Namespace) -> int:
    """Check and time the FP8 lab's kernels on the long-context decode cases: hot (one page
    pool, L2-resident below ~40 MB) and cold (rotating over pool copies); CUPTI split / merge
    times; bytes/s of the split kernel. Prints one table; JSON to ``--out``."""
    import torch

    lab_dir = Path(args.lab_dir) if args.lab_dir else FP8_LAB_DIR
    manifest = lab_common.read_manifest(lab_dir)
    meta = manifest["kernels"]
    kv_scale = manifest["kv_scale"]
    kernels = lab_common.load_kernels(args.lib_dir, lab_dir, args.only)
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    codes_ok = fp8.codes_agree(torch, kv_scale)
    print(
        f"FP8 cache: kv_scale {kv_scale}; device e4m3 codes = CPU's (checked against the model's "
        f"quantisation by prepare): {codes_ok}{'' if codes_ok else ' !'}; skipped by the "
        f"builder: {manifest['skipped'] or '-'}"
    )
    print(
        f"split bytes = tokens x row bytes (FP8: L + 2R = {fp8.FP8_ROW_BYTES} B; float16: "
        f"2 (L + R) = {fp8.F16_ROW_BYTES} B), the pages the split blocks read; TB/s = split bytes "
        "/ split kernel time (CUPTI, cold)"
    )
    for key in kernels:
        m, t = meta[key], meta[key]["tiles"]
        print(
            f"  {key:16s} kv {m['kv']:7s} G={t['pages_per_step']} stages={t['stages']} "
            f"max_split={t['max_split']} target={t['target_blocks']} "
            f"min_pps={t['min_pages_per_split']} long_min={t['long_min_pages']}>{t['long_pages']}"
            f" | smem {m['smem_bytes']} B, regs {m['split_kernel'].get('regs', '?')}, frame "
            f"{m['split_kernel'].get('frame_bytes', '?')} B -> {m['blocks_per_sm']} blocks/SM "
            f"(smem {m['blocks_per_sm_smem']}, regs {m['blocks_per_sm_regs']})"
        )
    head = (
        f"{'case':9s} {'kernel':16s} {'grid':>5s} {'act':>4s} {'pps':>4s} {'waves':>5s} "
        f"{'ev hot':>8s} {'ev cold':>8s} {'split':>8s} {'merge':>7s} {'split h':>8s} "
        f"{'TB/s':>5s}  err"
    )
    print("us per call: events (hot / cold), CUPTI split + merge (cold), split (hot)")
    print(head, flush=True)
    results = []
    for i, (name, kv_lens) in enumerate(FP8_CASES):
        if args.cases and args.cases not in name:
            continue
        cases = {}
        for kv in sorted({meta[k]["kv"] for k in kernels}):
            c = (
                fp8.case8(torch, kv_lens, i, kv_scale)
                if kv == "e4m3"
                else _case(torch, kv_lens, [1] * len(kv_lens), 0, seed=i)
            )
            cases[kv] = (c, _reference(torch, c), fp8.pools(torch, c))
        row: dict = {"case": name, "kv_lens": kv_lens, "tokens": sum(kv_lens)}
        calls_hot, calls_cold = {}, {}
        for key, func in kernels.items():
            c, ref, pools = cases[meta[key]["kv"]]
            r = row[key] = {"pools": len(pools), **meta[key]["grid"][name]}
            r["split_bytes"] = sum(kv_lens) * meta[key]["row_bytes"]
            try:
                got = _call(torch, func, c)
                torch.cuda.synchronize()
                r.update(_errors(torch, got, ref))
                outs = _outputs(torch, c)
                hot = [_args(c, *outs)]
                cold = [_args(c, *outs, pages=p) for p in pools]
                r["s_hot"] = lab_common.time_call(torch, func, hot[0], args.budget_per_case_s)
                r["s_cold"] = _time_rotating(torch, func, cold, args.budget_per_case_s)
                calls_hot[key], calls_cold[key] = (func, hot), (func, cold)
            except Exception as err:  # noqa: BLE001 - report and go on with the next kernel
                r["error"] = str(err)[:300]
        if args.cupti:
            try:
                for mode, calls in (("hot", calls_hot), ("cold", calls_cold)):
                    for key, (split, merge) in _split_merge_times(torch, calls).items():
                        row[key][f"split_s_{mode}"], row[key][f"merge_s_{mode}"] = split, merge
            except Exception as err:  # noqa: BLE001 - the event times stand without it
                print(f"  (profiler failed: {str(err)[:200]})")
        del cases, calls_hot, calls_cold
        torch.cuda.empty_cache()
        results.append(row)
        for key in kernels:
            r, m = row[key], meta[key]
            if "error" in r:
                print(f"{name:9s} {key:16s} ERROR {r['error'][:100]}")
                continue
            waves = r["active_blocks"] / (props.multi_processor_count * m["blocks_per_sm"])
            split = r.get("split_s_cold")
            tbs = r["split_bytes"] / split / 1e12 if split else None

            def us(x, w: int = 8, d: int = 1) -> str:
                return f"{x * 1e6:{w}.{d}f}" if x else f"{'-':>{w}s}"

            print(
                f"{name:9s} {key:16s} {r['grid_blocks']:5d} {r['active_blocks']:4d} "
                f"{max(r['pages_per_split']):4d} {waves:5.2f} {us(r['s_hot'])} "
                f"{us(r['s_cold'])} {us(split)} {us(r.get('merge_s_cold'), 7)} "
                f"{us(r.get('split_s_hot'))} {f'{tbs:5.2f}' if tbs else '    -'}  "
                f"{'!' if _bad(r) else ' '} {r['rel_l2']:.1e}/{r['lse_max_err']:.1e}",
                flush=True,
            )
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "mla_lab_fp8.json").write_text(
            json.dumps(
                {
                    "gpu": props.name,
                    "sms": props.multi_processor_count,
                    "torch": torch.__version__,
                    "codes_match_cpu": codes_ok,
                    "manifest": manifest,
                    "bytes_formula": "split_bytes = tokens * row_bytes (FP8 L + 2R = 640, "
                    "float16 2 (L + R) = 1152); TB/s = split_bytes / split_s_cold",
                    "cases": results,
                },
                indent=1,
            )
        )
    return 0


def selfcheck(kv_scale: float) -> bool:
    """The FP8 case builder against the product (build box, CPU torch + TVM): the codes of every
    finite float16 latent value equal ml_dtypes' and those of the model's quantisation kernel
    (``kv_fp8.quantize_latent``, CPU build); on a paged case, the torch float32 reference over
    the dequantized rows equals a float64 NumPy reference over the pages read back through the
    page table (ml_dtypes decode), and the product's CPU FP8 attention
    (``mla_cpu.mla_paged_attention_fp8_cpu``) over the pages passes the lab's error bounds, while
    pages with the two bytes of each latent slot swapped (control) fail them."""
    import ml_dtypes
    import numpy as np
    import torch
    import tvm

    from dsv2_mlc.schedules.kv_fp8 import quantize_latent
    from dsv2_mlc.schedules.mla_cpu import mla_paged_attention_fp8_cpu

    def llvm(func):
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        return tvm.compile(mod, "llvm")["main"]

    ok = {}
    # 1. codes of every finite float16 latent value
    x = fp8.finite_float16(np)
    want = np.clip(x.astype(np.float32) * np.float32(1.0 / kv_scale), -fp8.E4M3_MAX, fp8.E4M3_MAX)
    want = want.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    got = fp8.e4m3_codes(torch, torch.from_numpy(x), kv_scale).numpy()
    rope = np.random.default_rng(0).standard_normal((x.shape[0], ROPE)).astype(np.float16)
    rows = tvm.runtime.tensor(np.ascontiguousarray(np.concatenate([x, rope], axis=1)))
    slots = tvm.runtime.tensor(np.zeros((x.shape[0], LATENT // 2 + ROPE), np.float16))
    llvm(quantize_latent(LATENT, ROPE, "float16", kv_scale, cuda=False))(rows, slots)
    model = slots.numpy()
    ok["codes_vs_ml_dtypes"] = bool((got == want).all())
    ok["codes_vs_quantize_latent"] = bool(
        (np.ascontiguousarray(model[:, : LATENT // 2]).view(np.uint8) == got).all()
    )
    ok["rope_copied"] = bool(
        (model[:, LATENT // 2 :].view(np.uint16) == rope.view(np.uint16)).all()
    )
    # 2. a paged case: references and the product's CPU kernel over the lab's pages
    c = fp8.case8(torch, [37, 300, 16, 1], seed=3, kv_scale=kv_scale, dev="cpu")
    ref = _reference(torch, c)
    pages, pin = c["pages"].numpy(), c["page_indptr"].tolist()
    idx = c["page_indices"].numpy()
    q = c["q_ref"].numpy().astype(np.float64)
    worst_out = worst_lse = 0.0
    for b, n in enumerate(c["kv_lens"]):
        kv_rows = pages[idx[pin[b] : pin[b + 1]]].reshape(-1, LATENT // 2 + ROPE)[:n]
        lat = np.ascontiguousarray(kv_rows[:, : LATENT // 2]).view(ml_dtypes.float8_e4m3fn)
        keys = np.concatenate(
            [lat.astype(np.float64) * kv_scale, kv_rows[:, LATENT // 2 :].astype(np.float64)], 1
        )
        s = q[b] @ keys.T * c["sm_scale"] * math.log2(math.e)
        m = s.max(axis=1, keepdims=True)
        w = np.exp2(s - m)
        lse = m[:, 0] + np.log2(w.sum(axis=1))
        out = w / w.sum(axis=1, keepdims=True) @ keys[:, :LATENT]
        r_out = ref[0][b].double().numpy()
        worst_out = max(worst_out, float(np.linalg.norm(r_out - out) / np.linalg.norm(out)))
        worst_lse = max(worst_lse, float(np.abs(ref[1][b].double().numpy() - lse).max()))
    ok["reference_vs_numpy"] = worst_out < 1e-5 and worst_lse < 1e-4
    kernel = llvm(mla_paged_attention_fp8_cpu(HEADS, LATENT, ROPE, "float16", kv_scale))

    def cpu_kernel(page_array) -> dict:
        out, lse = _outputs(torch, c)
        names = ("q", "qo_indptr", "pages", "page_indptr", "page_indices", "length_info")
        arrays = [c[k].numpy() for k in names] + [out.numpy(), lse.numpy()]
        arrays[2] = page_array
        tensors = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays]
        kernel(*tensors, 0, c["sm_scale"])
        got = (torch.from_numpy(tensors[6].numpy()), torch.from_numpy(tensors[7].numpy()))
        return _errors(torch, got, ref)

    err = cpu_kernel(pages)
    swapped = pages.copy()
    lat16 = np.ascontiguousarray(swapped[..., : LATENT // 2]).view(np.uint16)
    swapped[..., : LATENT // 2] = lat16.byteswap().view(np.float16)
    err_control = cpu_kernel(swapped)
    ok["product_cpu_kernel"] = not _bad(err)
    ok["control_swapped_bytes_fails"] = _bad(err_control)
    print(
        f"FP8 self-check (kv_scale {kv_scale}): "
        + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in ok.items())
        + f"; reference vs NumPy rel {worst_out:.1e} lse {worst_lse:.1e}; product CPU kernel "
        f"rel {err['rel_l2']:.1e} lse {err['lse_max_err']:.1e}; control rel "
        f"{err_control['rel_l2']:.1e}",
        flush=True,
    )
    return all(ok.values())


def main(argv: list[str] | None = None) -> int:
    parser, p, r = lab_common.lab_parser(
        __doc__,
        "compile the kernels into build/lab (build box)",
        "check and time the kernels (GPU machine)",
    )
    lab_common.add_case_options(r, budget_per_case_s=0.3)
    r.add_argument("--cupti", action="store_true", help="also GPU kernel times (torch.profiler)")
    for sub in (p, r):
        sub.add_argument(
            "--kv", choices=("float16", "fp8"), default="float16", help="the cache's dtype"
        )
        sub.add_argument(
            "--lab-dir", default=None, help="FP8 lab folder (default schedules/build/lab_mla8)"
        )
    p.add_argument("--kv-scale", type=float, default=fp8.FP8_KV_SCALE, help="FP8 cache scale")
    p.add_argument("--check-only", action="store_true", help="FP8: the self-check alone")
    p.add_argument("--only", default=None, help="FP8: build the shipped kernels and these")
    args = parser.parse_args(argv)
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
