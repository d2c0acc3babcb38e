"""The chain view of ``scripts/gpu_kernel_profile.py --graph`` (per-kernel increments and gaps
of overlapping decode-graph kernels), on synthetic timelines; the profile itself needs a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from scripts_module import load_script


def _chain_table():
    return load_script("gpu_kernel_profile").chain_table


def _step(t0: float) -> list[tuple[str, float, float]]:
    # copy in; a starts; b starts before a ends (PDL) and ends after it; c ends inside b; a again
    return [
        ("Memcpy", t0, t0 + 2.0),
        ("a", t0 + 3.0, t0 + 7.0),
        ("b", t0 + 6.0, t0 + 12.0),
        ("c", t0 + 8.0, t0 + 10.0),
        ("a", t0 + 11.0, t0 + 15.0),
    ]


def test_increments_add_up_to_each_step_span() -> None:
    chain_table = _chain_table()
    events = _step(0.0) + _step(100.0) + _step(250.0)
    rng = np.random.default_rng(0)
    shuffled = [events[i] for i in rng.permutation(len(events))]  # profiler order is not time
    out = chain_table(shuffled, 3)
    assert out["activities_per_step"] == 5
    assert out["span_us"] == [15.0, 15.0, 15.0]
    rows = {r["kernel"]: r for r in out["rows"]}
    # increments: Memcpy 2 (first: its duration), a 7-2=5 then 15-12=3, b 12-7=5, c 0
    assert rows["Memcpy"]["increment_us_per"] == 2.0 and rows["Memcpy"]["mean_gap_us"] is None
    assert rows["a"]["calls_per"] == 2.0 and rows["a"]["increment_us_per"] == 8.0
    assert rows["a"]["mean_increment_us"] == 4.0 and rows["a"]["mean_us"] == 4.0
    assert rows["b"]["increment_us_per"] == 5.0 and rows["c"]["increment_us_per"] == 0.0
    # gaps: a after the copy +1, a after c +1 -> 1; b starts 1 before a ends; c 4 before b ends
    assert rows["a"]["mean_gap_us"] == 1.0
    assert rows["b"]["mean_gap_us"] == -1.0 and rows["c"]["mean_gap_us"] == -4.0
    assert sum(r["increment_us_per"] for r in out["rows"]) == 15.0
    assert [r["kernel"] for r in out["rows"]][0] == "a"  # largest increment first


def test_uneven_steps_are_refused() -> None:
    chain_table = _chain_table()
    with pytest.raises(ValueError, match="equal steps"):
        chain_table(_step(0.0) + _step(50.0)[:4], 2)
    with pytest.raises(ValueError, match="equal steps"):
        chain_table(_step(0.0), 0)
