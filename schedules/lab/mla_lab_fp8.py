"""FP8 (e4m3) latent-cache inputs and launch arithmetic of the MLA kernel lab's ``--kv fp8``
mode (``kernel_lab_mla.py``), imported as a sibling module: the pages in the model's FP8
storage (:mod:`dsv2_mlc.schedules.kv_fp8`) with their dequantized rows, the split-KV kernel's
grid at a case from the builder's own formulas, the registers of a lab library's kernels (read
from its cubin) and the blocks an SM holds.

Torch is passed in by the callers; tvm is imported only by :func:`grid` (build box).
"""

from __future__ import annotations

import math
from pathlib import Path

HEADS, LATENT, ROPE, PAGE = 16, 512, 64, 16  # V2-Lite, the cache's page size
FP8_KV_SCALE = 0.5  # any scale measures the same; not 1.0, so that a scale mix-up shows
E4M3_MAX = 448.0
FP8_ROW_BYTES = LATENT + 2 * ROPE  # e4m3 latent, float16 rope
F16_ROW_BYTES = 2 * (LATENT + ROPE)
COLD_BYTES = 256 << 20  # page pool copies the cold timing rotates over: 5x the H200's L2
SM_SHARED, BLOCK_RESERVED = 233472, 1024  # sm_90: shared memory an SM, reserved a block


def e4m3_codes(torch, latent, kv_scale: float):
    """uint8 e4m3 codes of the float16 ``latent`` as the model's append writes them
    (``kv_fp8.quantize_latent``): ``x * float32(1 / kv_scale)`` saturated to +-448, rounded to
    nearest even (torch's float8_e4m3fn cast)."""
    inv = torch.tensor(1.0 / kv_scale, dtype=torch.float32, device=latent.device)
    xs = (latent.float() * inv).clamp(-E4M3_MAX, E4M3_MAX)
    return xs.to(torch.float8_e4m3fn).view(torch.uint8)


def fp8_rows(torch, n: int, gen, dev: str, kv_scale: float):
    """``n`` random cache rows: (slots [n, L/2 + R] float16 in kv_fp8's storage, the latent's
    e4m3 bytes then the rope values; their dequantized values [n, L + R] float32). The first
    row holds saturating and subnormal latent values."""
    lat = torch.randn(n, LATENT, generator=gen, device=dev) * 2.0
    if n:
        lat[0, :4] = torch.tensor([1000.0, -1000.0, 1e-3, -3e-3])
    lat = lat.to(torch.float16)
    rope = torch.randn(n, ROPE, generator=gen, device=dev).to(torch.float16)
    codes = e4m3_codes(torch, lat, kv_scale)
    slots = torch.cat([codes.view(torch.float16), rope], dim=1)
    deq = torch.cat([codes.view(torch.float8_e4m3fn).float() * kv_scale, rope.float()], dim=1)
    return slots, deq


