"""Kernel lab, the fused MoE decode kernels (:mod:`dsv2_mlc.schedules.moe_decode_cuda`).

``python schedules/lab/kernel_lab_moe_decode.py prepare`` (build box, TVM + nvcc, no GPU): compiles
one
library per kernel into ``build/lab_moe_decode/``: for V2-Lite's MoE shape (hidden 2048, expert
intermediate 1408, 2 shared experts, 64 experts, top-6 greedy, INT4 group 128) every tiling of
:data:`GATE_UP_VARIANTS` / :data:`DOWN_VARIANTS` (``gu_lite_<tiles>``, ``dn_lite_<tiles>``,
through the builders' tile-taking functions ``gate_up_decode_kernel`` / ``down_decode_kernel``),
and every tiling of :data:`V2_GATE_UP_VARIANTS` / :data:`V2_DOWN_VARIANTS` for the full V2's shape
(hidden 5120, intermediate 1536, 160 experts, top-6 of group-limited routing over 8 groups / 3
kept, scale 16: ``gu_v2_<tiles>``, ``dn_v2_<tiles>``), plus ``manifest.json``. ``--only``
(comma-separated keys) builds those alone.

``python3 schedules/lab/kernel_lab_moe_decode.py run --lib-dir LIBS --out DIR`` (GPU
machine; torch + ``tvm_ffi`` + TVM's runtime libraries, never imports tvm): random INT4 experts,
activations and router logits for n tokens (1 and 4); a float32 torch reference (softmax,
greedy or group-limited top-k, the dequantised experts, SwiGLU, the weighted sum); every
gate/up kernel is checked (ids exact, weights, ``h`` relative L2) and every down kernel is run on
the reference's ``h`` / routing and checked (``out`` relative L2); each is timed with CUDA events
(median of loops of back-to-back calls) and shown with the GB/s of the weights it reads. Results
go to ``DIR/moe_decode_lab.json``.
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
LAB_DIR = ROOT / "build" / "lab_moe_decode"
# name -> MoeDecodeShape keyword arguments
SHAPES: dict[str, dict] = {
    "lite": dict(hidden=2048, inter=1408, shared_inter=2816, experts=64, top_k=6, group=128),
    "v2": dict(
        hidden=5120,
        inter=1536,
        shared_inter=3072,
        experts=160,
        top_k=6,
        group=128,
        n_group=8,
        topk_group=3,
        norm_topk_prob=False,
        routed_scaling_factor=16.0,
    ),
}
# (warps, blocks, run[, min_blocks]) of GateUpTiles and (warps, lanes, rows, run[, min_blocks])
# of DecodeTiles (min_blocks: __launch_bounds__ blocks an SM); the first of each is the shipped
# one (schedules/tiles.py)
GATE_UP_VARIANTS = (
    (8, 264, 16),
    (8, 132, 16),
    (4, 264, 16),
    (8, 396, 16),
    (16, 132, 16),
    (8, 264, 8),
    (8, 396, 16, 3),
    (4, 792, 16, 6),
)
DOWN_VARIANTS = (
    (8, 32, 2, 8),
    (4, 32, 2, 8),
    (8, 32, 1, 8),
    (4, 32, 4, 8),
    (8, 32, 2, 16),
    (8, 32, 1, 8, 2),
    (4, 32, 2, 8, 4),
    (4, 32, 1, 8, 4),
)
# the same at the full V2's shape (hidden 5120: the gate/up kernel holds a lane's share of x in
# registers, 254 a thread at 8 warps); the first of each is the shipped one
V2_GATE_UP_VARIANTS = (
    (4, 264, 16),
    (4, 132, 16),
    (8, 132, 16),
    (4, 396, 16),
    (2, 528, 16),
    (4, 264, 8),
    (4, 264, 16, 2),
)
V2_DOWN_VARIANTS = (
    (4, 32, 2, 8),
    (8, 32, 2, 8),
    (8, 32, 1, 8),
    (4, 32, 4, 8),
    (8, 32, 4, 8),
    (8, 32, 2, 16),
    (4, 32, 2, 8, 4),
)
BAD_REL = 5e-3  # relative L2 above this is flagged "!"
NS = (1, 4)


# -- here: builds ----------------------------------------------------------------------------------
def _kernels() -> tuple[dict, dict]:
    """(symbol key -> PrimFunc, key -> description) of every kernel the lab builds."""
    from dsv2_mlc.schedules import moe_decode_cuda as m
    from dsv2_mlc.schedules.tiles import DecodeTiles, GateUpTiles, tuned

    assert tuned("moe_decode_gate_up") == GateUpTiles(*GATE_UP_VARIANTS[0])
    assert tuned("moe_decode_down") == DecodeTiles(*DOWN_VARIANTS[0])
    funcs, info = {}, {}
    lite = m.MoeDecodeShape(**SHAPES["lite"])
    for v in GATE_UP_VARIANTS:
        tiles = GateUpTiles(*v)
        funcs[f"gu_lite_{tiles.name}"] = m.gate_up_decode_kernel(lite, tiles)
        info[f"gu_lite_{tiles.name}"] = {"shape": "lite", "kind": "gate_up", "tiles": v}
    for v in DOWN_VARIANTS:
        tiles = DecodeTiles(*v)
        funcs[f"dn_lite_{tiles.name}"] = m.down_decode_kernel(lite, tiles)
        info[f"dn_lite_{tiles.name}"] = {"shape": "lite", "kind": "down", "tiles": v}
    v2 = m.MoeDecodeShape(**SHAPES["v2"])
    assert tuned("moe_decode_gate_up", shape=(v2.hidden,)) == GateUpTiles(*V2_GATE_UP_VARIANTS[0])
    assert tuned("moe_decode_down", shape=(v2.hidden,)) == DecodeTiles(*V2_DOWN_VARIANTS[0])
    for v in V2_GATE_UP_VARIANTS:
        tiles = GateUpTiles(*v)
        funcs[f"gu_v2_{tiles.name}"] = m.gate_up_decode_kernel(v2, tiles)
        info[f"gu_v2_{tiles.name}"] = {"shape": "v2", "kind": "gate_up", "tiles": v}
    for v in V2_DOWN_VARIANTS:
        tiles = DecodeTiles(*v)
        funcs[f"dn_v2_{tiles.name}"] = m.down_decode_kernel(v2, tiles)
        info[f"dn_v2_{tiles.name}"] = {"shape": "v2", "kind": "down", "tiles": v}
    return funcs, info


def prepare(args: argparse.Namespace) -> int:
    """Compile every kernel for CUDA into build/lab_moe_decode (no GPU needed)."""
    from dsv2_mlc.compiler.cuda import make_cuda_target

    target = make_cuda_target(args.arch)
    lab_dir = Path(args.lab_dir)
    lab_common.fresh_lab_dir(lab_dir, "moed_*.so")
    funcs, info = _kernels()
    if args.only:
        keep = set(args.only.split(","))
        if keep - set(funcs):
            raise SystemExit(f"no such kernels: {sorted(keep - set(funcs))}")
        funcs = {k: v for k, v in funcs.items() if k in keep}
    built = lab_common.build_libraries(funcs, lab_dir, "moed", args.arch, target, {}, "")
    for key, entry in built.items():
        entry["kwargs"] = info[key]
    manifest = {**lab_common.manifest_header(args.arch), "shapes": SHAPES, "kernels": built}
    lab_common.write_manifest(lab_dir, manifest)
    return 0


# -- there: measurement ----------------------------------------------------------------------------
def _data(torch, shape: dict, n: int, seed: int) -> dict:
    """Random INT4 experts (int32 words, fp16 scales sized for O(1) outputs), x, logits."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    H, NI, IS, E, G = (shape[k] for k in ("hidden", "inter", "shared_inter", "experts", "group"))

    def packed(*dims):
        r = torch.randint(-(2**31), 2**31 - 1, dims, generator=gen, device="cuda")
        return r.to(torch.int32)

    def scales(*dims, fan_in: int):
        u = torch.rand(*dims, generator=gen, device="cuda")
        return ((0.5 + u) / (4.6 * fan_in**0.5)).to(torch.float16)

    return {
        "x": torch.randn(n, H, generator=gen, device="cuda").to(torch.float16),
        "logits": torch.randn(n, E, generator=gen, device="cuda"),
        "gu_w": packed(E, 2 * NI, H // 8),
        "gu_s": scales(E, 2 * NI, H // G, fan_in=H),
        "sgu_w": packed(2 * IS, H // 8),
        "sgu_s": scales(2 * IS, H // G, fan_in=H),
        "dn_w": packed(E, H, NI // 8),
        "dn_s": scales(E, H, NI // G, fan_in=NI),
        "sdn_w": packed(H, IS // 8),
        "sdn_s": scales(H, IS // G, fan_in=IS),
    }


def _dequant(torch, words, scale, group: int):
    """float32 [..., K] of INT4 words [..., K/8] (int32) and scales [..., K/group]."""
    shifts = torch.arange(8, device=words.device, dtype=torch.int32) * 4
    q = ((words.unsqueeze(-1) >> shifts) & 15).reshape(*words.shape[:-1], -1).float() - 8.0
    return q * scale.float().repeat_interleave(group, dim=-1)


def _route(torch, logits, shape: dict):
    """(weights, ids) of the DeepSeek-V2 router in float32 (moe_routing's semantics)."""
    p = torch.softmax(logits.float(), dim=-1)
    k, groups = shape["top_k"], shape.get("n_group", 1)
    if groups > 1 and shape["topk_group"] < groups:
        g = p.view(p.shape[0], groups, -1).max(dim=-1).values
        keep = torch.zeros_like(g).scatter_(1, g.topk(shape["topk_group"], dim=-1).indices, 1.0)
        p = p * keep.repeat_interleave(p.shape[1] // groups, dim=1)
    w, ids = p.topk(k, dim=-1)
    if shape.get("norm_topk_prob") and k > 1:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        w = w * shape.get("routed_scaling_factor", 1.0)
    return w, ids.to(torch.int32)


def _reference(torch, d: dict, shape: dict) -> dict:
    """h [n, K I + Is], weights, ids and out [n, H] in float32."""
    G, NI = shape["group"], shape["inter"]
    w, ids = _route(torch, d["logits"], shape)
    x = d["x"].float()
    hs, outs = [], []
    sgu = _dequant(torch, d["sgu_w"], d["sgu_s"], G)
    sdn = _dequant(torch, d["sdn_w"], d["sdn_s"], G)
    for t in range(x.shape[0]):
        parts, out = [], torch.zeros(shape["hidden"], device="cuda")
        for j, e in enumerate(ids[t].tolist()):
            gu = _dequant(torch, d["gu_w"][e], d["gu_s"][e], G) @ x[t]
            h = torch.nn.functional.silu(gu[:NI]) * gu[NI:]
            parts.append(h)
            out += w[t, j] * (_dequant(torch, d["dn_w"][e], d["dn_s"][e], G) @ h.half().float())
        s = sgu @ x[t]
        h_s = torch.nn.functional.silu(s[: s.shape[0] // 2]) * s[s.shape[0] // 2 :]
        parts.append(h_s)
        out += sdn @ h_s.half().float()
        hs.append(torch.cat(parts))
        outs.append(out)
    return {"h": torch.stack(hs), "weights": w, "ids": ids, "out": torch.stack(outs)}


def _rel(torch, a, b) -> float:
    return float(torch.linalg.norm(a.float() - b.float()) / torch.linalg.norm(b.float()))


def _weight_bytes(shape: dict, n: int) -> dict:
    """Bytes of weights + scales a call reads (distinct experts counted once per token)."""
    H, NI, IS, K, G = (shape[k] for k in ("hidden", "inter", "shared_inter", "top_k", "group"))
    per_routed = 2 * NI * H // 2 + 2 * NI * H // G * 2, H * NI // 2 + H * NI // G * 2
    shared = 2 * IS * H // 2 + 2 * IS * H // G * 2, H * IS // 2 + H * IS // G * 2
    gate_up, down = n * K * per_routed[0] + shared[0], n * K * per_routed[1] + shared[1]
    return {"gate_up": gate_up, "down": down}


def run(args: argparse.Namespace) -> int:
    """Check and time every kernel of the manifest on the GPU (see the module docstring)."""
    import torch

    lab_dir = Path(args.lab_dir)
    manifest = lab_common.read_manifest(lab_dir)
    kernels = lab_common.load_kernels(args.lib_dir, lab_dir, args.only)
    ffi = lab_common.ffi_tensors
    u32 = torch.uint32
    rows = []
    for shape_name, shape in manifest["shapes"].items():
        for n in NS:
            d = _data(torch, shape, n, seed=n)
            ref = _reference(torch, d, shape)
            nbytes = _weight_bytes(shape, n)
            total = shape["top_k"] * shape["inter"] + shape["shared_inter"]
            for key, fn in kernels.items():
                k = manifest["kernels"][key]["kwargs"]
                if k["shape"] != shape_name:
                    continue
                if k["kind"] == "gate_up":
                    h = torch.empty(n, total, dtype=torch.float16, device="cuda")
                    w = torch.empty(n, shape["top_k"], device="cuda")
                    ids = torch.empty(n, shape["top_k"], dtype=torch.int32, device="cuda")
                    call = ffi(d["x"], d["logits"], d["gu_w"].view(u32), d["gu_s"],
                               d["sgu_w"].view(u32), d["sgu_s"], h, w, ids)  # fmt: skip
                    fn(*call)
                    torch.cuda.synchronize()
                    errs = {
                        "ids_equal": bool(torch.equal(ids, ref["ids"])),
                        "weights_max_abs": float((w - ref["weights"]).abs().max()),
                        "rel_l2": _rel(torch, h, ref["h"]),
                    }
                    ok = errs["ids_equal"] and errs["rel_l2"] < BAD_REL
                else:
                    out = torch.empty(n, shape["hidden"], dtype=torch.float16, device="cuda")
                    routing = (ref["weights"].contiguous(), ref["ids"])
                    call = ffi(ref["h"].half(), *routing,
                               d["dn_w"].view(u32), d["dn_s"], d["sdn_w"].view(u32), d["sdn_s"],
                               out)  # fmt: skip
                    fn(*call)
                    torch.cuda.synchronize()
                    errs = {"rel_l2": _rel(torch, out, ref["out"])}
                    ok = errs["rel_l2"] < BAD_REL
                sec = lab_common.time_call(torch, fn, call, args.budget_per_case_s)
                gbs = nbytes[k["kind"]] / sec / 1e9
                rows.append({"shape": shape_name, "n": n, "kernel": key, "us": sec * 1e6,
                             "GB/s": gbs, "ok": ok, **errs})  # fmt: skip
                flag = "" if ok else "  !"
                print(f"{shape_name:5} n={n} {key:28} {sec * 1e6:8.2f} us {gbs:7.0f} GB/s "
                      f"rel {errs['rel_l2']:.2e}{flag}", flush=True)  # fmt: skip
    result = {"manifest": manifest, "device": torch.cuda.get_device_name(), "rows": rows,
              "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z")}  # fmt: skip
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "moe_decode_lab.json").write_text(json.dumps(result, indent=1))
    bad = [r["kernel"] for r in rows if not r["ok"]]
    return lab_common.verdict(bad)


def main() -> int:
    parser, p, r = lab_common.lab_parser(
        __doc__, "compile the kernels here", "check and time them on the GPU", LAB_DIR
    )
    for sub in (p, r):
        sub.add_argument("--only", default=None, help="comma-separated kernel keys")
    r.add_argument("--budget-per-case-s", type=float, default=0.3)
    args = parser.parse_args()
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
