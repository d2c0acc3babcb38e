"""Kernel lab, causal ragged prefill attention (MLA ``self_attention``): TVM 0.27's kernel vs ours.

``python schedules/lab/kernel_lab_prefill_attn.py prepare`` (build box, TVM + nvcc, no GPU):
compiles TIR-only libraries for CUDA sm_90 (precompiled fatbins, :mod:`dsv2_mlc.compiler.cuda`) into
``build/lab_attn/``: ``attn_tvm.so`` (TVM's ``_attention_prefill_ragged``, what
``TIRPagedKVCache(attn_kind="mla")`` puts in the ragged-prefill slot) and one ``attn_<variant>.so``
per entry of :data:`VARIANTS` (:func:`dsv2_mlc.schedules.prefill_attention_cuda.
build_prefill_attention` with the shipped tiles of ``schedules/tiles.py`` changed by those
fields; ``ours`` = the shipped tiles, the model's kernel), all for V2-Lite's shapes (16 heads,
q/k head dim 192, v head dim 128, fp16), plus
``manifest.json``.

``python3 schedules/lab/kernel_lab_prefill_attn.py run --lib-dir LIBS --out DIR`` (GPU
machine; torch and ``tvm_ffi`` only, never imports tvm): random ragged batches (causal; a 1-token
sequence; an empty one; ``q_len < kv_len``; non-causal; n = 512, 4096; 3 sequences of mixed
lengths), every kernel of the manifest checked against a float32 torch reference (relative L2
of ``out``, max ``lse`` error, base 2) and timed with CUDA events (median of loops of
back-to-back calls); torch's SDPA as a yardstick where it applies. One compact table (case x
kernel, us, ``!`` = wrong), an error summary, ``prefill_attn_lab.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lab_common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAB_DIR = ROOT / "build" / "lab_attn"
HEADS, D_QK, D_V = 16, 192, 128
# name -> PrefillAttentionTiles fields changed from the shipped tiles ("ours": none)
VARIANTS: dict[str, dict] = {
    "ours": {},  # 64 query rows (4 warps) x 32 keys
    "bn64": dict(block_n=64),
    "bm128": dict(block_m=128),
    "bn16": dict(block_n=16),
    # the scores on wgmma, Q and K in swizzled shared tiles (schedules/lab/prefill_wgmma_cuda.py)
    "wg_bn64": dict(block_m=64, block_n=64, wgmma=True),
    "wg_bn128": dict(block_m=64, block_n=128, wgmma=True),
    # ... and P V on wgmma too (A = P from registers, V MN-major)
    "wg2_bn64": dict(block_m=64, block_n=64, wgmma=True, pv=True),
    "wg2_bn128": dict(block_m=64, block_n=128, wgmma=True, pv=True),
    # ... warp-specialized: a producer warpgroup, two stages, two consumer warpgroups
    "ws_bm128": dict(block_m=128, block_n=64, ws=True),
}
BAD_REL, BAD_LSE = 2e-3, 2e-3  # a result worse than this is flagged "!"


# -- here: builds ----------------------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> int:
    """Compile TVM's kernel and every variant for CUDA into build/lab_attn (no GPU needed)."""
    from dsv2_mlc.compiler.cuda import make_cuda_target

    target = make_cuda_target(args.arch)
    from tvm.relax.frontend.nn.llm.kv_cache import _attention_prefill_ragged

    from dsv2_mlc.schedules.prefill_attention_cuda import build_prefill_attention
    from dsv2_mlc.schedules.tiles import tuned

    lab_common.fresh_lab_dir(LAB_DIR, "attn_*.so")
    funcs = {"tvm": _attention_prefill_ragged(HEADS, HEADS, D_QK, D_V, "float16", {}, target)}
    from prefill_wgmma_cuda import build_prefill_wgmma, build_prefill_ws

    for name, kwargs in VARIANTS.items():
        kwargs = dict(kwargs)
        wgmma, pv, ws = kwargs.pop("wgmma", False), kwargs.pop("pv", False), kwargs.pop("ws", 0)
        tiles = replace(tuned("prefill_attention"), **kwargs)
        if ws:
            funcs[name] = build_prefill_ws(HEADS, HEADS, D_QK, D_V, "float16", tiles)
        elif wgmma:
            funcs[name] = build_prefill_wgmma(HEADS, HEADS, D_QK, D_V, "float16", tiles, pv=pv)
        else:
            funcs[name] = build_prefill_attention(HEADS, HEADS, D_QK, D_V, "float16", tiles)
    built = lab_common.build_libraries(
        funcs, LAB_DIR, "attn", args.arch, target, VARIANTS, "TVM _attention_prefill_ragged"
    )
    manifest = {
        **lab_common.manifest_header(args.arch),
        "shapes": {"heads": HEADS, "d_qk": D_QK, "d_v": D_V},
        "kernels": built,
    }
    lab_common.write_manifest(LAB_DIR, manifest)
    return 0


