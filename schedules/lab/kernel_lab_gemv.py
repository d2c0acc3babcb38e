"""Kernel lab, batch-1 INT4 decode GEMVs: schedule variants of :mod:`decode_gemv_cuda` vs dlight.

``python schedules/lab/kernel_lab_gemv.py prepare`` (build box, TVM + nvcc, no GPU): builds the
decode
GEMV kernels at V2-Lite shapes from the model's own TE builders (``dequantize_matmul_te`` with the
epilogues FuseOps gives them, ``gather_matmul_te`` with the INT4 reader of ``GroupQuantExperts``,
``gate_logits_te``), batch symbolic as in the model, schedules each with every configuration
of ``_variants()`` (``schedule_decode_gemv(func, config)``) and with dlight's default rules
(baseline ``dlight``), and exports one TIR-only sm_90 library per (kernel, variant) into
``build/lab_gemv/`` plus ``manifest.json``.


``python3 schedules/lab/kernel_lab_gemv.py run --lib-dir LIBS --out $OUT`` (GPU box:
torch
+ tvm_ffi + the TVM runtime libraries; never imports tvm): random inputs at batch 1, each kernel
checked against a float32 torch reference (relative L2), timed with CUDA events as the median of
loops of back-to-back calls: ``cold`` rotates over enough copies of the weights (or, for the
routed experts, expert-id sets) that they are not L2-resident (as in a decode step), ``hot``
repeats one call (L2-resident weights), ``graph`` replays the cold sequence from a CUDA graph
(launch overhead removed). Prints compact kernel x variant tables; full results in JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lab_common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAB_DIR = ROOT / "build" / "lab_gemv"
GROUP = 128
H, EXPERTS, TOPK = 2048, 64, 6


def _variants() -> tuple:
    """The decode GEMV configurations the lab builds and times (the first is the schedule of the
    ``ANY`` entry of ``schedules/tiles.py``)."""
    from dsv2_mlc.schedules.tiles import GemvConfig as C

    return (
        C(),
        C(fast_dequant=True),
        C(rows=1, groups=4, lanes=32, unroll_k=True, fast_dequant=True),
        C(rows=2, groups=4, lanes=32, unroll_k=True, fast_dequant=True),
        C(rows=4, groups=4, lanes=32, unroll_k=True, fast_dequant=True),
        C(rows=4, groups=4, lanes=32, fast_dequant=True),
        C(rows=4, groups=4, lanes=32, unroll_k=True),
        C(rows=4, groups=2, lanes=32, unroll_k=True, fast_dequant=True),
        # (rows=8 does not build: TVM's CUDA codegen fails on a vector store, PrintVecElemStore)
        C(rows=2, groups=4, lanes=16, unroll_k=True, fast_dequant=True),
        C(rows=4, groups=8, lanes=8, unroll_k=True, fast_dequant=True),
        C(rows=1, groups=2, lanes=64, unroll_k=True, fast_dequant=True),
        C(rows=2, groups=1, lanes=128, unroll_k=True, fast_dequant=True),
        # the hand half2 dot product (``hfma2``) on the shapes of the per-class winners
        C(rows=2, groups=4, lanes=16, unroll_k=True, fast_dequant=True, hfma2=16),
        C(rows=2, groups=4, lanes=16, unroll_k=True, fast_dequant=True, hfma2=4),
        C(rows=4, groups=4, lanes=16, unroll_k=True, fast_dequant=True, hfma2=16),
        C(rows=1, groups=2, lanes=64, unroll_k=True, fast_dequant=True, hfma2=16),
        C(rows=1, groups=4, lanes=32, unroll_k=True, fast_dequant=True, hfma2=16),
        C(rows=2, groups=4, lanes=32, unroll_k=True, fast_dequant=True, hfma2=16),
        C(rows=2, groups=4, lanes=32, unroll_k=True, fast_dequant=True, hfma2=8),
        C(rows=4, groups=4, lanes=32, unroll_k=True, fast_dequant=True, hfma2=16),
    )


# name -> (kind, N outputs, K, extra); kinds: dense (epilogue), gather (x shared / per slot), gate.
KERNELS: dict[str, tuple[str, int, int]] = {
    "q_proj": ("dense", 3072, H),
    "kv_a": ("dense", 576, H),
    "qkv_a": ("dense", 3648, H),  # q_proj + kv_a fused (self_attn.qkv_a_proj), what the model runs
    "o_proj": ("dense", 2048, H),
    "sh_gate_up": ("dense", 5632, H),
    "sh_down_add": ("dense_add", 2048, 2816),
    "lm_head": ("dense_f32", 102400, H),
    "moe_gate_up": ("gather", 2816, H),
    "moe_down": ("gather_w", 2048, 1408),
    "router": ("gate", EXPERTS, H),
}


def weight_bytes(kind: str, n: int, k: int) -> int:
    """Bytes of weights (+ scales) one batch-1 call must read."""
    if kind == "gate":
        return n * k * 4
    per = n * k // 2 + n * (k // GROUP) * 2
    return per * TOPK if kind.startswith("gather") else per


# -- here: builds ----------------------------------------------------------------------------------
def build_kernel(name: str):  # -> tvm.tirx.PrimFunc
    """The unscheduled PrimFunc of kernel ``name`` (batch symbolic), from the model's builders."""
    from tvm import te, tirx

    from dsv2_mlc.model.moe import gate_logits_te, gather_matmul_te
    from dsv2_mlc.passes.fuse_dequantize_matmul import dequantize_matmul_te
    from dsv2_mlc.quant.modules import dequantize_expr

    kind, n_out, k = KERNELS[name]
    b = tirx.Var("n", "int64")

    def i64(*dims: int) -> tuple:
        return tuple(tirx.IntImm("int64", d) for d in dims)

    if kind == "gate":
        x = te.placeholder((b, *i64(k)), "float16", name="x")
        w = te.placeholder(i64(n_out, k), "float32", name="w")
        return te.create_prim_func([x, w, gate_logits_te(x, w)])
    if kind.startswith("gather"):
        per_slot = kind == "gather_w"
        x_shape = (b, *i64(TOPK, k)) if per_slot else (b, *i64(k))
        x = te.placeholder(x_shape, "float16", name="x")
        idx = te.placeholder((b, *i64(TOPK)), "int32", name="idx")
        qw = te.placeholder(i64(EXPERTS, n_out, k // 8), "uint32", name="qw")
        sc = te.placeholder(i64(EXPERTS, n_out, k // GROUP), "float16", name="scale")

        def read(ws, e, o, r):
            return dequantize_expr(ws[0], ws[1], (e, o), r, GROUP)

        # out_dim as int64, as the relax frontend passes the model's shapes
        y = gather_matmul_te(x, idx, [qw, sc], tirx.IntImm("int64", n_out), name, read)
        if not per_slot:
            return te.create_prim_func([x, idx, qw, sc, y])
        # FuseOps' epilogue of moe_down: float32(y) * routing weight (expand_dims + multiply).
        wt = te.placeholder((b, *i64(TOPK)), "float32", name="weights")
        out = te.compute(
            y.shape, lambda t, j, o: y[t, j, o].astype("float32") * wt[t, j], name="T_multiply"
        )
        return te.create_prim_func([x, idx, qw, sc, wt, out])
    x = te.placeholder((b, *i64(k)), "float16", name="x")
    qw = te.placeholder(i64(n_out, k // 8), "uint32", name="qw")
    sc = te.placeholder(i64(n_out, k // GROUP), "float16", name="scale")
    y = dequantize_matmul_te(x, qw, sc, k, GROUP)
    if kind == "dense":
        return te.create_prim_func([x, qw, sc, y])
    if kind == "dense_f32":  # lm_head: the logits cast to float32 (``..._cast2``)
        out = te.compute(y.shape, lambda t, o: y[t, o].astype("float32"), name="compute")
        return te.create_prim_func([x, qw, sc, out])
    # shared down + residual: float16(sum of routed experts, fp32) + y  (``fused_cast1_..._add``)
    res = te.placeholder((b, *i64(n_out)), "float32", name="res")
    res16 = te.compute(res.shape, lambda t, o: res[t, o].astype("float16"), name="res_cast")
    out = te.compute(y.shape, lambda t, o: res16[t, o] + y[t, o], name="T_add")
    return te.create_prim_func([res, x, qw, sc, out])


def _dlight(func, target):
    import tvm

    return lab_common.apply_dlight(tvm.IRModule({"main": func}), target)["main"]


def prepare(args: argparse.Namespace) -> int:
    """Build every (kernel, variant) library into build/lab_gemv (no GPU needed)."""
    from dsv2_mlc.compiler.cuda import make_cuda_target

    target = make_cuda_target(args.arch)
    from dsv2_mlc.schedules.decode_gemv_cuda import schedule_decode_gemv

    lab_common.fresh_lab_dir(LAB_DIR, "*.so")
    variants = {"dlight": None} | {v.name: v for v in _variants()}
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only.split(",")}
    built: dict[str, dict[str, str]] = {}
    failed: dict[str, dict[str, str]] = {}
    start = time.time()
    for kname in KERNELS:
        func = build_kernel(kname)
        for vname, config in variants.items():
            lib = f"{kname}__{vname}.so"
            try:
                if config is None:
                    done = _dlight(func, target)
                else:
                    done = schedule_decode_gemv(func, config)
                    if done is None:
                        raise ValueError("schedule_decode_gemv left it to dlight")
                mod = lab_common.tir_module({"main": done})
                lab_common.compile_cuda_library(mod, LAB_DIR / lib, args.arch, target)
                built.setdefault(kname, {})[vname] = lib
            except Exception as err:  # noqa: BLE001 (recorded; the variant is skipped there)
                failed.setdefault(kname, {})[vname] = str(err).strip().splitlines()[-1][:200]
                print(f"  {kname} / {vname}: FAILED {failed[kname][vname][:120]}", flush=True)
        print(f"{kname}: {len(built.get(kname, {}))} libraries ({time.time() - start:.0f} s)")
    manifest = {
        **lab_common.manifest_header(args.arch),
        "kernels": {k: list(v) for k, v in KERNELS.items()},
        "variants": {k: (None if v is None else vars(v)) for k, v in variants.items()},
        "built": built,
        "failed": failed,
    }
    lab_common.write_manifest(LAB_DIR, manifest)
    size = sum(p.stat().st_size for p in LAB_DIR.iterdir())
    print(f"build/lab_gemv: {size / 1e6:.1f} MB, {sum(map(len, built.values()))} libraries")
    return 0


# -- there: measurement ----------------------------------------------------------------------------
def _inputs(torch, name: str, copies: int, gen) -> dict:
    """Random inputs: ``args(c)``, the kernel's tensors for copy ``c`` (output last); ``ref()``."""
    kind, n, k = KERNELS[name]
    dev = "cuda"

    def randn(*shape, scale=1.0, dtype=torch.float16):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    def packed(*shape):  # uint32 words; int32 view for the reference
        w = torch.randint(-(2**31), 2**31, shape, generator=gen, device=dev, dtype=torch.int64)
        return w.to(torch.int32)

    def scales(*shape):
        return (torch.rand(*shape, generator=gen, device=dev) * 0.02 + 0.005).to(torch.float16)

    def dequant(qw32, sc):  # [..., N, K/8] int32, [..., N, K/g] -> float32 [..., N, K]
        shifts = torch.arange(8, device=dev, dtype=torch.int32) * 4
        q = ((qw32.unsqueeze(-1) >> shifts) & 15).flatten(-2).float() - 8
        return q * sc.float().repeat_interleave(GROUP, -1)

    if kind == "gate":
        x = randn(1, k)
        ws = [randn(n, k, dtype=torch.float32) for _ in range(copies)]
        out = torch.empty(1, n, device=dev, dtype=torch.float32)
        return {
            "args": lambda c: [x, ws[c], out],
            "ref": lambda: x.float() @ ws[0].T,
        }
    if kind.startswith("gather"):
        per_slot = kind == "gather_w"
        x = randn(1, TOPK, k) if per_slot else randn(1, k)
        qw = packed(EXPERTS, n, k // 8)
        qw_u = qw.view(torch.uint32)
        sc = scales(EXPERTS, n, k // GROUP)
        ids = [
            torch.randperm(EXPERTS, generator=gen, device=dev)[:TOPK].to(torch.int32)[None]
            for _ in range(copies)
        ]
        wt = torch.rand(1, TOPK, generator=gen, device=dev)
        out = torch.empty(
            1, TOPK, n, device=dev, dtype=torch.float32 if per_slot else torch.float16
        )

        def ref():
            e = ids[0][0].long()
            w = dequant(qw[e], sc[e])  # [6, n, k]
            xs = x.float()[0] if per_slot else x.float().expand(TOPK, k)
            y = torch.einsum("jk,jnk->jn", xs, w)
            if per_slot:
                return (y.half().float() * wt[0, :, None])[None]
            return y[None]

        extra = [wt] if per_slot else []
        return {"args": lambda c: [x, ids[c], qw_u, sc, *extra, out], "ref": ref}
    x = randn(1, k)
    qws = [packed(n, k // 8) for _ in range(copies)]
    scs = [scales(n, k // GROUP) for _ in range(copies)]
    out = torch.empty(1, n, device=dev, dtype=torch.float32 if kind == "dense_f32" else torch.half)
    res = randn(1, n, dtype=torch.float32)

    def ref():
        y = x.float() @ dequant(qws[0], scs[0]).T
        return res.half().float() + y.half().float() if kind == "dense_add" else y

    lead = [res] if kind == "dense_add" else []
    return {
        "args": lambda c: [*lead, x, qws[c].view(torch.uint32), scs[c], out],
        "ref": ref,
    }


def _time(torch, calls: list, budget_s: float) -> float:
    """Median seconds per call over loops that run ``calls`` (closures) back to back."""
    for f in calls[:3]:
        f()

    def run_all() -> None:
        for f in calls:
            f()

    one = max(lab_common.wall_seconds(torch, run_all) / len(calls), 1e-6)
    reps = int(min(2000, max(len(calls), 0.01 / one)))
    loops = int(min(15, max(5, budget_s / (one * reps))))

    def run_loop() -> None:
        for i in range(reps):
            calls[i % len(calls)]()

    return lab_common.event_median(torch, run_loop, reps, loops)


def run(args: argparse.Namespace) -> int:
    """Check and time every (kernel, variant); print tables; write JSON to --out."""
    import torch
    import tvm_ffi

    lab_common.load_tvm_runtime(args.lib_dir)
    manifest = lab_common.read_manifest(LAB_DIR)
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    variants = list(manifest["variants"])
    kernels = [k for k in KERNELS if not args.kernels or k in args.kernels.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: dict = {"gpu": props.name, "manifest": manifest, "kernels": {}}
    for kname in kernels:
        kind, n, k = KERNELS[kname]
        nbytes = weight_bytes(kind, n, k)
        per_copy = nbytes if not kind.startswith("gather") else 0
        want = -(-args.rotate_mb * 1e6 // max(per_copy, 1))
        copies = 32 if per_copy == 0 else int(min(512, max(2, want)))
        data = _inputs(torch, kname, copies, gen)
        ref = data["ref"]()
        row: dict = {"bytes": nbytes, "copies": copies, "variants": {}}
        for vname in variants:
            lib = manifest["built"].get(kname, {}).get(vname)
            if lib is None:
                row["variants"][vname] = {"error": manifest["failed"].get(kname, {}).get(vname)}
                continue
            func = tvm_ffi.load_module(str(LAB_DIR / lib))["main"]
            argsets = [lab_common.ffi_tensors(*data["args"](c)) for c in range(copies)]
            calls = [lambda a=a, f=func: f(*a) for a in argsets]
            out = data["args"](0)[-1]
            out.fill_(float("nan"))
            calls[0]()
            torch.cuda.synchronize()
            got = out.float()
            rel = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
            cell = {"rel_l2": rel, "nan": bool(torch.isnan(got).any())}
            with tvm_ffi.use_torch_stream():
                cell["cold_s"] = _time(torch, calls, args.budget_s)
                cell["hot_s"] = _time(torch, calls[:1], args.budget_s / 2)
            graph_s = None if args.no_graph else lab_common.graph_seconds(torch, tvm_ffi, calls)
            cell["graph_s"] = graph_s
            with tvm_ffi.use_torch_stream():
                kernel_s = None if args.no_profile else lab_common.cupti_seconds(torch, calls)
                cell["kernel_s"] = kernel_s
            row["variants"][vname] = cell
        results["kernels"][kname] = row
        del data, ref
        torch.cuda.empty_cache()
        best = min(
            (v for v in row["variants"].items() if "cold_s" in v[1] and v[1]["rel_l2"] < 2e-2),
            key=lambda v: v[1].get("kernel_s") or v[1]["cold_s"],
            default=None,
        )
        if best:
            b = best[1]
            t = b.get("kernel_s") or b["cold_s"]
            us, tbs = t * 1e6, nbytes / t / 1e12
            mb = nbytes / 1e6
            print(f"{kname:12s} {mb:7.2f} MB  best {best[0]:26s} {us:6.2f} us {tbs:4.2f} TB/s")
        for vname, c in row["variants"].items():  # (as it goes: a timeout keeps these)
            if "cold_s" in c:
                t = c.get("kernel_s") or c["cold_s"]
                print(f"   {vname:30s} {t * 1e6:7.2f} us  rel {c['rel_l2']:.1e}", flush=True)
        if args.out:  # partial results after every kernel
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "gemv_lab.json").write_text(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gemv_lab.json").write_text(json.dumps(results, indent=1))
    _tables(results, variants, kernels)
    return 0


def _tables(results: dict, variants: list[str], kernels: list[str]) -> None:
    """Compact variant x kernel tables (us) per timing mode, and TB/s of the kernel times."""
    head = f"{'variant':23s}" + "".join(f"{k[:8]:>9s}" for k in kernels)
    modes = (("kernel_s", "us"), ("graph_s", "us"), ("cold_s", "us"))  # hot: in the JSON
    for mode, unit in (*modes, ("tbs", "TB/s")):
        what = "kernel (else cold) time" if mode == "tbs" else mode.replace("_s", "")
        print(f"\n== {what} ({unit}; x = error > 2e-2 or NaN, - = not built/measured)")
        print(head)
        for v in variants:
            cells = []
            for k in kernels:
                row = results["kernels"][k]
                c = row["variants"].get(v, {})
                t = c.get(mode) if mode != "tbs" else (c.get("kernel_s") or c.get("cold_s"))
                if t is None:
                    cells.append("-")
                elif c["rel_l2"] > 2e-2 or c["nan"]:
                    cells.append("x")
                elif mode == "tbs":
                    cells.append(f"{row['bytes'] / t / 1e12:.2f}")
                else:
                    cells.append(f"{t * 1e6:.2f}")
            print(f"{v[:23]:23s}" + "".join(f"{c:>9s}" for c in cells))
    errs = {
        v: max(
            (results["kernels"][k]["variants"].get(v, {}).get("rel_l2", 0.0) for k in kernels),
            default=0.0,
        )
        for v in variants
    }
    print("\nmax rel L2 per variant: " + ", ".join(f"{v}={e:.1e}" for v, e in errs.items()))


def main(argv: list[str] | None = None) -> int:
    parser, p, r = lab_common.lab_parser(
        __doc__,
        "build every (kernel, variant) into build/lab_gemv",
        "check and time every (kernel, variant) (GPU machine)",
    )
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    r.add_argument("--kernels", default="", help="comma-separated kernel names (default: all)")
    r.add_argument("--budget-s", type=float, default=0.3, help="timing budget per measurement")
    r.add_argument("--rotate-mb", type=float, default=256.0, help="weight copies to rotate over")
    r.add_argument("--no-graph", action="store_true")
    r.add_argument("--no-profile", action="store_true", help="skip the CUPTI kernel times")
    args = parser.parse_args(argv)
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
