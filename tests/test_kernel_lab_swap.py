"""The swap MoE kernel lab (``schedules/lab/kernel_lab_swap.py``), no GPU: every variant it lists
builds (its source edits apply to today's kernel body), the floors and the ``wait1f`` variant
carry their edits, and the variants the lab checks against torch are the ones not wrong on
purpose. Lab only (``-m lab``)."""

from __future__ import annotations

import pytest
from scripts_module import load_script

pytestmark = pytest.mark.lab
LAB = load_script("kernel_lab_swap")


def test_every_variant_builds_with_its_edits() -> None:
    funcs, info = LAB._kernels()
    assert len(funcs) == sum(len(kinds.split(",")) for kinds, *_ in LAB.VARIANTS)
    for key, func in funcs.items():
        script = func.script()
        assert "moe_swap_" in script, key
        floor = info[key]["floor"]
        if floor == "wait1f":
            assert "wgmma.wait_group.sync.aligned 1" in script, key
            assert "(a[(q & 1) ^ 1][hp][sl][r])" in script, key
        if floor == "nold":
            assert "make_uint2(kt, hp + m)" in script, key
    assert set(LAB.WRONG_ON_PURPOSE) < set(LAB.FLOORS)
    assert "wait1f" not in LAB.WRONG_ON_PURPOSE  # checked against torch like the table's tiles
