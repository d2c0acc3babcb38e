"""``dsv2-mlc bench --sweep``: one benchmark per (context, batch) point, a JSON of every point and
a PNG heatmap of them.

Each point is a :func:`dsv2_mlc.bench.run_bench` of ``batch`` sequences whose prompt and
generation fill ``context`` tokens (prompt ``context - gen_len``), on an engine of its own. The
prompt goes in prefill chunks (``--prefill-chunk``, default :data:`SWEEP_PREFILL_CHUNK`; with
``--gpu-memory`` the memory plan picks them), so a point's workspace stays bounded at any context.
Between points the engine is dropped and TVM's pooled allocator releases its cached buffers, so
each point's peak memory is its own (on CUDA: ``cudaMemGetInfo``; on the CPU the process's peak
RSS, which only grows). A point that fails (it does not fit the device or the budget) is
recorded with its error and the sweep goes on.

``sweep.json``: the options and, per point, TTFT, prefill and decode tok/s, TPOT p50 / p99 and
peak memory (:func:`point_summary` of the point's report). ``sweep.png``: three heatmaps,
context on x and batch on y, of TPOT p50, TPOT p99 and peak memory, each cell annotated.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .bench import BenchError, BenchOptions, run_bench

DEFAULT_CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
DEFAULT_BATCHES = (1, 8)
SWEEP_PREFILL_CHUNK = 8192  # tokens a prefill call takes at most (bounded memory)
JSON_NAME, PNG_NAME = "sweep.json", "sweep.png"
SUMMARY_KEYS = (
    "ttft_ms",
    "prefill_tok_s",
    "decode_tok_s",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "peak_memory_bytes",
)


def parse_ints(text: str, what: str) -> list[int]:
    """``"4096,8192"`` as positive ints (``what`` names the option in the error)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise BenchError(f"{what} takes comma-separated integers, e.g. 4096,8192 ({err})") from err
    if not values or any(v < 1 for v in values):
        raise BenchError(f"{what} takes comma-separated positive integers, got {text!r}")
    return values


def point_summary(report: dict[str, Any]) -> dict[str, Any]:
    """A point of the sweep from a :func:`run_bench` report: its :data:`SUMMARY_KEYS`."""
    prefill, decode, memory = report["prefill"], report["decode"], report["memory"]
    return {
        "ttft_ms": prefill["ttft_ms_median"],
        "prefill_tok_s": prefill["prefill_tok_s"],
        "decode_tok_s": decode["decode_tok_s"],
        "tpot_ms_p50": decode["tpot_ms_p50"],
        "tpot_ms_p99": decode["tpot_ms_p99"],
        "peak_memory_bytes": memory.get("peak_bytes"),
    }


def _release_pool() -> None:
    """Drop the last engine and free the buffers TVM's pooled allocator keeps for reuse."""
    gc.collect()
    try:
        from .runtime.tvm_runtime import global_func

        global_func("vm.builtin.memory_manager.clear")()
    except Exception:  # noqa: BLE001 (a runtime without it: the pool stays; peaks then add up)
        pass


def run_sweep(
    opts: BenchOptions,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    batches: Sequence[int] = DEFAULT_BATCHES,
    out_dir: str | Path = ".",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Bench every (context, batch) point; write ``sweep.json`` and ``sweep.png`` into
    ``out_dir``; returns the sweep (what the JSON holds)."""
    _pyplot()  # a missing matplotlib fails before the first (long) point
    for context in contexts:
        if context <= opts.gen_len:
            raise BenchError(
                f"context {context} leaves no prompt before {opts.gen_len} generated tokens; "
                "use longer contexts or a smaller --gen-len"
            )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    points = []
    for batch in batches:
        for context in contexts:
            point_opts = dataclasses.replace(
                opts,
                prompt_len=context - opts.gen_len,
                batch=batch,
                prefill_chunk=opts.prefill_chunk
                or (None if opts.gpu_memory else SWEEP_PREFILL_CHUNK),
            )
            log(f"sweep: context {context}, batch {batch}")
            point: dict[str, Any] = {"context": context, "batch": batch}
            point.update(prompt_len=point_opts.prompt_len, gen_len=opts.gen_len)
            try:
                report = run_bench(point_opts, log=log)
            except Exception as err:  # noqa: BLE001 (out of memory, a budget refused: recorded)
                point["error"] = f"{type(err).__name__}: {err}"
                log(f"sweep: context {context}, batch {batch} failed: {point['error']}")
            else:
                point.update(point_summary(report))
                if "memory_plan" in report:
                    point["memory_plan"] = report["memory_plan"]
            points.append(point)
            report = None
            _release_pool()
    sweep = {
        "options": dataclasses.asdict(opts),
        "contexts": list(contexts),
        "batches": list(batches),
        "points": points,
    }
    (out / JSON_NAME).write_text(json.dumps(sweep, indent=1))
    plot_sweep(sweep, out / PNG_NAME)
    log(f"sweep: wrote {out / JSON_NAME} and {out / PNG_NAME}")
    return sweep


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise BenchError(
            "bench --sweep draws its heatmap with matplotlib; install it (pip install matplotlib)"
        ) from err
    return plt


def _grid(sweep: dict[str, Any], key: str) -> list[list[float]]:
    """``[batch][context]`` values of ``key`` (NaN where a point failed)."""
    at = {(p["context"], p["batch"]): p.get(key) for p in sweep["points"]}
    return [
        [math.nan if at.get((c, b)) is None else float(at[(c, b)]) for c in sweep["contexts"]]
        for b in sweep["batches"]
    ]


def _context_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def plot_sweep(sweep: dict[str, Any], path: str | Path) -> None:
    """The PNG of a sweep: TPOT p50, TPOT p99 (ms) and peak memory (GiB) over context x batch."""
    import numpy as np

    plt = _pyplot()
    peaks = [v for row in _grid(sweep, "peak_memory_bytes") for v in row if not math.isnan(v)]
    unit, size = ("GiB", 2**30) if max(peaks, default=0) >= 2**30 else ("MiB", 2**20)
    panels = [
        ("tpot_ms_p50", "TPOT p50 (ms)", 1.0, "{:.2f}"),
        ("tpot_ms_p99", "TPOT p99 (ms)", 1.0, "{:.2f}"),
        ("peak_memory_bytes", f"peak memory ({unit})", 1 / size, "{:.2f}"),
    ]
    contexts, batches = sweep["contexts"], sweep["batches"]
    width = max(4.0, 1.1 * len(contexts) + 1.5)
    fig, axes = plt.subplots(1, 3, figsize=(3 * width, 1.0 * len(batches) + 2.2))
    for ax, (key, title, scale, fmt) in zip(axes, panels, strict=True):
        grid = np.array(_grid(sweep, key)) * scale
        shown = np.ma.masked_invalid(grid)
        image = ax.imshow(shown, cmap="viridis", aspect="auto", origin="lower")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        ax.set_title(title)
        ax.set_xticks(range(len(contexts)), [_context_label(c) for c in contexts])
        ax.set_yticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("batch")
        finite = grid[np.isfinite(grid)]
        middle = float(finite.min() + finite.max()) / 2 if finite.size else 0.0
        for y in range(len(batches)):
            for x in range(len(contexts)):
                value = grid[y, x]
                text = "failed" if math.isnan(value) else fmt.format(value)
                color = "black" if not math.isnan(value) and value > middle else "white"
                ax.text(x, y, text, ha="center", va="center", fontsize=9, color=color)
    model = Path(sweep["options"]["model"]).name
    fig.suptitle(f"dsv2-mlc bench --sweep: {model}, {sweep['options']['gen_len']} new tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
