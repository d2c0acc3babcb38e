"""``dsv2-mlc bench --sweep`` on a tiny CPU build: every point benched, a JSON of them whose points
carry what a direct bench reports, and a PNG heatmap."""

from __future__ import annotations

import json
import struct

import pytest
from hf_reference import CONFIG_A

from dsv2_mlc.bench import BenchOptions, run_bench
from dsv2_mlc.bench_sweep import SUMMARY_KEYS, point_summary
from dsv2_mlc.cli import main


@pytest.fixture(scope="module")
def tiny(model_builds):
    return model_builds.get(CONFIG_A, "q4f32_g32", "cpu").out_dir


def test_sweep_writes_every_point_and_a_heatmap(tiny, tmp_path):
    pytest.importorskip("matplotlib")
    argv = ["bench", str(tiny), "--sweep", "--contexts", "40,72", "--batches", "2",
            "--gen-len", "4", "--warmup", "0", "--repeat", "1", "--prefill-chunk", "32",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert (sweep["contexts"], sweep["batches"]) == ([40, 72], [2])
    points = sweep["points"]
    assert [(p["context"], p["batch"], p["prompt_len"]) for p in points] == [
        (40, 2, 36),
        (72, 2, 68),
    ]
    # a point holds what a direct bench of the same shape reports, of the same types
    direct = point_summary(
        run_bench(
            BenchOptions(str(tiny), prompt_len=36, gen_len=4, batch=2, warmup=0, repeat=1),
            log=lambda _: None,
        )  # fmt: skip
    )
    for p in points:
        assert "error" not in p
        assert set(SUMMARY_KEYS) <= set(p)
        for key in SUMMARY_KEYS:
            assert type(p[key]) is type(direct[key]), key
            assert p[key] > 0, key
        assert p["tpot_ms_p99"] >= p["tpot_ms_p50"]
    png = (tmp_path / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 3 * height > 0  # three panels side by side


def test_sweep_records_a_point_that_does_not_fit(tiny, tmp_path):
    pytest.importorskip("matplotlib")
    argv = ["bench", str(tiny), "--sweep", "--contexts", "40,4000", "--batches", "1",
            "--gen-len", "4", "--warmup", "0", "--repeat", "1", "--gpu-memory", "18MiB",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    points = json.loads((tmp_path / "sweep.json").read_text())["points"]
    assert "error" not in points[0] and points[0]["memory_plan"]["total"] <= 18 * 2**20
    assert "MemoryBudgetError" in points[1]["error"] and "cannot hold" in points[1]["error"]
    assert (tmp_path / "sweep.png").stat().st_size > 0


@pytest.mark.parametrize("bad", ["4096,x", "0,8", ","])
def test_sweep_lists_are_checked(tiny, bad, capsys):
    assert main(["bench", str(tiny), "--sweep", "--contexts", bad]) == 2
    assert "--contexts takes comma-separated" in capsys.readouterr().err
