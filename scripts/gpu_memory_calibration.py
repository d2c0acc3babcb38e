"""Measure the memory planner's device constants (dsv2_mlc/runtime/memory_plan.py DEVICE_MEMORY).

``python3 scripts/gpu_memory_calibration.py BUILD --lib-dir TVM_LIB [--out FILE]`` on the GPU
machine (``PYTHONPATH`` with the runtime, ``tvm_ffi`` and the repository), BUILD a config-only
build (random weights, e.g. V2-Lite ``--random-weights --quantization q4f16_g128``). One process;
the device's used memory is read with ``cudaMemGetInfo`` (on a CPU build: the process's current
RSS, for a smoke run) before and after each step:

* **context**: the used memory at the first read, which creates the CUDA context (on a device
  nobody else uses: the context alone);
* **prefill**, per chunk of ``--chunks`` (1K, 2K, 4K, 8K): a fresh engine (no CUDA graphs,
  ``prefill_chunk_size`` the chunk, a KV cache of two chunks) loaded, then one sequence of two
  chunks prefilled (a prefill and an extend); ``load`` is the growth over the load, less the
  weights and the KV pool the planner counts (the library's kernels, cuBLAS, the KV cache's
  auxiliary arrays); ``workspace`` the growth over the prefill. TVM's pooled allocator is
  cleared between points, so each point's figures are its own;
* **decode**, per batch of ``--batches`` (1, 8, 31): an engine of 31 sequences, prompts of 64
  tokens, 16 greedy steps; its growth over the load, with and without CUDA graphs.

The fit: ``workspace = fixed + per_token x chunk`` (least squares over the prefill points). The
JSON's ``device_memory`` holds the values for the table: ``runtime_overhead`` (context + the
median load overhead), ``workspace_fixed`` (the fit's intercept less one sequence's logits, which
the planner counts apart), ``workspace_scale`` (the fitted per-token bytes over the planner's
analytic estimate) and ``cuda_graphs`` (the batch-31 decode growth with graphs less without).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv2_mlc.layout import BuildConfig  # noqa: E402
from dsv2_mlc.runtime.memory_plan import ModelMemory, kv_pool_bytes  # noqa: E402


class Memory:
    """The device's used bytes (``cudaMemGetInfo``), or the process's RSS on a CPU build."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.cuda = None
        if device == "cuda":
            from dsv2_mlc.runtime.cudart import CudaRuntime

            self.cuda = CudaRuntime()

    def used(self) -> int:
        if self.cuda is not None:
            self.sync()
            got = self.cuda.memory_used()
            if got is None:
                raise RuntimeError("cudaMemGetInfo failed")
            return got[0]
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def sync(self) -> None:
        if self.device == "cuda":
            import tvm_ffi

            from dsv2_mlc.runtime.tvm_runtime import global_func

            global_func("runtime.Device_StreamSync")(tvm_ffi.device("cuda", 0), 0)


def release() -> None:
    """Drop unreferenced engines and free the buffers TVM's pooled allocator caches."""
    from dsv2_mlc.runtime.tvm_runtime import global_func

    gc.collect()
    global_func("vm.builtin.memory_manager.clear")()


def prefill_point(build: Path, chunk: int, seed: int, mem: Memory, model: ModelMemory) -> dict:
    from dsv2_mlc.runtime.engine import Engine

    release()
    base = mem.used()
    engine = Engine(build, context_window=2 * chunk, max_batch_size=1, kv_capacity=2 * chunk,
                    prefill_chunk_size=chunk, random_weights=seed, cuda_graph=False)  # fmt: skip
    loaded = mem.used()
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, engine.config.vocab_size, 2 * chunk).tolist()
    seq = engine.add_sequence()
    t0 = time.perf_counter()
    engine.prefill([seq], [tokens])
    seconds = time.perf_counter() - t0
    peak = mem.used()
    weights = model.resident_bytes + model.routed_expert_bytes
    kv = kv_pool_bytes(model, 2 * chunk, 1)
    del engine
    release()
    return {
        "chunk": chunk,
        "load_bytes": loaded - base,
        "weights_bytes": weights,
        "kv_pool_bytes": kv,
        "load_overhead_bytes": loaded - base - weights - kv,
        "workspace_bytes": peak - loaded,
        "prefill_s": seconds,
    }


