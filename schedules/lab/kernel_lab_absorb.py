"""Kernel lab, MLA prologue of absorbed attention: the fused kernel's tiles.

``python schedules/lab/kernel_lab_absorb.py prepare`` (build box, TVM + nvcc, no GPU): compiles
TIR-only libraries for CUDA sm_90 (precompiled fatbins, :mod:`dsv2_mlc.compiler.cuda`) into the
lab folder at V2-Lite's shapes (16 heads, nope 128, rope 64, latent 512, fp16, no q-LoRA: the
query and the latent come from one ``qkv_a_proj`` output ``[n, 3648]``):

* ``latent_norm_rope``: the TE kernel of :mod:`dsv2_mlc.model.mla_ops` (RMSNorm + RoPE of the
  cached latent) scheduled by dlight's default rules, as the pipeline does, reading a separate
  ``kv_a_proj_with_mqa`` output ``[n, 576]`` (a yardstick: the latent alone);
* one ``prologue_<variant>`` per entry of :data:`VARIANTS`:
  :func:`dsv2_mlc.schedules.mla_prologue_cuda.build_mla_prologue` with the shipped tiles of
  ``schedules/tiles.py`` changed by those fields (``ours`` = the shipped tiles, what the model
  uses), both outputs in one launch;

plus ``manifest.json`` (which lists them).

``python3 schedules/lab/kernel_lab_absorb.py run --lib-dir LIBS --out DIR`` (GPU machine,
``LIBS`` holding TVM's runtime libraries; torch and ``tvm_ffi``, compiles nothing, never imports
tvm): for 1, 4, 16 and 128 tokens, random inputs; every kernel is checked against a float32 torch
reference (relative L2 and max abs error of ``q_lat`` and of the latent; outputs are NaN-filled
first, so an unwritten element shows) and timed three ways, rotating over copies of ``W_UK`` (2
MB each, 96 MB in all: not L2-resident, as in a decode step): ``cold`` (CUDA events over
back-to-back calls), ``graph`` (the same calls replayed from a CUDA graph: launch overhead as in a
captured decode step) and ``kernel`` (CUPTI kernel durations, launch gaps excluded). Prints one
table per timing (case x kernel, us; ``!`` marks a wrong result); writes ``absorb_lab.json``
under ``--out``.
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
LAB_DIR = ROOT / "build" / "lab_absorb"
HEADS, NOPE, ROPE, LATENT, EPS = 16, 128, 64, 512, 1e-6
QK = NOPE + ROPE
Q_COLS = HEADS * QK  # 3072: the query heads of the fused projection output
WIDTH = Q_COLS + LATENT + ROPE  # 3648
# name -> MLAPrologueTiles fields changed from the shipped tiles ("ours": none);
# blocks per token: 1 + 16 * ceil(512 / cols)
VARIANTS: dict[str, dict] = {
    "ours": {},  # 64 columns, 128 threads: 129 blocks
    "c32": {"cols": 32},  # 257 blocks, 32 reduction groups
    "c16": {"cols": 16},  # 513 blocks, 64 reduction groups
    "c128": {"cols": 128},  # 65 blocks
    "c64_t256": {"cols": 64, "threads": 256},  # 129 blocks, 32 reduction groups
    "c32_t256": {"cols": 32, "threads": 256},  # 257 blocks, 64 reduction groups
}
CASES = (1, 4, 16, 128)  # tokens
BAD_REL = 2e-3  # a result worse than this (relative L2) is flagged "!"
W_COPIES = 48  # 96 MB of W_UK, more than the H200's L2


# -- here: builds ----------------------------------------------------------------------------------
def _latent_norm_rope_dlight(target):  # -> tvm.tirx.PrimFunc
    import tvm
    from tvm import te, tirx

    from dsv2_mlc.model.mla_ops import latent_norm_rope_te

    n = tirx.Var("n", "int64")
    x = te.placeholder((n, tirx.IntImm("int64", LATENT + ROPE)), "float16", name="kv")
    w = te.placeholder((tirx.IntImm("int64", LATENT),), "float16", name="norm_w")
    tab = te.placeholder((n, tirx.IntImm("int64", ROPE)), "float32", name="tab")
    out = latent_norm_rope_te(x, w, tab, LATENT, EPS)
    func = te.create_prim_func([x, w, tab, out], "int64")  # (as Relax's call_te)
    return lab_common.apply_dlight(tvm.IRModule({"main": func}), target)["main"]


def prepare(args: argparse.Namespace) -> int:
    """Compile the yardstick and every variant for CUDA into the lab folder (no GPU)."""
    from dsv2_mlc.compiler.cuda import make_cuda_target
    from dsv2_mlc.schedules.mla_prologue_cuda import build_mla_prologue
    from dsv2_mlc.schedules.tiles import tuned

    target = make_cuda_target(args.arch)
    lab_common.fresh_lab_dir(LAB_DIR, "absorb_*.so")
    funcs = {"latent_norm_rope": _latent_norm_rope_dlight(target)}
    for name, kwargs in VARIANTS.items():
        funcs[f"prologue_{name}"] = build_mla_prologue(
            HEADS, NOPE, ROPE, LATENT, "float16", replace(tuned("mla_prologue"), **kwargs),
            q_width=WIDTH, kv_width=WIDTH, kv_offset=Q_COLS, eps=EPS,
        )  # fmt: skip
    described = {
        "latent_norm_rope": "model/mla_ops.latent_norm_rope_te, dlight default rules",
        **{f"prologue_{k}": v for k, v in VARIANTS.items()},
    }
    built = lab_common.build_libraries(
        funcs, LAB_DIR, "absorb", args.arch, target, described, "(unused)"
    )
    manifest = {
        **lab_common.manifest_header(args.arch),
        "shapes": {"heads": HEADS, "nope": NOPE, "rope": ROPE, "latent": LATENT, "eps": EPS},
        "kernels": built,
    }
    lab_common.write_manifest(LAB_DIR, manifest)
    return 0


# -- there: measurement ----------------------------------------------------------------------------
def _rope(torch, x, tab):
    """Interleaved pairs of ``x [..., R]`` rotated by ``tab [..., R]`` (cos, sin per pair)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = tab[..., 0::2], tab[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


def _case(torch, n: int, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=dev) * scale

    qkv = randn(n, WIDTH).half()
    angles = torch.rand(n, ROPE // 2, generator=gen, device=dev) * 2 * math.pi
    tab = torch.stack([angles.cos(), angles.sin()], dim=-1).flatten(-2) * 1.2  # (a YaRN mscale)
    ws = [randn(HEADS, NOPE, LATENT, scale=NOPE**-0.5).half() for _ in range(W_COPIES)]
    norm_w = (1 + randn(LATENT, scale=0.2)).half()
    return {
        "n": n,
        "qkv": qkv,
        "kv": qkv[:, Q_COLS:].contiguous(),  # the yardstick reads a separate projection output
        "tab": tab.contiguous(),
        "ws": ws,
        "norm_w": norm_w,
        "q_lat": torch.empty(n, HEADS, LATENT + ROPE, device=dev, dtype=torch.float16),
        "latent": torch.empty(n, LATENT + ROPE, device=dev, dtype=torch.float16),
    }


def _reference(torch, c: dict) -> tuple:
    """float32 (q_lat [n, H, L + R], latent [n, L + R])."""
    x = c["qkv"].float()
    q = x[:, :Q_COLS].view(-1, HEADS, QK)
    q_abs = torch.einsum("nhd,hdc->nhc", q[..., :NOPE], c["ws"][0].float())
    q_lat = torch.cat([q_abs, _rope(torch, q[..., NOPE:], c["tab"][:, None, :])], dim=-1)
    kv = x[:, Q_COLS:]
    ckv = kv[:, :LATENT]
    inv = torch.rsqrt(ckv.square().mean(-1, keepdim=True) + EPS)
    normed = c["norm_w"].float() * (ckv * inv)
    return q_lat, torch.cat([normed, _rope(torch, kv[:, LATENT:], c["tab"])], dim=-1)


def _calls(key: str, funcs: dict, c: dict) -> list:
    """One closure per W_UK copy running kernel ``key``."""
    t = lab_common.ffi_tensors
    f = funcs[key]
    if key == "latent_norm_rope":  # (no W_UK: the same call for every copy)
        sets = [t(c["kv"], c["norm_w"], c["tab"], c["latent"])] * len(c["ws"])
    else:
        sets = [
            t(c["qkv"], c["qkv"], w, c["norm_w"], c["tab"], c["q_lat"], c["latent"])
            for w in c["ws"]
        ]
    return [lambda a=a: f(*a) for a in sets]


def _errors(torch, c: dict, ref: tuple, key: str) -> dict:
    out = {}
    for name, got, want in (("q_lat", c["q_lat"], ref[0]), ("latent", c["latent"], ref[1])):
        if key == "latent_norm_rope" and name == "q_lat":
            continue
        g = got.float()
        out[f"{name}_rel_l2"] = float((g - want).norm() / want.norm().clamp_min(1e-30))
        out[f"{name}_max_abs"] = float((g - want).abs().max())
        out[f"{name}_nan"] = bool(torch.isnan(g).any())
    return out


def _bad(e: dict) -> bool:
    return any(
        (k.endswith("_rel_l2") and not v <= BAD_REL) or (k.endswith("_nan") and v)
        for k, v in e.items()
    )


def run(args: argparse.Namespace) -> int:
    """Check and time every kernel on every case; print the tables, write results JSON."""
    import torch
    import tvm_ffi

    funcs = lab_common.load_kernels(args.lib_dir, LAB_DIR, args.only)
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    keys = list(funcs)
    results = []
    for i, n in enumerate(CASES):
        if args.cases and str(n) not in args.cases.split(","):
            continue
        c = _case(torch, n, seed=i)
        ref = _reference(torch, c)
        row: dict = {"tokens": n}
        for key in keys:
            try:
                calls = _calls(key, funcs, c)
                c["q_lat"].fill_(float("nan"))
                c["latent"].fill_(float("nan"))
                with tvm_ffi.use_torch_stream():
                    calls[0]()
                torch.cuda.synchronize()
                cell = _errors(torch, c, ref, key)
                with tvm_ffi.use_torch_stream():
                    cell["cold_s"] = lab_common.time_call(
                        torch, lambda cs=calls: [f() for f in cs], [], args.budget_s
                    ) / len(calls)
                    if not args.no_profile:
                        cell["kernel_s"] = lab_common.cupti_seconds(torch, calls)
                cell["graph_s"] = lab_common.graph_seconds(torch, tvm_ffi, calls)
                row[key] = cell
            except Exception as err:  # noqa: BLE001 - report and go on with the next kernel
                row[key] = {"error": str(err)[:300]}
                print(f"  {key} at {n} tokens: {row[key]['error'][:160]}", flush=True)
        results.append(row)
        del c, ref
        torch.cuda.empty_cache()
        print(f"{n} tokens done", flush=True)
    _tables(results, keys)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        manifest = lab_common.read_manifest(LAB_DIR)
        report = {"gpu": props.name, "torch": torch.__version__, "manifest": manifest}
        (out / "absorb_lab.json").write_text(json.dumps({**report, "cases": results}, indent=1))
    return 0


def _tables(results: list, keys: list) -> None:
    width = max(10, *(len(k) + 1 for k in keys))
    for mode in ("kernel_s", "graph_s", "cold_s"):
        print(f"\n== {mode[:-2]} (us per call; ! = wrong result, - = not measured)")
        print(f"{'tokens':>7s}" + "".join(f"{k:>{width}s}" for k in keys))
        for row in results:
            cells = []
            for key in keys:
                cell = row.get(key, {})
                t = cell.get(mode)
                mark = "!" if "error" in cell or _bad(cell) else " "
                cells.append(f"{'-' if t is None else f'{t * 1e6:.2f}'}{mark}".rjust(width))
            print(f"{row['tokens']:7d}" + "".join(cells))
    print("\nmax errors over the cases (rel L2 / max abs, q_lat then latent):")
    for key in keys:
        cells = [r[key] for r in results if key in r and "error" not in r[key]]
        parts = []
        for name in ("q_lat", "latent"):
            rel = [e[f"{name}_rel_l2"] for e in cells if f"{name}_rel_l2" in e]
            mx = [e[f"{name}_max_abs"] for e in cells if f"{name}_max_abs" in e]
            if rel:
                parts.append(f"{name} {max(rel):.1e} / {max(mx):.1e}")
        print(f"  {key:24s} " + ("; ".join(parts) if parts else "no result"))


def main(argv: list[str] | None = None) -> int:
    parser, _, r = lab_common.lab_parser(
        __doc__,
        "compile the kernels into build/lab_absorb (build box)",
        "check and time the kernels (GPU machine)",
    )
    r.add_argument("--budget-s", type=float, default=0.2, help="timing budget per measurement")
    r.add_argument("--only", default=None, help="comma-separated kernel names")
    r.add_argument("--cases", default=None, help="comma-separated token counts (1,4,16,128)")
    r.add_argument("--no-profile", action="store_true", help="skip the CUPTI kernel times")
    args = parser.parse_args(argv)
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
