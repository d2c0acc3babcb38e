"""The lab's tile-variant build (schedules/lab/tile_variant_build.py): its overrides reach the
kernel builders through ``tuned`` and the shipped table comes back unchanged."""

from __future__ import annotations

import pytest

from dsv2_mlc.schedules import tiles

pytestmark = pytest.mark.lab


def test_overrides_apply_to_every_key_and_are_restored() -> None:
    from dsv2_mlc.schedules.lab.tile_variant_build import overridden, parse_override

    assert parse_override("moe_grouped_mma:warps_n=4,pair_from=None") == (
        "moe_grouped_mma",
        {"warps_n": 4, "pair_from": None},
    )
    # a string field (not a Python literal) stays a string
    assert parse_override("decode_gemm:moe=expert_major") == (
        "decode_gemm",
        {"moe": "expert_major"},
    )
    with pytest.raises(ValueError, match="KERNEL:FIELD=VALUE"):
        parse_override("mla_attention")
    shipped = {k: dict(v) for k, v in tiles.TABLE.items()}
    overrides = [parse_override("mla_attention:target_blocks=132")]
    with overridden(overrides) as applied:
        assert all(t.target_blocks == 132 for t in tiles.TABLE["mla_attention"].values())
        assert len(applied) == len(shipped["mla_attention"])
        assert tiles.tuned("mla_attention").target_blocks == 132
    assert {k: dict(v) for k, v in tiles.TABLE.items()} == shipped
    # the expert-major MoE of batch_decode_gemm with plans of 256 tokens (issue 32's variant)
    variant = [
        parse_override("decode_gemm:moe=expert_major"),
        parse_override("moe_expert_mma_gate_up:tokens=256,chunk=16"),
        parse_override("moe_expert_mma_down:tokens=256"),
    ]
    with overridden(variant):
        assert tiles.tuned("decode_gemm").moe == "expert_major"
        assert tiles.tuned("moe_expert_mma_gate_up").tokens == 256
        assert tiles.tuned("moe_expert_mma_gate_up").chunk == 16
        assert tiles.tuned("moe_expert_mma_down").tokens == 256
    assert {k: dict(v) for k, v in tiles.TABLE.items()} == shipped
    with pytest.raises(KeyError, match="no tile table entry"), overridden([("nope", {})]):
        pass