def decode_points(
    build: Path, batches: list[int], seed: int, mem: Memory, graphs: bool
) -> dict[str, Any]:
    from dsv2_mlc.runtime.engine import Engine

    release()
    top = max(batches)
    engine = Engine(build, context_window=256, max_batch_size=top, kv_capacity=top * 256,
                    prefill_chunk_size=64 * top, random_weights=seed,
                    cuda_graph=graphs)  # fmt: skip
    loaded = mem.used()
    rng = np.random.default_rng(seed)
    rows = []
    for batch in sorted(batches):
        seqs = [engine.add_sequence() for _ in range(batch)]
        prompts = rng.integers(0, engine.config.vocab_size, (batch, 64)).tolist()
        logits = engine.prefill(seqs, prompts)
        tokens = [int(np.argmax(row)) for row in logits]
        for _ in range(16):
            tokens = engine.launch_greedy(seqs, tokens, next_step=False).result().tolist()
        rows.append({"batch": batch, "growth_over_load_bytes": mem.used() - loaded})
        for s in seqs:
            engine.remove_sequence(s)
    stats = engine.cuda_graph_stats
    del engine
    release()
    return {"cuda_graph": graphs, "graph_stats": stats, "points": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build", help="a config-only build (random weights)")
    parser.add_argument("--lib-dir", default=None, help="folder of libtvm_runtime*.so")
    parser.add_argument("--chunks", default="1024,2048,4096,8192", help="prefill chunks")
    parser.add_argument("--batches", default="1,8,31", help="decode batches")
    parser.add_argument("--seed", type=int, default=0, help="random weights and prompts")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args(argv)

    from dsv2_mlc.runtime.tvm_runtime import load_runtime

    build = Path(args.build)
    config = BuildConfig.read(build)
    load_runtime(config.device, args.lib_dir)
    mem = Memory(config.device)
    context = mem.used()  # the first read creates the CUDA context
    model = ModelMemory.from_build(build, config)
    chunks = [int(c) for c in args.chunks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]

    prefill = [prefill_point(build, c, args.seed, mem, model) for c in chunks]
    slope, intercept = np.polyfit([p["chunk"] for p in prefill],
                                  [p["workspace_bytes"] for p in prefill], 1)  # fmt: skip
    eager = decode_points(build, batches, args.seed, mem, graphs=False)
    graphs = decode_points(build, batches, args.seed, mem, graphs=config.device == "cuda")
    load_overhead = float(np.median([p["load_overhead_bytes"] for p in prefill]))
    graph_bytes = (
        graphs["points"][-1]["growth_over_load_bytes"]
        - eager["points"][-1]["growth_over_load_bytes"]
    )
    result = {
        "build": str(build.resolve()),
        "device": config.device,
        "quantization": config.quantization,
        "kv_dtype": config.cache_dtype,
        "context_bytes": context,
        "prefill": prefill,
        "decode_eager": eager,
        "decode_graphs": graphs,
        "fit": {
            "workspace_fixed_bytes": float(intercept),
            "workspace_per_token_bytes": float(slope),
            "analytic_workspace_per_token_bytes": model.workspace_per_token,
        },
        "device_memory": {
            "runtime_overhead": int(context + load_overhead),
            "workspace_fixed": int(max(intercept - model.logits_bytes_per_sequence, 0)),
            "workspace_scale": round(float(slope) / model.workspace_per_token, 3),
            "cuda_graphs": int(max(graph_bytes, 0)),
            "source": f"measured by scripts/gpu_memory_calibration.py on {config.quantization}",
        },
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
