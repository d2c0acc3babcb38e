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
LAB_DIR = ROOT / "build" / "lab"
HEADS, LATENT, ROPE, PAGE = 16, 512, 64, 16
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


# -- here: builds ----------------------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> int:
    """Compile TVM's kernel and every variant for CUDA into build/lab (no GPU needed)."""
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
def _case(torch, kv_lens: list[int], q_lens: list[int], causal: int, seed: int) -> dict:
    """Random inputs of one case: sequence i has kv_lens[i] cached tokens and q_lens[i] rows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
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
    """float32 attention per sequence: (out[total, H, L], lse[total, H] base 2)."""
    q, pages = c["q"].float(), c["pages"]
    out = torch.zeros(q.shape[0], HEADS, LATENT, device="cuda")
    lse = torch.full((q.shape[0], HEADS), -math.inf, device="cuda")
    pin, qin = c["page_indptr"].tolist(), c["qo_indptr"].tolist()
    idx = c["page_indices"].long()
    for i, kv_len in enumerate(c["kv_lens"]):
        rows = slice(qin[i], qin[i + 1])
        if kv_len == 0 or qin[i + 1] == qin[i]:
            continue
        kv = pages[idx[pin[i] : pin[i + 1]]].reshape(-1, LATENT + ROPE)[:kv_len].float()
        s = torch.einsum("rhd,kd->rhk", q[rows], kv) * c["sm_scale"]
        if c["causal"]:
            n = qin[i + 1] - qin[i]
            r = torch.arange(n, device="cuda")[:, None, None]
            k = torch.arange(kv_len, device="cuda")[None, None, :]
            s = s.masked_fill(k >= kv_len - n + r + 1, -math.inf)
        ln = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - ln[..., None]).nan_to_num(0.0)
        out[rows] = torch.einsum("rhk,kd->rhd", p, kv[:, :LATENT])
        lse[rows] = ln / math.log(2)
    return out, lse


def _args(c: dict, out, lse) -> list:
    """The ABI's arguments, tensors as tvm_ffi tensors (DLPack, no copy)."""
    names = ("q", "qo_indptr", "pages", "page_indptr", "page_indices", "length_info")
    tensors = [c[k] for k in names] + [out, lse]
    return lab_common.ffi_tensors(*tensors) + [c["causal"], c["sm_scale"]]


def _call(torch, func, c: dict):
    out = torch.full((c["q"].shape[0], HEADS, LATENT), 7.0, dtype=torch.float16, device="cuda")
    lse = torch.full((c["q"].shape[0], HEADS), 7.0, dtype=torch.float32, device="cuda")
    func(*_args(c, out, lse))
    return out, lse


def _errors(torch, got, ref) -> dict:
    out, lse = got
    r_out, r_lse = ref
    rel = float((out.float() - r_out).norm() / r_out.norm().clamp_min(1e-30))
    fin = torch.isfinite(r_lse)
    lse_err = float((lse[fin] - r_lse[fin]).abs().max()) if bool(fin.any()) else 0.0
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
    import re

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    argsets = {k: _args(c, *_call(torch, f, c)) for k, f in kernels.items()}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for key, f in kernels.items():
            for _ in range(reps):
                f(*argsets[key])
        torch.cuda.synchronize()
    # The library of kernel `key` exports `mla_<key>`; its kernels are `mla_<key>_kernel[_<i>]`.
    pattern = re.compile(r"mla_(.+)_kernel(_\d+)?$")
    sums = dict.fromkeys(kernels, 0.0)
    for e in prof.events():
        m = pattern.match(e.name) if e.device_type == DeviceType.CUDA else None
        if m and m.group(1) in sums:
            sums[m.group(1)] += e.time_range.elapsed_us()
    return {k: v / reps / 1e6 for k, v in sums.items()}


def _bad(e: dict) -> bool:
    return (
        not e["rel_l2"] <= BAD_REL
        or not e["lse_max_err"] <= BAD_LSE
        or not e["empty_rows_ok"]
        or e["nan"]
    )


def run(args: argparse.Namespace) -> int:
    """Check and time every kernel on every case; print the table, write results JSON."""
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


def main(argv: list[str] | None = None) -> int:
    parser, p, r = lab_common.lab_parser(
        __doc__,
        "compile the kernels into build/lab (build box)",
        "check and time the kernels (GPU machine)",
    )
    lab_common.add_case_options(r, budget_per_case_s=0.3)
    r.add_argument("--cupti", action="store_true", help="also GPU kernel times (torch.profiler)")
    args = parser.parse_args(argv)
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
