"""Kernel lab, the expert-major MoE decode kernels on tensor cores
(:mod:`dsv2_mlc.schedules.moe_expert_mma_cuda`).

``python schedules/lab/kernel_lab_expert_mma.py prepare`` (build box, TVM + nvcc, no GPU): for
V2-Lite's MoE shape (hidden 2048, expert width 1408, 2 shared experts = 2816, 64 experts, top-6,
INT4 group 128) one library per tiling of :data:`GATE_UP_VARIANTS` / :data:`DOWN_VARIANTS`
(``gu_lite_<tiles>`` / ``dn_lite_<tiles>``, through the tile-taking builders
``gate_up_expert_mma_kernel`` / ``down_expert_mma_kernel``; the table's tiles first, the variants
as changes to them), and the full V2's shape (hidden 5120, width 1536, 160 experts, group-limited
routing) with the table's tiles (``gu_v2_*``, ``dn_v2_*``), into the lab folder (``--lab-dir``,
by default :data:`LAB_DIR`) with ``manifest.json``: each kernel's tiles, why the variant, its
shared memory a block, the blocks of it that shared memory and registers (read from the cubin)
let an SM hold and the waves of its fixed grid on 132 SMs. ``--only`` (comma-separated keys)
builds those alone.

``python3 schedules/lab/kernel_lab_expert_mma.py run --lib-dir LIBS --out DIR`` (GPU machine;
torch + ``tvm_ffi`` + TVM's runtime libraries, never imports tvm): random INT4 experts and fp16
scales, x ~ N(0, 1) and routing ids for n tokens (``--tokens``; top-k distinct experts a token,
uniform, within ``topk_group`` random groups for group-limited routing), the arguments as
``GroupQuantExperts.expert_major_decode`` passes them. A float32 torch reference (the dequantised
experts, SwiGLU) checks every gate/up kernel's ``h`` [n, K I + Is] and every down kernel's
``part`` [n, K + 1, H] (run on the reference's ``h``, in fp16) by relative L2 (outputs start as
NaN: an element left unwritten fails); each is timed with CUDA events (``lab_common.time_call``),
with ``--cupti`` also by CUPTI, and shown with the GB/s of the weights + scales of the experts
the tokens select (each plan group of ``tiles.tokens`` tokens reads its distinct experts once)
and the shared experts'. A kernel that fails to load, raises or is wrong is reported, not fatal
(a sticky CUDA fault still ends the run: the results so far are written after every row). Results
go to ``DIR/expert_mma_lab.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lab_common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAB_DIR = ROOT / "build" / "lab_expert_mma"  # schedules/build/, as the other labs
PREFIX = "emma"
from kernel_lab_moe_decode import SHAPES  # noqa: E402 (the same two MoE shapes)

SMS, SM_SHARED, SM_REGS, SM_THREADS = 132, 228 * 1024, 65536, 2048  # H200 (sm_90)
# (changes to the table's MmaTiles, why): the first of each is the table's tiles. At chunk 16
# gate/up stages 16 rows of x (2048 values) + the plan: 75.7 KB a block, and takes 152 registers
# a thread: 3 blocks of 4 warps an SM by either (396 blocks: one wave); down stages 16 rows of
# the widest h slice (the shared 2816) + the plan: 100.8 KB, 2 an SM, so its 528 blocks run as
# two waves.
# (the K-sliced activation staging, MmaTiles.stage_k, and its variants: in git up to ef59bc7,
# measured slower everywhere; schedules/results/decode_batches.md)
GATE_UP_VARIANTS: tuple[tuple[dict, str], ...] = (
    ({}, "table: 64 rows, 3 blocks an SM by shared memory and registers, 396 = one wave"),
    (dict(rows=128), "staging per item: a staged chunk serves 128 rows (11 items a chunk)"),
    (dict(rows=256), "staging per item: 256 rows (6 items a chunk, the last half empty)"),
    (dict(rows=512), "staging per item: 512 rows (3 items a chunk); fewer items than blocks"),
    (dict(rows=128, warps=8, blocks=132), "8 warps a tile each: 152 registers let 1 an SM"),
    (dict(blocks=264), "occupancy: 2 blocks an SM (8 warps), one wave"),
    (dict(chunk=8), "chunk 8: 42.9 KB (registers still hold 3 an SM); 3 reads an expert"),
    (dict(chunk=32, blocks=132), "chunk 32: 141 KB, 1 an SM; an expert's rows read once"),
)
DOWN_VARIANTS: tuple[tuple[dict, str], ...] = (
    ({}, "table: 128 rows, depth 2, 528 blocks but 2 an SM fit: two waves"),
    (dict(blocks=264), "occupancy: the table's tiles in one wave of 2 blocks an SM"),
    (dict(chunk=8), "chunk 8: 55.7 KB, 4 an SM: 528 in one wave; 3 reads an expert"),
    (dict(chunk=32, blocks=132), "chunk 32: 191 KB, 1 an SM; an expert's rows read once"),
    (dict(blocks=264, rows=256), "staging per item: a staged chunk serves 256 rows (8 items)"),
    (dict(blocks=264, rows=512), "staging per item: 512 rows (4 items a chunk)"),
    (dict(blocks=264, depth=1), "one run in flight instead of two, one wave"),
    (dict(blocks=264, warps=4), "4 warps (2 tiles each), 8 warps an SM: latency hiding"),
    (dict(blocks=396, rows=256), "rows 256 at 1.5 waves (3 asked, 2 fit)"),
)
V2_VARIANTS: tuple[tuple[dict, str], ...] = (({}, "table"),)
BAD_REL = 5e-3  # relative L2 above this is flagged "!"
TOKENS = "32,64,128,256"
DEVICE = "cuda"  # where ``run``'s data and reference live (the tests use the CPU)


# -- here: builds ----------------------------------------------------------------------------------
def _kernels() -> tuple[dict, dict]:
    """(key -> PrimFunc, key -> description) of every kernel the lab builds."""
    from dsv2_mlc.schedules import moe_expert_mma_cuda as m
    from dsv2_mlc.schedules.moe_decode_cuda import MoeDecodeShape
    from dsv2_mlc.schedules.tiles import tuned

    funcs, info = {}, {}
    for shape_name, shape_kw in SHAPES.items():
        shape = MoeDecodeShape(**shape_kw)
        plan = GATE_UP_VARIANTS if shape_name == "lite" else V2_VARIANTS
        plan_dn = DOWN_VARIANTS if shape_name == "lite" else V2_VARIANTS
        kinds = (
            ("gate_up", "gu", plan, m.gate_up_expert_mma_kernel, shape.hidden, 2),
            ("down", "dn", plan_dn, m.down_expert_mma_kernel, max(shape.inter,
             shape.shared_inter), 1),
        )  # fmt: skip
        for kind, short, variants, builder, width, tiles_a in kinds:
            base = tuned(f"moe_expert_mma_{kind}", shape=(shape.hidden,))
            for change, why in variants:
                tiles = replace(base, **change)
                key = f"{short}_{shape_name}_{tiles.name}"
                bad = m.expert_mma_unsupported(shape, tiles)
                if bad is not None:
                    print(f"{key}: skipped, {bad}")
                    continue
                smem = m._smem_bytes(tiles, width, tiles_a) + m.plan_bytes(shape, tiles)
                funcs[key] = builder(shape, tiles)
                info[key] = {"shape": shape_name, "kind": kind, "tiles": tiles.__dict__,
                             "why": why, "smem_bytes": smem}  # fmt: skip
    return funcs, info


def _registers(library: Path) -> list[int]:
    """Registers a thread of each kernel in the cubins of ``library``: the ``EIATTR_REGCOUNT``
    entries (attribute 0x2f: symbol, count) of their ``.nv.info`` sections; empty where no cubin
    is found uncompressed."""
    data, regs = library.read_bytes(), []
    start = data.find(b"\x7fELF")
    while start >= 0:
        elf = data[start:]

        def num(at: int, size: int, e: bytes = elf) -> int:
            return int.from_bytes(e[at : at + size], "little")

        if elf[4] == 2 and num(18, 2) == 190:  # ELFCLASS64, EM_CUDA
            shoff, shentsize, shnum, shstrndx = num(40, 8), num(58, 2), num(60, 2), num(62, 2)
            names = num(shoff + shstrndx * shentsize + 24, 8)
            for sh in range(shoff, shoff + shnum * shentsize, shentsize):
                if elf[names + num(sh, 4) :].startswith(b".nv.info\0"):
                    at, end = num(sh + 24, 8), num(sh + 24, 8) + num(sh + 32, 8)
                    while at + 4 <= end:  # entries: format, attribute, u16 (size if format 4)
                        fmt, attr, size = elf[at], elf[at + 1], num(at + 2, 2)
                        if fmt == 4 and attr == 0x2F:
                            regs.append(num(at + 8, 4))
                        at += 4 + (size if fmt == 4 else 0)
        start = data.find(b"\x7fELF", start + 4)
    return regs


def _occupancy(entry: dict, regs: int | None) -> dict:
    """Blocks an SM holds (shared memory with 1 KB reserved a block, threads, registers
    allocated 8 at a time) and the waves of the kernel's fixed grid on :data:`SMS` SMs."""
    t = entry["kwargs"]["tiles"]
    threads = 32 * t["warps"]
    fit = min(SM_SHARED // (entry["kwargs"]["smem_bytes"] + 1024), SM_THREADS // threads)
    if regs:
        fit = min(fit, SM_REGS // (-(-regs // 8) * 8 * threads))
    return {"regs": regs, "blocks_per_sm": fit,
            "waves": round(t["blocks"] / (SMS * fit), 2) if fit else None}  # fmt: skip


def prepare(args: argparse.Namespace) -> int:
    """Compile every kernel for CUDA into the lab folder (no GPU needed)."""
    from dsv2_mlc.compiler.cuda import make_cuda_target

    target = make_cuda_target(args.arch)
    lab_dir = Path(args.lab_dir)
    funcs, info = _kernels()
    if args.only:
        keep = set(args.only.split(","))
        if keep - set(funcs):
            raise SystemExit(f"no such kernels: {sorted(keep - set(funcs))} (see {sorted(funcs)})")
        funcs = {k: v for k, v in funcs.items() if k in keep}
    lab_common.fresh_lab_dir(lab_dir, f"{PREFIX}_*.so")
    start = time.time()
    built = lab_common.build_libraries(funcs, lab_dir, PREFIX, args.arch, target, info, "")
    for key, entry in built.items():
        regs = _registers(lab_dir / entry["library"])
        entry.update(_occupancy(entry, max(regs) if regs else None))
        print(f"  {key}: {entry['kwargs']['smem_bytes']} B shared, {entry['regs']} registers, "
              f"{entry['blocks_per_sm']} blocks an SM, {entry['waves']} waves")  # fmt: skip
    manifest = {**lab_common.manifest_header(args.arch), "shapes": SHAPES, "kernels": built,
                "prepare_s": round(time.time() - start, 1)}  # fmt: skip
    lab_common.write_manifest(lab_dir, manifest)
    total = sum(e["bytes"] for e in built.values())
    print(f"{len(built)} libraries, {total / 1e6:.1f} MB, {manifest['prepare_s']} s")
    return 0


# -- there: measurement ----------------------------------------------------------------------------
def _data(torch, shape: dict, seed: int) -> dict:
    """Random INT4 experts (int32 words) and fp16 scales sized for O(1) outputs."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    H, NI, IS, E, G = (shape[k] for k in ("hidden", "inter", "shared_inter", "experts", "group"))

    def packed(*dims):
        r = torch.randint(-(2**31), 2**31 - 1, dims, generator=gen, device=DEVICE)
        return r.to(torch.int32)

    def scales(*dims, fan_in: int):
        u = torch.rand(*dims, generator=gen, device=DEVICE)
        return ((0.5 + u) / (4.6 * fan_in**0.5)).to(torch.float16)

    return {
        "gu_w": packed(E, 2 * NI, H // 8),
        "gu_s": scales(E, 2 * NI, H // G, fan_in=H),
        "sgu_w": packed(2 * IS, H // 8),
        "sgu_s": scales(2 * IS, H // G, fan_in=H),
        "dn_w": packed(E, H, NI // 8),
        "dn_s": scales(E, H, NI // G, fan_in=NI),
        "sdn_w": packed(H, IS // 8),
        "sdn_s": scales(H, IS // G, fan_in=IS),
    }


def _tokens(torch, shape: dict, n: int, seed: int) -> tuple:
    """(x [n, H] fp16 ~ N(0, 1), ids [n, K] int32): K distinct experts a token, uniform; with
    group-limited routing within ``topk_group`` random groups of ``n_group``."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    E, K, groups = shape["experts"], shape["top_k"], shape.get("n_group", 1)
    score = torch.rand(n, E, generator=gen, device=DEVICE)
    if groups > 1 and shape["topk_group"] < groups:
        g = torch.rand(n, groups, generator=gen, device=DEVICE).topk(shape["topk_group"]).indices
        keep = torch.zeros(n, groups, device=DEVICE).scatter_(1, g, 1.0)
        score = score * keep.repeat_interleave(E // groups, dim=1) - (1 - keep).repeat_interleave(
            E // groups, dim=1
        )
    ids = score.topk(K, dim=-1).indices.to(torch.int32)
    x = torch.randn(n, shape["hidden"], generator=gen, device=DEVICE).to(torch.float16)
    return x, ids.contiguous()


def _dequant(torch, words, scale, group: int):
    """float32 [..., K] of INT4 words [..., K/8] (int32) and scales [..., K/group]."""
    shifts = torch.arange(8, device=words.device, dtype=torch.int32) * 4
    q = ((words.unsqueeze(-1) >> shifts) & 15).reshape(*words.shape[:-1], -1).float() - 8.0
    return q * scale.float().repeat_interleave(group, dim=-1)


def _reference(torch, d: dict, shape: dict, x, ids) -> dict:
    """h [n, K I + Is] and part [n, K + 1, H] (down of h rounded to fp16) in float32, expert by
    expert (each expert dequantised once)."""
    G, NI, IS, K, H = (shape[k] for k in ("group", "inter", "shared_inter", "top_k", "hidden"))
    n, silu = x.shape[0], torch.nn.functional.silu
    xf = x.float()
    hr = torch.zeros(n, K, NI, device=DEVICE)
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        gu = xf[t] @ _dequant(torch, d["gu_w"][e], d["gu_s"][e], G).T
        hr[t, j] = silu(gu[:, :NI]) * gu[:, NI:]
    s = xf @ _dequant(torch, d["sgu_w"], d["sgu_s"], G).T
    h = torch.cat([hr.reshape(n, K * NI), silu(s[:, :IS]) * s[:, IS:]], dim=1)
    hh = h.half().float()
    part = torch.zeros(n, K + 1, H, device=DEVICE)
    hk = hh[:, : K * NI].reshape(n, K, NI)
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        part[t, j] = hk[t, j] @ _dequant(torch, d["dn_w"][e], d["dn_s"][e], G).T
    part[:, K] = hh[:, K * NI :] @ _dequant(torch, d["sdn_w"], d["sdn_s"], G).T
    return {"h": h, "part": part}


def _rel(torch, a, b) -> float:
    return float(torch.linalg.norm(a.float() - b.float()) / torch.linalg.norm(b.float()))


def _weight_bytes(shape: dict, ids, plan_tokens: int) -> dict:
    """Bytes of weights + scales a call reads: each plan group's distinct routed experts and the
    shared experts, once a group."""
    H, NI, IS, G = (shape[k] for k in ("hidden", "inter", "shared_inter", "group"))
    per = H * (1 + 4 / G) / 2  # bytes of a weight row of H inputs or of H rows of one input
    routed, shared = (
        {"gate_up": 2 * NI * per, "down": NI * per},
        {"gate_up": 2 * IS * per, "down": IS * per},
    )
    starts = range(0, ids.shape[0], plan_tokens)
    groups = [ids[t : t + plan_tokens].unique().numel() for t in starts]
    return {k: int(sum(g * routed[k] + shared[k] for g in groups)) for k in routed}


def _load(lib_dir: str, lab_dir: Path, built: dict) -> tuple[dict, dict]:
    """(key -> function, key -> load error) of the manifest's libraries."""
    import tvm_ffi

    lab_common.load_tvm_runtime(lib_dir)
    fns, errors = {}, {}
    for key, k in built.items():
        try:
            fns[key] = tvm_ffi.load_module(str(lab_dir / k["library"]))[k["symbol"]]
        except Exception as err:  # noqa: BLE001 - reported, the lab goes on without it
            errors[key] = f"load: {str(err)[:200]}"
    return fns, errors


def _case(torch, fn, k: dict, d: dict, shape: dict, x, ids, ref: dict, args) -> dict:
    """One kernel at one n: checked against ``ref``, timed; the row's measurements."""
    ffi, u32 = lab_common.ffi_tensors, torch.uint32
    n, K, H = x.shape[0], shape["top_k"], shape["hidden"]
    total = K * shape["inter"] + shape["shared_inter"]
    if k["kind"] == "gate_up":
        out = torch.full((n, total), float("nan"), dtype=torch.float16, device=DEVICE)
        call = ffi(x, ids, d["gu_w"].view(u32), d["gu_s"], d["sgu_w"].view(u32), d["sgu_s"], out)
        want = ref["h"]
    else:
        out = torch.full((n, K + 1, H), float("nan"), device=DEVICE)
        h = ref["h"].half()
        call = ffi(h, ids, d["dn_w"].view(u32), d["dn_s"], d["sdn_w"].view(u32), d["sdn_s"], out)
        want = ref["part"]
    fn(*call)
    torch.cuda.synchronize()
    rel = _rel(torch, out, want)
    row = {"rel_l2": rel, "ok": rel < BAD_REL, "unwritten": int(out.isnan().sum())}
    row["us"] = lab_common.time_call(torch, fn, call, args.budget_per_case_s) * 1e6
    if args.cupti:
        sec = lab_common.cupti_seconds(torch, [lambda: fn(*call)])
        row["cupti_us"] = sec * 1e6 if sec else None
    return row


def _best(rows: list[dict]) -> list[dict]:
    """Per (shape, kernel kind, n): the table's tiles (the first key of the kind) and the fastest
    correct variant, with the ratio of their times; printed too."""
    best, table = {}, {}
    for r in rows:
        if not r["ok"]:
            continue
        case = (r["shape"], r["kernel"][:2], r["n"])
        table.setdefault(case, r)
        if case not in best or r["us"] < best[case]["us"]:
            best[case] = r
    out = []
    for case, r in best.items():
        t = table[case]
        out.append({"shape": case[0], "kind": case[1], "n": case[2], "table": t["kernel"],
                    "table_us": t["us"], "best": r["kernel"], "best_us": r["us"],
                    "speedup": t["us"] / r["us"]})  # fmt: skip
        print(f"{case[0]:4} n={case[2]:<4} {t['kernel']:34} {t['us']:8.1f} us -> "
              f"{r['kernel']:34} {r['us']:8.1f} us ({t['us'] / r['us']:.2f}x)")  # fmt: skip
    return out


def run(args: argparse.Namespace) -> int:
    """Check and time every kernel of the manifest on the GPU (see the module docstring)."""
    import torch

    lab_dir = Path(args.lab_dir)
    manifest = lab_common.read_manifest(lab_dir)
    built = manifest["kernels"]
    if args.only:
        built = {k: v for k, v in built.items() if k in set(args.only.split(","))}
    fns, errors = _load(args.lib_dir, lab_dir, built)
    rows = [{"kernel": key, "ok": False, "error": err} for key, err in errors.items()]
    for key, err in errors.items():
        print(f"{key}: {err}  !", flush=True)
    result = {"manifest": manifest, "device": torch.cuda.get_device_name(), "rows": rows}
    out_file = Path(args.out) / "expert_mma_lab.json" if args.out else None
    if out_file:
        out_file.parent.mkdir(parents=True, exist_ok=True)
    for shape_name, shape in manifest["shapes"].items():
        mine = {key: fn for key, fn in fns.items() if built[key]["kwargs"]["shape"] == shape_name}
        if not mine:
            continue
        d = _data(torch, shape, seed=0)
        for n in (int(v) for v in args.tokens.split(",")):
            x, ids = _tokens(torch, shape, n, seed=n)
            ref = _reference(torch, d, shape, x, ids)
            for key, fn in mine.items():
                k = built[key]["kwargs"]
                nbytes = _weight_bytes(shape, ids, k["tiles"]["tokens"])[k["kind"]]
                row = {"shape": shape_name, "n": n, "kernel": key, "bytes": nbytes}
                try:
                    row.update(_case(torch, fn, k, d, shape, x, ids, ref, args))
                    row["GB/s"] = nbytes / row["us"] / 1e3
                    flag = "" if row["ok"] else "  !"
                    shown = f"{row['us']:8.1f} us {row['GB/s']:6.0f} GB/s rel {row['rel_l2']:.2e}"
                    print(f"{shape_name:4} n={n:<4} {key:34} {shown}{flag}", flush=True)
                except Exception as err:  # noqa: BLE001 - reported, the lab goes on
                    row.update(ok=False, error=f"call: {str(err)[:200]}")
                    print(f"{shape_name:4} n={n:<4} {key:34} {row['error']}  !", flush=True)
                rows.append(row)
                if out_file:
                    out_file.write_text(json.dumps(result, indent=1))
    result["best"] = _best(rows)
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    if out_file:
        out_file.write_text(json.dumps(result, indent=1))
    bad = sorted({r["kernel"] for r in rows if not r["ok"]})
    return lab_common.verdict(bad)


def main() -> int:
    parser, p, r = lab_common.lab_parser(
        __doc__, "compile the kernels here", "check and time them on the GPU", LAB_DIR
    )
    for sub in (p, r):
        sub.add_argument("--only", default=None, help="comma-separated kernel keys")
    r.add_argument("--tokens", default=TOKENS, help="comma-separated batch sizes n")
    r.add_argument("--budget-per-case-s", type=float, default=0.3)
    r.add_argument("--cupti", action="store_true", help="also CUPTI kernel times")
    args = parser.parse_args()
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
