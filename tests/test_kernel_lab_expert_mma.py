"""The expert-major MoE kernel lab (``schedules/lab/kernel_lab_expert_mma.py``), no GPU: every
tile variant it lists is one the kernels take, ``prepare --only`` builds a library for sm_90 and
reads its registers, and the lab's ``run`` side (random routing, arguments, float32 reference,
bytes read) agrees with the kernels run under the CPU emulation. Lab only (``-m lab``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cuda_builds import needs_nvcc
from cuda_emulation import emulate, needs_toolchain
from scripts_module import load_script

from dsv2_mlc.schedules.moe_decode_cuda import MoeDecodeShape
from dsv2_mlc.schedules.moe_expert_mma_cuda import (
    down_expert_mma_kernel,
    expert_mma_unsupported,
    gate_up_expert_mma_kernel,
)
from dsv2_mlc.schedules.tiles import MmaTiles, tuned

pytestmark = pytest.mark.lab
LAB = load_script("kernel_lab_expert_mma")
SCRIPT = Path(__file__).resolve().parents[1] / "schedules" / "lab" / "kernel_lab_expert_mma.py"


def test_every_variant_is_one_the_kernels_take() -> None:
    lite = MoeDecodeShape(**LAB.SHAPES["lite"])
    for kind, variants in (("gate_up", LAB.GATE_UP_VARIANTS), ("down", LAB.DOWN_VARIANTS)):
        assert variants[0][0] == {}, "the table's tiles come first"
        base = tuned(f"moe_expert_mma_{kind}")
        names = set()
        for change, _ in variants:
            tiles = MmaTiles(**{**base.__dict__, **change})
            assert expert_mma_unsupported(lite, tiles) is None, (kind, change)
            names.add(tiles.name)
        assert len(names) == len(variants), f"{kind}: two variants with the same tiles"
    funcs, _ = LAB._kernels()  # nothing skipped, the V2 shape included
    assert len(funcs) == len(LAB.GATE_UP_VARIANTS) + len(LAB.DOWN_VARIANTS) + 2


@needs_nvcc
def test_prepare_only_builds_one_library(tmp_path: Path) -> None:
    key = f"gu_lite_{tuned('moe_expert_mma_gate_up').name}"
    cmd = [sys.executable, str(SCRIPT), "prepare", "--only", key, "--lab-dir", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    entry = json.loads((tmp_path / "manifest.json").read_text())["kernels"][key]
    assert (tmp_path / entry["library"]).stat().st_size == entry["bytes"]
    assert 16 <= entry["regs"] <= 255  # EIATTR_REGCOUNT found in the cubin
    assert entry["blocks_per_sm"] >= 1


# 8 experts of top-2 in 4 routing groups (2 kept), group 32; plans of 32 tokens, chunks of 16
SMALL = dict(hidden=256, inter=128, shared_inter=256, experts=8, top_k=2, group=32, n_group=4,
             topk_group=2)  # fmt: skip
TILES = MmaTiles(warps=4, blocks=5, rows=64, tokens=32, chunk=16)


@needs_toolchain
def test_run_side_agrees_with_the_emulated_kernels(tmp_path: Path, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(LAB, "DEVICE", "cpu")
    shape, n = MoeDecodeShape(**SMALL), 40  # two plan groups
    d = LAB._data(torch, SMALL, seed=0)
    x, ids = LAB._tokens(torch, SMALL, n, seed=1)
    idn = ids.numpy()
    assert all(len(set(row)) == 2 for row in idn), "distinct experts a token"
    assert all(len({e // 2 for e in row}) <= 2 for row in idn), "within topk_group groups"
    ref = LAB._reference(torch, d, SMALL, x, ids)

    def u32(t: torch.Tensor) -> np.ndarray:
        return t.numpy().view(np.uint32)

    h = np.full((n, shape.total), np.nan, np.float16)
    arrays = {"x": x.numpy(), "ids": idn, "w": u32(d["gu_w"]), "s": d["gu_s"].numpy(),
              "sw": u32(d["sgu_w"]), "ss": d["sgu_s"].numpy(), "hout": h}  # fmt: skip
    emulate(gate_up_expert_mma_kernel(shape, TILES), tmp_path, "gate_up")(TILES.blocks, arrays, n)
    assert LAB._rel(torch, torch.from_numpy(h), ref["h"]) < LAB.BAD_REL
    part = np.full((n, 3, shape.hidden), np.nan, np.float32)
    arrays = {"h": ref["h"].half().numpy(), "ids": idn, "w": u32(d["dn_w"]),
              "s": d["dn_s"].numpy(), "sw": u32(d["sdn_w"]), "ss": d["sdn_s"].numpy(),
              "part": part}  # fmt: skip
    emulate(down_expert_mma_kernel(shape, TILES), tmp_path, "down")(TILES.blocks, arrays, n)
    assert LAB._rel(torch, torch.from_numpy(part), ref["part"]) < LAB.BAD_REL
    # negative control: the reference of the slots swapped is far off
    swapped = LAB._reference(torch, d, SMALL, x, ids.flip(1).contiguous())
    assert LAB._rel(torch, torch.from_numpy(h), swapped["h"]) > 0.5
    # bytes read: a plan group's distinct experts, and the shared experts, once a group
    row_bytes = shape.hidden // 2 + shape.hidden // shape.group * 2
    distinct = len(set(idn[:32].ravel())) + len(set(idn[32:].ravel()))
    want = (distinct * 2 * shape.inter + 2 * 2 * shape.shared_inter) * row_bytes  # 2 groups
    assert LAB._weight_bytes(SMALL, ids, 32)["gate_up"] == want
