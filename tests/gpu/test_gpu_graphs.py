"""Decode from CUDA graphs, moved graphs and PDL edges against eager steps, on the V2-Lite build.

The kernels are the same and deterministic, so a graph replay must give the eager step's logits
bit for bit: scripts/gpu_graph_check.py (one sequence across graph keys, ``popn``, a fork, two
sequences, the device greedy graphs and launched greedy steps), scripts/gpu_graph_moves.py (the
graphs moved to new page buckets instead of captured, against an engine without graphs) and
scripts/gpu_pdl_check.py (the decode graphs with ``off``, ``programmatic`` and
``launch-completion`` kernel edges, and back-to-back replays of one of them).
"""

from __future__ import annotations

import pytest
from lane_helpers import script

pytestmark = pytest.mark.gpu


def test_graph_replays_equal_eager_steps(v2_lite, lib_dir):
    check = script("gpu_graph_check")
    report = check.run_checks(str(v2_lite.path), lib_dir, seed=0)
    assert not check.failures(report), report
    assert report["graph_totals"]["replays"] > 0


def test_moved_graphs_decode_the_eager_tokens(v2_lite, lib_dir):
    moves = script("gpu_graph_moves")
    res = moves.moves_against_eager(str(v2_lite.path), lib_dir, seed=0, base=4096, gen_len=256)
    stats = res["graph_stats"]
    summary = {k: v for k, v in res.items() if k not in ("tokens", "eager_tokens")}
    assert res["moves"] > 0, f"no graph moved to a new page bucket: {summary}"
    assert stats["relocation_failures"] == 0 and stats["mismatches"] == 0, summary
    same = [a == b for a, b in zip(res["tokens"], res["eager_tokens"], strict=True)]
    assert all(same), f"first differing step {same.index(False)} of {len(same)}: {summary}"


def test_pdl_graphs_equal_eager_steps(v2_lite, lib_dir):
    assert v2_lite.pdl, "the lane's V2-Lite build is compiled with --pdl (the CUDA default)"
    pdl = script("gpu_pdl_check")
    report = pdl.run_pdl_check(str(v2_lite.path), lib_dir, seed=0, prompt_len=500, steps=200,
                               replays=200, checked_replays=20)  # fmt: skip
    assert set(report["variants"]) == set(pdl.GRAPH_VARIANTS)
    assert not pdl.failures(report), report
    for variant in ("programmatic", "launch-completion"):
        assert report["variants"][variant]["graphs"]["pdl_edges"] > 0
