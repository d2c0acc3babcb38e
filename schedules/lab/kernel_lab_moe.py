"""Kernel lab, routed experts in prefill: the gather kernels (today) vs the grouped GEMMs, one GPU.

``python schedules/lab/kernel_lab_moe.py prepare`` (build box, TVM + nvcc, no GPU): compiles one
TIR-only library for CUDA sm_90 (precompiled fatbin, :mod:`dsv2_mlc.compiler.cuda`) into
``build/lab_moe/moe_lab.so`` with V2-Lite's routed-expert shapes (hidden 2048, moe_intermediate
1408, 64 experts, top-6, INT4 ``--group`` 128 or 32, fp16 activations), plus ``manifest.json``:

* ``old_*``, what prefill runs today, built as the pipeline builds it (the TE of
  :func:`dsv2_mlc.model.moe.gather_matmul_te` with dlight's default rules): ``old_gate_up``
  (gather GEMM ``[n, 6, 2816]``), ``old_silu_mul``, ``old_down`` (``[n, 6, 2048]``) and
  ``old_combine`` (``sum_j w * down`` in float32);
* ``new_*`` (:mod:`dsv2_mlc.schedules.moe_grouped_cuda`): ``new_align`` (expert-sorted padded
  rows),
  ``new_gate_up_<variant>`` (grouped GEMM + SwiGLU), ``new_down_<variant>`` and ``new_combine``,
  for the tensor-core variants of ``MMA_VARIANTS`` (``mma128``: pairs of tiles, 4 x 2 warps; ``mma``
  / ``mma_w4``: one tile, 2 / 4 warps along the columns; the model picks ``mma128`` from 256 tiles
  on and ``mma`` below; ``prepare --no-arch-specific`` builds them with ``mma.sync`` instead of
  ``wgmma``) and each SIMT tiling of ``--tilings`` (``TILINGS``; default ``t8x16``, the SIMT
  default), all with ``new_align``.

``python3 schedules/lab/kernel_lab_moe.py run --lib-dir LIBS --out DIR`` (GPU machine;
torch + ``tvm_ffi`` + TVM's runtime libraries, never imports tvm): random INT4 experts, random
top-6 routing (uniform, and a skewed one where 8 experts get most tokens) and activations for
n in (512, 4096) tokens; runs the paths (the gather path only with ``--old``: 0.2 s a call),
checks the output of each against a float32 torch reference (relative L2, max abs error) and the
bookkeeping against torch (counts, every pair's row holds its token), times every kernel and
each whole path with CUDA events (median of several loops), and prints a table with TFLOP/s
(useful FLOPs ``2 n k (H 2I + I H)``); results
go to ``DIR/moe_lab.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lab_common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAB_DIR = ROOT / "build" / "lab_moe"
LIBRARY = "moe_lab.so"
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 1408, 64, 6
TM = 64  # dsv2_mlc.schedules.moe_grouped_cuda.TM (checked in prepare, recorded in the manifest)
# tilings of the grouped GEMMs: name -> (ty, tx, vr, vc_gate_up, vc_down, tk); "t8x16" is the
# default of dsv2_mlc.schedules.moe_grouped_cuda.pick_tiles (best of the first two on the H200)
TILINGS = {
    "t8x16": (8, 16, 8, 4, 8, 32),
    "t16x16": (16, 16, 4, 4, 8, 32),
    "t8x16k16": (8, 16, 8, 4, 8, 16),
    "t8x32": (8, 32, 8, 4, 8, 32),
}
NS = (512, 4096)
DEFAULT_TILINGS = ("t8x16",)
# tensor-core variants: name -> GroupedMmaTiles (warps along the columns, pairs of tiles from
# how many tiles: 0 always, None never) of moe_mma_cuda.grouped_mma_kernel; "mma128": pairs of
# tiles, 4 x 2 warps; "mma" / "mma_w4" the one-tile blocks of 2 x 2 / 2 x 4 warps (the model
# runs the pairs from 256 tiles on and "mma" below: schedules/tiles.py)
MMA_VARIANTS = {
    "mma128": (2, 0),
    "mma": (2, None),
    "mma_w4": (4, None),
}


# -- here: builds ----------------------------------------------------------------------------------
def _kernels(group: int, tilings: tuple[str, ...] = DEFAULT_TILINGS) -> dict:
    """symbol -> PrimFunc (old ones unscheduled, for dlight; new ones scheduled)."""
    from tvm import te, tirx

    from dsv2_mlc.model.moe import gather_matmul_te
    from dsv2_mlc.passes.fuse_gate_up_silu_mul import silu_mul_te
    from dsv2_mlc.quant.modules import dequantize_expr
    from dsv2_mlc.schedules import moe_grouped_cuda as grouped
    from dsv2_mlc.schedules.moe_mma_cuda import grouped_mma_kernel
    from dsv2_mlc.schedules.tiles import GroupedMmaTiles

    assert grouped.TM == TM, (grouped.TM, TM)
    H, E, K = HIDDEN, EXPERTS, TOP_K

    def read(ws, e, o, r):
        return dequantize_expr(ws[0], ws[1], (e, o), r, group)

    n = tirx.Var("n", "int64")
    nt = tirx.Var("num_tiles", "int64")
    x = te.placeholder((n, H), "float16", name="x")
    idx = te.placeholder((n, K), "int32", name="idx")
    w = te.placeholder((n, K), "float32", name="w")
    qgu = te.placeholder((E, 2 * INTER, H // 8), "uint32", name="qgu")
    sgu = te.placeholder((E, 2 * INTER, H // group), "float16", name="sgu")
    qdn = te.placeholder((E, H, INTER // 8), "uint32", name="qdn")
    sdn = te.placeholder((E, H, INTER // group), "float16", name="sdn")
    funcs = {}
    gu = gather_matmul_te(x, idx, [qgu, sgu], 2 * INTER, "moe_gate_up_q4", read)
    funcs["old_gate_up"] = te.create_prim_func([x, idx, qgu, sgu, gu], index_dtype_override="int64")
    gu_in = te.placeholder((n, K, 2 * INTER), "float16", name="gate_up")
    funcs["old_silu_mul"] = te.create_prim_func(
        [gu_in, silu_mul_te(gu_in)], index_dtype_override="int64"
    )
    hid = te.placeholder((n, K, INTER), "float16", name="hidden")
    dn = gather_matmul_te(hid, idx, [qdn, sdn], H, "moe_down_q4", read)
    funcs["old_down"] = te.create_prim_func([hid, idx, qdn, sdn, dn], index_dtype_override="int64")
    down = te.placeholder((n, K, H), "float16", name="down")
    # as the pipeline fuses it: (cast, multiply by the routing weight) -> sum over j -> cast
    weighted = te.compute(
        (n, K, H), lambda t, i, o: down[t, i, o].astype("float32") * w[t, i], name="weighted"
    )
    j = te.reduce_axis((0, K), name="j")
    acc = te.compute((n, H), lambda t, o: te.sum(weighted[t, j, o], axis=j), name="acc")
    comb = te.compute((n, H), lambda t, o: acc[t, o].astype("float16"), name="combine")
    funcs["old_combine"] = te.create_prim_func([down, w, comb], index_dtype_override="int64")

    rows = te.placeholder((nt, TM), "int32", name="rows")
    tile_expert = te.placeholder((nt,), "int32", name="tile_expert")
    hid_rows = te.placeholder((nt, TM, INTER), "float16", name="hidden_rows")
    down_rows = te.placeholder((nt, TM, H), "float16", name="down_rows")
    inv = te.placeholder((n, K), "int32", name="inv")
    funcs["new_align"] = grouped.moe_align(E, K, TM)
    for name, tiles in MMA_VARIANTS.items():
        tiles = GroupedMmaTiles(*tiles)
        funcs[f"new_gate_up_{name}"] = grouped_mma_kernel(
            x, rows, tile_expert, [qgu, sgu], INTER, 2, True, "gate_up", tiles
        )
        funcs[f"new_down_{name}"] = grouped_mma_kernel(
            hid_rows, rows, tile_expert, [qdn, sdn], H, 1, False, "down", tiles
        )
    for name in tilings:
        ty, tx, vr, vc_gu, vc_dn, tk = TILINGS[name]
        tiles_gu = grouped.GemmTiles(ty=ty, tx=tx, vr=vr, vc=vc_gu, tk=tk)
        tiles_dn = grouped.GemmTiles(ty=ty, tx=tx, vr=vr, vc=vc_dn, tk=tk)
        funcs[f"new_gate_up_{name}"] = grouped.grouped_gemm_cuda(
            x, rows, tile_expert, [qgu, sgu], read, INTER, 2, True, "gate_up", tiles_gu, mma=False
        )
        funcs[f"new_down_{name}"] = grouped.grouped_gemm_cuda(
            hid_rows, rows, tile_expert, [qdn, sdn], read, H, 1, False, "down", tiles_dn, mma=False
        )
    funcs["new_combine"] = grouped.combine_cuda(down_rows, inv, w, "combine")
    return funcs


def prepare(args: argparse.Namespace) -> int:
    """Compile every kernel for CUDA into build/lab_moe (no GPU needed)."""
    from dsv2_mlc.compiler.cuda import make_cuda_target

    target = make_cuda_target(args.arch)
    lab_dir = Path(args.lab_dir)
    lab_dir.mkdir(parents=True, exist_ok=True)
    tilings = tuple(t for t in args.tilings.split(",") if t)
    funcs = _kernels(args.group, tilings)
    mod = lab_common.tir_module(funcs)
    start = time.time()
    mod = lab_common.apply_dlight(mod, target)  # the old kernels: the pipeline's dlight rules
    lib = lab_dir / LIBRARY
    lab_common.compile_cuda_library(mod, lib, args.arch, target, not args.no_arch_specific)
    seconds = round(time.time() - start, 1)
    size_mb = lib.stat().st_size / 1e6
    print(f"{lib}: {len(funcs)} kernels, {size_mb:.2f} MB ({seconds} s)")
    manifest = {
        **lab_common.manifest_header(args.arch),
        "shapes": {
            "hidden": HIDDEN,
            "inter": INTER,
            "experts": EXPERTS,
            "top_k": TOP_K,
            "group": args.group,
            "tm": TM,
        },  # fmt: skip
        "arch_specific": not args.no_arch_specific,
        "tilings": {t: TILINGS[t] for t in tilings},
        "variants": [*MMA_VARIANTS, *tilings],
        "library": LIBRARY,
        "symbols": sorted(funcs),
        "compile_s": seconds,
    }
    lab_common.write_manifest(lab_dir, manifest)
    return 0


# -- there: measurement ----------------------------------------------------------------------------
def _load(lib_dir: str, lab_dir: Path, symbols: list[str]) -> dict:
    import tvm_ffi

    # libtvm_runtime.so needs libtvm_ffi.so: the tvm_ffi package's, loaded global first
    lab_common.load_tvm_runtime(lib_dir, preload_ffi=True)
    module = tvm_ffi.load_module(str(lab_dir / LIBRARY))
    return {s: module[s] for s in symbols}


_ffi = lab_common.ffi_tensors


def _weights(torch, group: int, seed: int) -> dict:
    """Random INT4 experts (packed words, fp16 scales) sized for O(1) activations."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    H, E = HIDDEN, EXPERTS

    def packed(rows: int, cols: int):
        r = torch.randint(-(2**31), 2**31 - 1, (E, rows, cols // 8), generator=gen, device="cuda")
        return r.to(torch.int32).view(torch.uint32)

    def scales(rows: int, cols: int, base: float):
        u = torch.rand(E, rows, cols // group, generator=gen, device="cuda")
        return (base * (0.5 + u)).to(torch.float16)

    return {
        "qgu": packed(2 * INTER, H),
        "sgu": scales(2 * INTER, H, 0.006),
        "qdn": packed(H, INTER),
        "sdn": scales(H, INTER, 0.012),
    }


def _inputs(torch, n: int, skewed: bool, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(n, EXPERTS, generator=gen, device="cuda")
    if skewed:  # 8 hot experts
        logits[:, :8] += 3.0
    top, idx = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
    w = (top / top.sum(-1, keepdim=True)).float().contiguous()
    x = torch.randn(n, HIDDEN, generator=gen, device="cuda").to(torch.float16)
    return {"x": x, "idx": idx.to(torch.int32).contiguous(), "w": w}


def _dequantize(torch, packed, scale, e: int, group: int):
    shifts = torch.arange(0, 32, 4, device="cuda", dtype=torch.int64)
    words = packed[e].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    q = ((words[..., None] >> shifts) & 15).reshape(words.shape[0], -1).float() - 8
    return q * scale[e].float().repeat_interleave(group, dim=-1)


def _reference(torch, c: dict, wts: dict, group: int):
    """float32: out[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = idx[t, j]."""
    x, idx, w = c["x"].float(), c["idx"].long(), c["w"]
    out = torch.zeros(x.shape[0], HIDDEN, device="cuda")
    for e in range(EXPERTS):
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = x[tok] @ _dequantize(torch, wts["qgu"], wts["sgu"], e, group).T
        h = torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]
        d = h @ _dequantize(torch, wts["qdn"], wts["sdn"], e, group).T
        out.index_add_(0, tok, d * w[tok, slot][:, None])
    return out


def _old_path(torch, k: dict, c: dict, wts: dict) -> tuple[list, object]:
    """The calls of today's prefill path (functions + argument lists) and its output."""
    n = c["x"].shape[0]
    f16 = torch.float16
    gu = torch.empty(n, TOP_K, 2 * INTER, dtype=f16, device="cuda")
    hid = torch.empty(n, TOP_K, INTER, dtype=f16, device="cuda")
    down = torch.empty(n, TOP_K, HIDDEN, dtype=f16, device="cuda")
    out = torch.full((n, HIDDEN), 7.0, dtype=f16, device="cuda")
    calls = [
        ("old_gate_up", _ffi(c["x"], c["idx"], wts["qgu"], wts["sgu"], gu)),
        ("old_silu_mul", _ffi(gu, hid)),
        ("old_down", _ffi(hid, c["idx"], wts["qdn"], wts["sdn"], down)),
        ("old_combine", _ffi(down, c["w"], out)),
    ]
    return calls, out


def _new_path(torch, k: dict, c: dict, wts: dict, variant: str) -> tuple[list, object, dict]:
    n = c["x"].shape[0]
    f16, i32 = torch.float16, torch.int32
    n_tiles = (n * TOP_K + EXPERTS * (TM - 1)) // TM
    book = {
        "rows": torch.full((n_tiles, TM), -7, dtype=i32, device="cuda"),
        "tile_expert": torch.full((n_tiles,), -7, dtype=i32, device="cuda"),
        "inv": torch.full((n, TOP_K), -7, dtype=i32, device="cuda"),
        "counts": torch.full((EXPERTS,), -7, dtype=i32, device="cuda"),
    }
    # NaN-filled: the mma kernels skip the unused tiles, whose rows nothing may read
    hid = torch.full((n_tiles, TM, INTER), float("nan"), dtype=f16, device="cuda")
    down = torch.full((n_tiles, TM, HIDDEN), float("nan"), dtype=f16, device="cuda")
    out = torch.full((n, HIDDEN), 7.0, dtype=f16, device="cuda")
    b = book
    align = "new_align"
    calls = [
        (align, _ffi(c["idx"], b["rows"], b["tile_expert"], b["inv"], b["counts"])),
        (
            f"new_gate_up_{variant}",
            _ffi(c["x"], b["rows"], b["tile_expert"], wts["qgu"], wts["sgu"], hid),
        ),
        (
            f"new_down_{variant}",
            _ffi(hid, b["rows"], b["tile_expert"], wts["qdn"], wts["sdn"], down),
        ),
        ("new_combine", _ffi(down, b["inv"], c["w"], out)),
    ]
    return calls, out, book


def _check_book(torch, book: dict, c: dict) -> dict:
    """The bookkeeping against torch: counts, rows[inv] = token, tile experts, padding."""
    idx = c["idx"].long()
    n = idx.shape[0]
    counts = torch.bincount(idx.reshape(-1), minlength=EXPERTS)
    flat = book["rows"].reshape(-1).long()
    inv = book["inv"].reshape(-1).long()
    tok = torch.arange(n, device="cuda").repeat_interleave(TOP_K)
    ok_rows = bool((flat[inv] == tok).all()) and inv.unique().numel() == inv.numel()
    ok_tiles = bool((book["tile_expert"][inv // TM].long() == idx.reshape(-1)).all())
    pad = torch.ones_like(flat, dtype=torch.bool)
    pad[inv] = False
    return {
        "counts_ok": bool((book["counts"].long() == counts).all()),
        "rows_ok": ok_rows,
        "tiles_ok": ok_tiles,
        "padding_ok": bool((flat[pad] == 0).all()),
        "used_tiles": int((book["tile_expert"] >= 0).sum()),
        "tiles": int(book["tile_expert"].numel()),
    }


def _errors(torch, got, ref) -> dict:
    diff = got.float() - ref
    return {
        "rel_l2": float(diff.norm() / ref.norm().clamp_min(1e-30)),
        "max_abs": float(diff.abs().max()),
        "ref_max_abs": float(ref.abs().max()),
        "nan": bool(torch.isnan(got).any()),
    }


def _time(torch, kernels: dict, calls: list, budget_s: float) -> dict:
    """Median seconds per call of every kernel and of the whole sequence (CUDA events)."""

    def run_all(which: list) -> None:
        for name, args in which:
            kernels[name](*args)

    one = max(lab_common.wall_seconds(torch, lambda: run_all(calls)), 1e-6)
    inner, loops = lab_common.loop_counts(one, budget_s, max_inner=20, fill_s=0.05)

    def median(which: list) -> float:
        def run_loop() -> None:
            for _ in range(inner):
                run_all(which)

        return lab_common.event_median(torch, run_loop, inner, loops)

    res = {name: median([(name, args)]) for name, args in calls}
    res["total"] = median(calls)
    return res


def _flops(n: int) -> dict:
    gu, dn = 2 * n * TOP_K * HIDDEN * 2 * INTER, 2 * n * TOP_K * INTER * HIDDEN
    return {"gate_up": gu, "down": dn, "total": gu + dn}


def run(args: argparse.Namespace) -> int:
    """Check and time both paths for every case; print the table, write results JSON."""
    import torch

    lab_dir = Path(args.lab_dir)
    manifest = lab_common.read_manifest(lab_dir)
    group = int(manifest["shapes"]["group"])
    variants = manifest.get("variants", list(manifest["tilings"]))
    if args.variants:
        variants = [v for v in args.variants.split(",") if v in variants]
    ns = [int(v) for v in args.ns.split(",")]
    kernels = _load(args.lib_dir, lab_dir, manifest["symbols"])
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    print(
        f"library {LIBRARY} from {manifest['commit']} ({manifest['prepared']}), group {group}, "
        f"arch-specific features {manifest.get('arch_specific', False)}"
    )
    wts = _weights(torch, group, seed=0)
    results = []
    for i, (n, skewed) in enumerate((n, s) for n in ns for s in (False, True)):
        case = f"n={n} {'skewed' if skewed else 'uniform'}"
        c = _inputs(torch, n, skewed, seed=i + 1)
        ref = _reference(torch, c, wts, group)
        flops = _flops(n)
        row: dict = {"case": case, "n": n, "skewed": skewed, "flops": flops}
        paths = [("old", None)] if args.old else []
        paths += [("new", v) for v in variants]
        for path, tiling in paths:
            key = path if tiling is None else f"{path}_{tiling}"
            calls = None
            try:
                if path == "old":
                    calls, out = _old_path(torch, kernels, c, wts)
                    book = None
                else:
                    calls, out, book = _new_path(torch, kernels, c, wts, tiling)
                for name, a in calls:
                    kernels[name](*a)
                torch.cuda.synchronize()
                entry = _errors(torch, out, ref)
                if book is not None:
                    entry["book"] = _check_book(torch, book, c)
                entry["s"] = _time(torch, kernels, calls, args.budget_per_case_s)
                entry["tflops"] = flops["total"] / entry["s"]["total"] / 1e12
            except Exception as err:  # noqa: BLE001 (record it, measure the rest)
                entry = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
                print(f"{case} {key}: FAILED {entry['error']}", flush=True)
            row[key] = entry
            del calls
            torch.cuda.empty_cache()
        results.append(row)
        _print_row(row, paths)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"gpu": props.name, "torch": torch.__version__, "manifest": manifest}
        doc["cases"] = results
        (out / "moe_lab.json").write_text(json.dumps(doc, indent=1))
        print(f"wrote {out / 'moe_lab.json'}")
    return 0


def _print_row(row: dict, paths: list) -> None:
    print(f"-- {row['case']} ({row['flops']['total'] / 1e9:.0f} GFLOP)", flush=True)
    for path, tiling in paths:
        key = path if tiling is None else f"{path}_{tiling}"
        e = row.get(key, {})
        if "s" not in e:
            print(f"   {key:14s} {e.get('error', 'not run')}")
            continue
        parts = [
            f"{name.removeprefix('new_').removeprefix('old_')} {s * 1e3:.3f}"
            for name, s in e["s"].items()
            if name != "total"
        ]
        for name, s in e["s"].items():  # TFLOP/s of the GEMM kernels
            gemm = "gate_up" if "gate_up" in name else "down" if "_down" in name else None
            if gemm:
                parts.append(f"{gemm} {row['flops'][gemm] / s / 1e12:.0f} TF/s")
        check = ""
        if "book" in e:
            good = all(v for k, v in e["book"].items() if k.endswith("_ok"))
            check = f" book ok ({e['book']['used_tiles']}/{e['book']['tiles']} tiles)"
            check = check if good else f" book BAD {e['book']}"
        print(
            f"   {key:10s} {e['s']['total'] * 1e3:7.3f} ms {e['tflops']:6.1f} TF/s"
            f" | rel_l2 {e['rel_l2']:.1e} max {e['max_abs']:.1e}{' NaN' if e['nan'] else ''}"
            f"{check} | ms: {', '.join(parts)}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser, p, r = lab_common.lab_parser(
        __doc__,
        "compile the kernels into build/lab_moe (build box)",
        "check and time both paths (GPU machine)",
    )
    p.add_argument("--group", type=int, default=128, choices=(32, 128))
    p.add_argument("--lab-dir", default=str(LAB_DIR), help="library + manifest folder")
    p.add_argument(
        "--no-arch-specific",
        action="store_true",
        help="compile sm_90 without its sm_90a features (the mma.sync kernels instead of wgmma)",
    )
    p.add_argument(
        "--tilings", default=",".join(DEFAULT_TILINGS), help=f"SIMT tilings, of {sorted(TILINGS)}"
    )
    r.add_argument("--budget-per-case-s", type=float, default=1.0)
    r.add_argument("--old", action="store_true", help="also the gather path (slow)")
    r.add_argument("--lab-dir", default=str(LAB_DIR), help="library + manifest folder")
    r.add_argument("--variants", default="", help="subset of the manifest's variants (a,b,..)")
    r.add_argument("--ns", default=",".join(map(str, NS)), help="token counts (a,b,..)")
    args = parser.parse_args(argv)
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