def case8(torch, kv_lens: list[int], seed: int, kv_scale: float, dev: str = "cuda") -> dict:
    """Random decode inputs (one query row a sequence) over an FP8 cache in kv_fp8's storage:
    pages ``[num_pages, 16, L/2 + R]`` float16 slots (rows past a sequence's end NaN), ``q`` as
    ``2H`` pseudo-heads of ``L/2 + R`` (head ``h``'s ``L + R`` values first, the padding NaN),
    ``kv`` the dequantized rows per sequence for the reference."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    n_pages = [math.ceil(n / PAGE) for n in kv_lens]
    total_pages = max(sum(n_pages), 1)
    perm = torch.randperm(total_pages, generator=gen, device=dev).to(torch.int32)
    row = LATENT // 2 + ROPE
    pages = torch.full((total_pages * PAGE, row), math.nan, dtype=torch.float16, device=dev)
    kv, start = [], 0
    for n, np_ in zip(kv_lens, n_pages, strict=True):
        slots, deq = fp8_rows(torch, n, gen, dev, kv_scale)
        ids = perm[start : start + np_].long()
        at = (ids[:, None] * PAGE + torch.arange(PAGE, device=dev)[None, :]).reshape(-1)[:n]
        pages[at] = slots
        kv.append(deq)
        start += np_
    b = len(kv_lens)
    q = (torch.randn(b, HEADS, LATENT + ROPE, generator=gen, device=dev) * 0.5).to(torch.float16)
    q_pad = torch.full((b, HEADS, 2 * row), math.nan, dtype=torch.float16, device=dev)
    q_pad[:, :, : LATENT + ROPE] = q
    page_indptr = [0, *torch.tensor(n_pages).cumsum(0).tolist()]
    return {
        "q": q_pad.reshape(b, 2 * HEADS, row),
        "q_ref": q,
        "qo_indptr": torch.arange(b + 1, dtype=torch.int32, device=dev),
        "pages": pages.reshape(total_pages, PAGE, row),
        "page_indptr": torch.tensor(page_indptr, dtype=torch.int32, device=dev),
        "page_indices": perm[: sum(n_pages)].contiguous(),
        "length_info": torch.tensor(
            [(n - 1) % PAGE + 1 for n in kv_lens], dtype=torch.int32, device=dev
        ),
        "causal": 0,
        "sm_scale": 1.0 / math.sqrt(128 + 64),
        "kv_lens": kv_lens,
        "q_lens": [1] * b,
        "kv": kv,
        "out_width": LATENT // 2,
    }


def grid(tiles, kv_lens: list[int], pipe: bool = True) -> dict:
    """The launch of :func:`build_mla_attention` with ``tiles`` on decode rows of ``kv_lens``
    tokens, from the builder's own formulas (``max_splits``, ``split_pages``, ``row_pps``):
    splits the grid provides a row (``smax``), pages a split, splits used (= active split
    blocks), merge blocks, and the float32 workspace the active splits write (and the merge
    reads)."""
    from dsv2_mlc.schedules.mla_attention_cuda import split_pages

    rows = len(kv_lens)
    smax = max(min(-(-tiles.target_blocks // rows), tiles.max_split), 1)
    g = tiles.pages_per_step if pipe else 1
    pps, used = [], []
    for n in kv_lens:
        vis = -(-n // PAGE)
        p = int(
            split_pages(
                vis, smax, tiles.min_pages_per_split, tiles.long_min_pages, tiles.long_pages
            )
        )
        p = -(-p // g) * g
        pps.append(p)
        used.append(max(-(-vis // p), 1))
    merge_cols = min(tiles.merge_cols, LATENT)
    return {
        "smax": smax,
        "grid_blocks": rows * smax * (HEADS // 16),
        "active_blocks": sum(used),
        "pages_per_split": pps,
        "splits_used": used,
        "merge_blocks": rows * HEADS * -(-LATENT // merge_cols),
        "ws_bytes": sum(u * HEADS * (LATENT + 1) * 4 for u in used if u > 1),
    }


def _cubin_attrs(e: bytes) -> dict[str, dict]:
    """``symbol -> {"regs", "frame_bytes"}`` of the CUDA ELF ``e`` (a cubin): the
    ``EIATTR_REGCOUNT`` (0x2f) and ``EIATTR_FRAME_SIZE`` (0x11) entries of its ``.nv.info``
    section (format ``EIFMT_SVAL``: symbol index, value)."""
    import struct

    (shoff,) = struct.unpack_from("<Q", e, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", e, 0x3A)
    # (name, type, flags, addr, offset, size, link, info, align, entsize)
    secs = [struct.unpack_from("<IIQQQQIIQQ", e, shoff + i * shentsize) for i in range(shnum)]

    def text(sec: tuple, off: int) -> str:
        raw = e[sec[4] + off : sec[4] + sec[5]]
        return raw[: raw.index(b"\0")].decode()

    symtab = next((s for s in secs if s[1] == 2), None)  # SHT_SYMTAB
    info = next((s for s in secs if text(secs[shstrndx], s[0]) == ".nv.info"), None)
    found: dict[str, dict] = {}
    if symtab is None or info is None:
        return found
    off, end = info[4], info[4] + info[5]
    while off + 4 <= end:
        fmt, attr = e[off], e[off + 1]
        size = int.from_bytes(e[off + 2 : off + 4], "little")
        if fmt == 4 and attr in (0x2F, 0x11) and size == 8:
            idx, val = struct.unpack_from("<II", e, off + 4)
            (name,) = struct.unpack_from("<I", e, symtab[4] + idx * 24)
            key = "regs" if attr == 0x2F else "frame_bytes"
            found.setdefault(text(secs[symtab[6]], name), {})[key] = val
        off += 4 + (size if fmt == 4 else 0)
    return found


def kernel_resources(path: Path) -> dict[str, dict]:
    """Registers a thread and stack frame bytes of each kernel of the CUDA cubins embedded in
    the library ``path`` (:func:`_cubin_attrs`), keyed by kernel symbol; ``{}`` if none."""
    import struct

    data = path.read_bytes()
    found: dict[str, dict] = {}
    start = data.find(b"\x7fELF")
    while start >= 0:
        e = data[start:]
        if len(e) > 64 and e[4] == 2 and int.from_bytes(e[18:20], "little") == 190:  # EM_CUDA
            try:
                found.update(_cubin_attrs(e))
            except (struct.error, ValueError, IndexError):  # not a cubin this parser reads
                pass
        start = data.find(b"\x7fELF", start + 4)
    return found


def occupancy(smem: int, regs: int | None) -> dict:
    """Split blocks an SM holds (256 threads): by shared memory (``smem`` + 1 KB reserved a
    block, 228 KB an SM), by registers (65536 an SM, a thread's count rounded up to 8) and by
    threads (2048 an SM)."""
    by_smem = SM_SHARED // (smem + BLOCK_RESERVED)
    by_regs = 65536 // (-(-regs // 8) * 8 * 256) if regs else None
    return {
        "blocks_per_sm_smem": by_smem,
        "blocks_per_sm_regs": by_regs,
        "blocks_per_sm": min(by_smem, by_regs or 8, 8),
    }


def pools(torch, c: dict) -> list:
    """Copies of the case's page pool, enough to pass ``COLD_BYTES`` (2 to 64): the cold timing
    calls rotate over them, so each call reads its pages from HBM, as a decode step's layers do
    (each has its own cache), not from the 50 MB L2 the previous call filled."""
    pool = c["pages"]
    n = min(64, max(2, math.ceil(COLD_BYTES / (pool.numel() * pool.element_size()))))
    return [pool] + [pool.clone() for _ in range(n - 1)]


def finite_float16(np):  # (numpy) -> every finite float16 value, as rows of LATENT
    x = np.arange(65536, dtype=np.uint16).view(np.float16)
    return x[np.isfinite(x)].reshape(-1, LATENT)


def codes_agree(torch, kv_scale: float) -> bool:
    """Whether the device's e4m3 cast (:func:`e4m3_codes`) gives the CPU's codes for every
    finite float16 latent value (the CPU's is the one ``selfcheck`` holds against the model's
    quantisation kernel)."""
    import numpy as np

    x = torch.from_numpy(finite_float16(np))
    return bool(
        (e4m3_codes(torch, x.cuda(), kv_scale).cpu() == e4m3_codes(torch, x, kv_scale)).all()
    )