# -- there: measurement ----------------------------------------------------------------------------
# (name, q_lens, kv_lens, causal, timed)
CASES: list[tuple[str, list[int], list[int], int, bool]] = [
    ("1 token", [1], [1], 1, False),
    ("b3 [1,77,300]", [1, 77, 300], [1, 77, 300], 1, False),
    ("b3 [50,0,33]", [50, 0, 33], [50, 0, 33], 1, False),
    ("q<kv [100,5]/[300,21]", [100, 5], [300, 21], 1, False),
    ("nc [200,64]", [200, 64], [200, 64], 0, False),
    ("q>kv [40]/[20]", [40], [20], 1, False),  # rows that see no key: 0 / -inf (TVM differs)
    ("n512", [512], [512], 1, True),
    ("n4096", [4096], [4096], 1, True),
    ("b3 [1000,2500,596]", [1000, 2500, 596], [1000, 2500, 596], 1, True),
    ("b4 x1024", [1024] * 4, [1024] * 4, 1, True),
    ("n8192", [8192], [8192], 1, True),
]


def _case(torch, q_lens: list[int], kv_lens: list[int], causal: int, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    n, m = sum(q_lens), sum(kv_lens)

    def indptr(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(torch.float16)

    return {
        "q": rnd(n, HEADS, D_QK),
        "q_indptr": indptr(q_lens).to(dev),
        "k": rnd(m, HEADS, D_QK),
        "v": rnd(m, HEADS, D_V),
        "kv_indptr": indptr(kv_lens).to(dev),
        "q_rope_position": torch.zeros(max(n, 1), dtype=torch.int32, device=dev)[:n],
        "k_rope_pos_offset": torch.zeros(len(q_lens), dtype=torch.int32, device=dev),
        "causal": causal,
        "sm_scale": 1.0 / math.sqrt(D_QK),
        "q_lens": q_lens,
        "kv_lens": kv_lens,
    }


def _flops(q_lens, kv_lens, causal) -> float:
    pairs = 0
    for ql, kl in zip(q_lens, kv_lens, strict=True):
        if causal:
            pairs += sum(max(0, min(kl, kl - ql + r + 1)) for r in range(ql))
        else:
            pairs += ql * kl
    return 2.0 * pairs * HEADS * (D_QK + D_V)


def _reference(torch, c: dict):
    """float32 attention per sequence: (out[n, H, Dv], lse[n, H] base 2); no key: 0, -inf."""
    q, k, v = c["q"].float(), c["k"].float(), c["v"].float()
    out = torch.zeros(q.shape[0], HEADS, D_V, device="cuda")
    lse = torch.full((q.shape[0], HEADS), -math.inf, device="cuda")
    qi, ki = c["q_indptr"].tolist(), c["kv_indptr"].tolist()
    for i in range(len(c["q_lens"])):
        ql, kl = qi[i + 1] - qi[i], ki[i + 1] - ki[i]
        if ql == 0 or kl == 0:
            continue
        rows, cols = slice(qi[i], qi[i + 1]), slice(ki[i], ki[i + 1])
        s = torch.einsum("rhd,khd->hrk", q[rows], k[cols]) * c["sm_scale"]
        if c["causal"]:
            r = torch.arange(ql, device="cuda")[:, None]
            col = torch.arange(kl, device="cuda")[None, :]
            s = s.masked_fill(col >= kl - ql + r + 1, -math.inf)
        ln = torch.logsumexp(s, dim=-1)  # [h, r]
        p = torch.exp(s - ln[..., None]).nan_to_num(0.0)
        out[rows] = torch.einsum("hrk,khd->rhd", p, v[cols])
        lse[rows] = (ln / math.log(2)).T
        del s, p
    return out, lse


def _args(c: dict, out, lse, rotary_mode: int = 0) -> list:
    names = ("q", "q_indptr", "k", "v", "kv_indptr", "q_rope_position", "k_rope_pos_offset")
    tensors = [c[k] for k in names] + [out, lse]
    return lab_common.ffi_tensors(*tensors) + [
        c["causal"], rotary_mode, 1.0, 10000.0, c["sm_scale"]
    ]  # fmt: skip


def _call(torch, func, c: dict):
    n = c["q"].shape[0]
    out = torch.full((n, HEADS, D_V), 7.0, dtype=torch.float16, device="cuda")
    lse = torch.full((n, HEADS), 7.0, dtype=torch.float32, device="cuda")
    func(*_args(c, out, lse))
    return out, lse


def _errors(torch, got, ref) -> dict:
    out, lse = got
    r_out, r_lse = ref
    diff = out.float() - r_out
    rel = float(diff.norm() / r_out.norm().clamp_min(1e-30))
    fin = torch.isfinite(r_lse)
    lse_err = float((lse[fin] - r_lse[fin]).abs().max()) if bool(fin.any()) else 0.0
    empty_ok = bool((lse[~fin] == -math.inf).all()) and bool((out[~fin] == 0).all())
    nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
    res = {"rel_l2": rel, "max_abs": float(diff.abs().max()), "lse_max_err": lse_err,
           "empty_rows_ok": empty_ok, "nan": nan}  # fmt: skip
    # where it goes wrong: rows whose output or lse is off (diagnosis from one device run)
    row_err = diff.abs().amax(dim=2) / r_out.abs().amax().clamp_min(1e-30)
    lse_row = torch.where(fin, (lse - r_lse).abs(), torch.zeros_like(lse))
    bad = (row_err > 2e-2) | (lse_row > 1e-2) | torch.isnan(row_err)
    if bool(bad.any()):
        idx = bad.nonzero()
        res["bad_rows"] = int(bad.any(dim=1).sum())
        res["bad_heads"] = sorted(set(idx[:, 1].tolist()))[:8]
        res["first_bad"] = idx[:6].tolist()
    return res


def _bad(e: dict) -> bool:
    return (
        not e["rel_l2"] <= BAD_REL
        or not e["lse_max_err"] <= BAD_LSE
        or not e["empty_rows_ok"]
        or e["nan"]
    )


def _sdpa(torch, c: dict):
    """torch SDPA (causal, one sequence, q_len == kv_len) as a callable, or None."""
    if len(c["q_lens"]) != 1 or c["q_lens"] != c["kv_lens"] or not c["causal"]:
        return None
    import torch.nn.functional as F

    q, k, v = (c[x].transpose(0, 1).unsqueeze(0) for x in ("q", "k", "v"))

    def run():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c["sm_scale"])

    return run


def run(args: argparse.Namespace) -> int:
    """Check and time every kernel on every case; print the table, write results JSON."""
    import torch

    kernels = lab_common.load_kernels(args.lib_dir, LAB_DIR, args.only)
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    keys = list(kernels)
    width = max(9, *(len(k) + 2 for k in keys))
    print("us per call ('!' = wrong result, '-' = not timed); TFLOP/s of the best in brackets")
    print(f"{'case':24s}" + "".join(f"{k:>{width}s}" for k in keys) + f"{'sdpa':>9s}", flush=True)
    results = []
    for i, (name, q_lens, kv_lens, causal, timed) in enumerate(CASES):
        if args.cases and args.cases not in name:
            continue
        c = _case(torch, q_lens, kv_lens, causal, seed=i)
        ref = _reference(torch, c)
        flops = _flops(q_lens, kv_lens, causal)
        row: dict = {"case": name, "q_lens": q_lens, "kv_lens": kv_lens, "causal": causal,
                     "flops": flops}  # fmt: skip
        cells = []
        for key, func in kernels.items():
            try:
                got = _call(torch, func, c)
                torch.cuda.synchronize()
                row[key] = _errors(torch, got, ref)
                mark = "!" if _bad(row[key]) else " "
                if timed:
                    budget = args.budget_per_case_s / (4 if key == "tvm" else 1)
                    row[key]["s"] = lab_common.time_call(torch, func, _args(c, *got), budget)
                    cells.append(f"{row[key]['s'] * 1e6:{width - 1}.1f}{mark}")
                else:
                    cells.append(f"{'-':>{width - 1}s}{mark}")
                del got
            except Exception as err:  # noqa: BLE001 - report and go on with the next kernel
                row[key] = {"error": str(err)[:300]}
                cells.append(f"{'ERR':>{width}s}")
        sd = _sdpa(torch, c) if timed else None
        if sd is not None:
            try:
                row["sdpa_s"] = lab_common.time_call(
                    torch, lambda sd=sd: sd(), [], args.budget_per_case_s
                )
                cells.append(f"{row['sdpa_s'] * 1e6:9.1f}")
            except Exception as err:  # noqa: BLE001
                row["sdpa_error"] = str(err)[:200]
                cells.append(f"{'ERR':>9s}")
        timed_ok = [row[k]["s"] for k in keys if "s" in row.get(k, {}) and not _bad(row[k])]
        best = f" [{flops / min(timed_ok) / 1e12:.0f}]" if timed_ok else ""
        del c, ref
        torch.cuda.empty_cache()
        results.append(row)
        print(f"{name:24s}" + "".join(cells) + best, flush=True)

    # rotary_mode 1 (inline RoPE) must be refused by our kernels, not silently ignored
    c = _case(torch, [8], [8], 1, seed=99)
    refused = {}
    for key, func in kernels.items():
        if key == "tvm":
            continue
        out = torch.zeros(8, HEADS, D_V, dtype=torch.float16, device="cuda")
        lse = torch.zeros(8, HEADS, dtype=torch.float32, device="cuda")
        try:
            func(*_args(c, out, lse, rotary_mode=1))
            torch.cuda.synchronize()
            refused[key] = False
        except Exception:  # noqa: BLE001
            refused[key] = True
    print("rotary_mode=1 refused:", refused)
    print("errors: max rel L2 / max abs / max lse err / empty rows ok / nan (! = some case bad)")
    for key in keys:
        errs = [r[key] for r in results if key in r and "rel_l2" in r[key]]
        failed = [r["case"] for r in results if key in r and "error" in r[key]]
        bad = [r["case"] for r in results if key in r and "rel_l2" in r[key] and _bad(r[key])]
        if errs:
            print(
                f"  {key:11s} {max(e['rel_l2'] for e in errs):.1e} "
                f"{max(e['max_abs'] for e in errs):.1e} "
                f"{max(e['lse_max_err'] for e in errs):.1e} "
                f"{all(e['empty_rows_ok'] for e in errs)} {any(e['nan'] for e in errs)}"
                + (f"  bad: {bad}" if bad else "")
                + (f"  raised: {failed}" if failed else "")
            )
            for r in results:
                e = r.get(key, {})
                if "bad_rows" in e and key != "tvm":
                    print(f"    {r['case']}: {e['bad_rows']} bad rows, heads {e['bad_heads']}, "
                          f"first {e['first_bad']}")  # fmt: skip
        else:
            print(f"  {key:11s} all cases raised: {failed}")
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "prefill_attn_lab.json").write_text(
            json.dumps(
                {
                    "gpu": props.name,
                    "torch": torch.__version__,
                    "cases": results,
                    "rotary_mode_1_refused": refused,
                },
                indent=1,
            )  # fmt: skip
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser, p, r = lab_common.lab_parser(
        __doc__,
        "compile the kernels into build/lab_attn (build box)",
        "check and time the kernels (GPU machine)",
    )
    lab_common.add_case_options(r, budget_per_case_s=0.25)
    args = parser.parse_args(argv)
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
