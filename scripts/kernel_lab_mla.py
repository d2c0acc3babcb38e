"""Kernel lab, MLA attention over the paged latent cache: TVM 0.27's kernel vs ours, on one GPU.

``python scripts/kernel_lab_mla.py prepare`` (build box, TVM + nvcc, no GPU): compiles two
TIR-only libraries for CUDA sm_90 (precompiled fatbins, :mod:`dsv2_mlc.compiler.cuda`) into
``build/lab/``: ``mla_tvm.so`` (TVM's ``batch_prefill_paged_kv_mla``, what
``TIRPagedKVCache(attn_kind="mla")`` uses for decode and extend) and ``mla_ours.so``
(:func:`dsv2_mlc.schedules.mla_attention_cuda.mla_attention_cuda`), both for V2-Lite's shapes
(16 heads, latent 512, rope 64, fp16, page size 16), plus ``manifest.json``.

``python3 scripts/kernel_lab_mla.py run --lib-dir .devcarry/tvm-lib`` (GPU machine; needs torch
and ``tvm_ffi``, compiles nothing, never imports tvm): random q / pages / page tables for decode
(batch 1, 4, 16 x context 512, 4K, 32K), an extend case (several rows per sequence, causal 0
and 1) and a batch with an empty sequence; runs both kernels, checks them against a float32
torch reference (relative L2 of ``out``, max ``lse`` error over finite entries, ``-inf`` rows),
times them with CUDA events (median of several loops of back-to-back calls) and prints a
table with the bytes each call must read (pages + q + out) and the bandwidth achieved.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAB_DIR = ROOT / "build" / "lab"
HEADS, LATENT, ROPE, PAGE = 16, 512, 64, 16
KERNELS = {"tvm": ("mla_tvm.so", "mla_tvm"), "ours": ("mla_ours.so", "mla_ours")}


# -- here: builds ----------------------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> int:
    """Compile both kernels for CUDA into build/lab (no GPU needed)."""
    from dsv2_mlc.compiler.cuda import check_fatbin, cuda_codegen, make_cuda_target

    target = make_cuda_target(args.arch)
    import tvm
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_mla

    from dsv2_mlc.schedules.mla_attention_cuda import mla_attention_cuda

    LAB_DIR.mkdir(parents=True, exist_ok=True)
    funcs = {
        "tvm": _attention_prefill_mla(HEADS, LATENT, ROPE, "float16", False, target),
        "ours": mla_attention_cuda(HEADS, LATENT, ROPE, "float16"),
    }
    built = {}
    for key, func in funcs.items():
        lib, symbol = KERNELS[key]
        mod = tvm.IRModule({symbol: func.with_attr("global_symbol", symbol)})
        start = time.time()
        with cuda_codegen(), target:
            exe = tvm.compile(mod, target=target)
        exe.export_library(str(LAB_DIR / lib))
        check_fatbin(LAB_DIR / lib, args.arch)
        built[key] = {"library": lib, "symbol": symbol, "compile_s": round(time.time() - start, 1)}
        print(f"{key}: build/lab/{lib} ({built[key]['compile_s']} s)", flush=True)

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout

    manifest = {
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "uncommitted": git("status", "--short").splitlines(),
        "prepared": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "arch": args.arch,
        "shapes": {"heads": HEADS, "latent": LATENT, "rope": ROPE, "page_size": PAGE},
        "kernels": built,
    }
    (LAB_DIR / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return 0


# -- there: measurement ----------------------------------------------------------------------------
def _load_kernels(lib_dir: str) -> dict:
    import tvm_ffi

    for name in ("libtvm_runtime.so", "libtvm_runtime_cuda.so"):
        ctypes.CDLL(str(Path(lib_dir) / name), mode=ctypes.RTLD_GLOBAL)
    return {
        key: tvm_ffi.load_module(str(LAB_DIR / lib))[symbol]
        for key, (lib, symbol) in KERNELS.items()
    }


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
    import tvm_ffi

    names = ("q", "qo_indptr", "pages", "page_indptr", "page_indices", "length_info")
    tensors = [c[k] for k in names] + [out, lse]
    return [tvm_ffi.from_dlpack(t) for t in tensors] + [c["causal"], c["sm_scale"]]


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
    args = _args(c, *_call(torch, func, c))
    torch.cuda.synchronize()
    t0 = time.time()
    func(*args)
    torch.cuda.synchronize()
    one = max(time.time() - t0, 1e-6)
    inner = int(min(50, max(1, 0.02 / one)))
    loops = int(min(9, max(3, budget_s / (one * inner))))
    times = []
    for _ in range(loops):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            func(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return sorted(times)[len(times) // 2]


def run(args: argparse.Namespace) -> int:
    """Check and time both kernels on every case; print the table, write results JSON."""
    import torch

    kernels = _load_kernels(args.lib_dir)
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    cases: list[tuple[str, list[int], list[int], int]] = []
    for batch in (1, 4, 16):
        for ctx in (512, 4096, 32768):
            cases.append((f"decode b{batch} ctx{ctx}", [ctx] * batch, [1] * batch, 0))
    cases.append(("extend b2 q37 ctx1000 (causal 0)", [1000, 1000], [37, 37], 0))
    cases.append(("extend b2 q37 ctx1000 (causal 1)", [1000, 1000], [37, 37], 1))
    cases.append(("extend b1 q512 ctx4096 (causal 0)", [4096], [512], 0))
    cases.append(("mixed: empty seq, b3 q[1,3,2] ctx[77,0,300]", [77, 0, 300], [1, 3, 2], 0))
    results = []
    for i, (name, kv_lens, q_lens, causal) in enumerate(cases):
        c = _case(torch, kv_lens, q_lens, causal, seed=i)
        ref = _reference(torch, c)
        row: dict = {"case": name, "kv_lens": kv_lens, "q_lens": q_lens, "causal": causal}
        n_tok = sum(kv_lens)
        total = sum(q_lens)
        row["bytes"] = n_tok * (LATENT + ROPE) * 2 + total * HEADS * (LATENT + ROPE + LATENT) * 2
        for key, func in kernels.items():
            got = _call(torch, func, c)
            torch.cuda.synchronize()
            row[key] = _errors(torch, got, ref)
            row[key]["s"] = _time(torch, func, c, args.budget_per_case_s)
        del c, ref
        torch.cuda.empty_cache()
        results.append(row)
        t_b, t_o = row["tvm"]["s"], row["ours"]["s"]
        print(
            f"{name:46s} tvm {t_b * 1e6:10.1f} us  ours {t_o * 1e6:9.1f} us  "
            f"x{t_b / t_o:7.1f}  ours {row['bytes'] / t_o / 1e9:7.1f} GB/s  "
            f"err ours rel {row['ours']['rel_l2']:.1e} lse {row['ours']['lse_max_err']:.1e} "
            f"empty {row['ours']['empty_rows_ok']} nan {row['ours']['nan']} | "
            f"tvm rel {row['tvm']['rel_l2']:.1e}",
            flush=True,
        )
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "mla_lab.json").write_text(
            json.dumps({"gpu": props.name, "torch": torch.__version__, "cases": results}, indent=1)
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="compile both kernels into build/lab (build box)")
    p.add_argument("--arch", default="sm_90")
    r = sub.add_parser("run", help="check and time both kernels (GPU machine)")
    r.add_argument("--lib-dir", default=os.environ.get("DSV2_MLC_TVM_LIB_DIR", ".devcarry/tvm-lib"))
    r.add_argument("--out", default=os.environ.get("OUT"))
    r.add_argument("--budget-per-case-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
