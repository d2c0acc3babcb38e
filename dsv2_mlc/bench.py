"""``dsv2-mlc bench``: prefill and decode speed of a compiled model, against the HBM roofline and,
optionally, Hugging Face transformers on the same weights in the same run.

What is measured (all wall-clock on the host, each model call synchronised: the VM returns once
its kernels are *enqueued*, and the copy of the logits to the host waits for them; the
``sync_check`` section measures both halves of one decode step to show it):

* **prefill**: ``batch`` fresh sequences of ``prompt_len`` random token ids in one call (with
  ``mixed_lengths`` each sequence's length drawn from ``[prompt_len / 8, prompt_len]``, so the
  decode steps hold sequences of different lengths); TTFT = prefill call + host arg-max of the
  first token; prefill tok/s = prompt tokens / prefill call. ``prefill_chunk`` (default: the
  engine's ``prefill_chunk_size``, 8,192 tokens on CUDA, so the activations of a long prompt
  stay bounded as in serving) bounds the tokens of one model call: longer prompts go in
  chunks, the first a prefill and the rest extends attending to the cached prefix, as
  ``Engine.prefill`` does for any prompt; a chunk as large as the prompt gives one call.
* **decode**: ``gen_len - 1`` greedy steps of one token per sequence: a step is
  ``Engine.launch_greedy`` and the wait for its tokens (ids in, the arg-max picked on the
  device, one int per sequence copied out; ``argmax_on_device``; the KV cache's bookkeeping of
  the next step runs on the host while a CUDA graph replays this one). A build without the
  device arg-max (compiled before it) copies the float32 logits ``[batch, vocab]`` out and
  takes the arg-max on the host, timed in the loop (``host_argmax_us_in_loop``, None on the
  device). ``host_argmax_us``: the host arg-max alone over such logits, what the device arg-max
  saves. decode tok/s = batch * steps / their total; TPOT p50/p99 over the steps. The timed
  runs follow the warm-up, so on CUDA every step replays a graph; ``first_run`` is the first
  warm-up run's decode, which captures (and checks against an eager step) the graph of each new
  key on the way, as a fresh process's first generation does (from the fourth key on a graph
  is moved instead: :mod:`dsv2_mlc.runtime.graph_relocation`).
* **roofline**: bytes a decode step must read (:func:`decode_bytes`: every non-expert weight,
  the expected distinct routed experts of each MoE layer, one embedding row per token, lm_head,
  and the latent KV cache of every sequence at its mean context) over the mean step time gives
  the achieved GB/s and its share of ``hbm_bandwidth``; ``roofline_tok_s`` is the ceiling.
* **memory**: on CUDA the device's used memory from ``cudaMemGetInfo`` (libcudart via ctypes),
  sampled after loading and after every call: the peak, and the peak minus the used memory
  before the model was loaded; the engine's allocator pools and never frees, so the last sample
  is the high-water mark. On the CPU the process's peak RSS (``ru_maxrss``).
* **profile** (``--profile``): the VM's instrument hook with a device sync before and after
  every VM call (kernels, KV-cache builtins): time per call name over one prefill and a few
  decode steps. Each call is charged its launch and one sync, so small kernels are inflated.
* **hf** (``--compare-hf``): transformers' ``DeepseekV2ForCausalLM`` built from the config on
  the same device, holding this model's weights (dequantised, :func:`dsv2_mlc.hf_export.
  load_into_hf`), timed the same way (prefill, then ``hf_decode_tokens`` greedy steps on its
  cache); the ratios ours / HF, and how far the first-token logits are apart.
"""

from __future__ import annotations

import json
import math
import platform
import resource
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import UsageError

DEFAULT_HBM_BANDWIDTH = 4.8e12  # H200 datasheet, bytes/s


class BenchError(UsageError):
    """A benchmark request that cannot run (the message says why)."""


@dataclass(frozen=True)
class BenchOptions:
    """What ``dsv2-mlc bench`` runs (see the module docstring)."""

    model: str
    prompt_len: int = 512
    gen_len: int = 128
    batch: int = 1
    warmup: int = 1
    repeat: int = 3
    seed: int = 0
    hbm_bandwidth: float = DEFAULT_HBM_BANDWIDTH
    profile: bool = False
    profile_steps: int = 8
    compare_hf: bool = False
    hf_dtype: str = "bfloat16"
    hf_attn: str = "eager"
    hf_decode_tokens: int = 32
    lib_dir: str | None = None
    cuda_graph: bool = True
    prefill_chunk: int | None = None
    expert_major_from: int | None = None  # None: the engine's default
    gemm_decode_from: int | None = None  # None: the engine's default
    swap_decode_from: int | None = None  # None: the engine's default
    mixed_lengths: bool = False  # prompt lengths drawn from [prompt_len / 8, prompt_len]
    token_major: bool = False  # every decode step on the fused per-token MoE kernels
    verify: bool = False  # hash the weight files too before loading them
    experts: str | None = None  # "gpu" or "host" (Engine(experts=...)); None: gpu or the plan
    gpu_memory: str | int | None = None  # plan inside this budget (runtime/memory_plan.py)

    def check(self) -> None:
        """Raise :class:`BenchError` for impossible values."""
        for name in ("prompt_len", "gen_len", "batch", "repeat"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be at least 1")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise BenchError("--prefill-chunk must be at least 1 token")
        if self.warmup < 0 or self.profile_steps < 1 or self.hf_decode_tokens < 1:
            raise BenchError("--warmup must be >= 0; profile steps and HF tokens >= 1")
        if self.hbm_bandwidth <= 0:
            raise BenchError("--hbm-bandwidth must be positive (bytes/s)")
        if self.expert_major_from is not None and self.expert_major_from < 1:
            raise BenchError("--expert-major-from must be at least 1 sequence")
        if self.gemm_decode_from is not None and self.gemm_decode_from < 1:
            raise BenchError("--gemm-decode-from must be at least 1 sequence")
        if self.swap_decode_from is not None and self.swap_decode_from < 1:
            raise BenchError("--swap-decode-from must be at least 1 sequence")
        if self.mixed_lengths and self.compare_hf:
            raise BenchError("--compare-hf takes prompts of one length: drop --mixed-lengths")
        if self.experts not in (None, "gpu", "host"):
            raise BenchError(f"--experts {self.experts}: use gpu or host")


# -- memory ----------------------------------------------------------------------------------------
def _cuda_runtime() -> Any:  # CudaRuntime | None
    """``cudaMemGetInfo`` through the libcudart the TVM CUDA runtime loaded (None: not found)."""
    from .runtime.cudart import CudaRuntime

    try:
        return CudaRuntime()
    except RuntimeError:
        return None


class _MemoryTracker:
    def __init__(self, device: str):
        self.device = device
        self.cuda = _cuda_runtime() if device == "cuda" else None
        self.baseline: int | None = None
        self.peak = 0
        self.total: int | None = None

    def sample(self) -> None:
        if self.cuda is not None:
            got = self.cuda.memory_used()
            if got is not None:
                used, self.total = got
                if self.baseline is None:
                    self.baseline = used
                self.peak = max(self.peak, used)

    def report(self) -> dict[str, Any]:
        if self.device == "cuda":
            return {
                "source": "cudaMemGetInfo (device used memory, sampled after every call)",
                "peak_bytes": self.peak or None,
                "before_load_bytes": self.baseline,
                "peak_minus_before_load_bytes": (
                    None if self.baseline is None else self.peak - self.baseline
                ),
                "device_total_bytes": self.total,
            }
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"source": "ru_maxrss (host process peak RSS)", "peak_bytes": rss}


# -- bytes and FLOPs -------------------------------------------------------------------------------
def _nbytes(tensor: Any) -> int:
    return math.prod(int(s) for s in tensor.shape) * np.dtype(str(tensor.dtype)).itemsize


def _nweights(name: str, tensor: Any) -> int:
    """Model weights a parameter holds (8 per INT4 word; scales hold none)."""
    n = math.prod(int(s) for s in tensor.shape)
    if name.endswith("q_scale"):
        return 0
    return 8 * n if name.endswith("q_weight") else n


def weight_stats(named: list[tuple[str, Any]], cfg: Any) -> dict[str, float]:
    """Bytes and weight counts of a model's parameters, split as a decode step reads them."""
    stats = {k: 0.0 for k in ("dense", "experts", "embedding", "total")}
    counts = {k: 0.0 for k in stats}
    for name, tensor in named:
        kind = (
            "experts"
            if ".mlp.experts." in name
            else "embedding"
            if name.startswith("model.embed_tokens.")
            else "dense"
        )
        stats[kind] += _nbytes(tensor)
        counts[kind] += _nweights(name, tensor)
        stats["total"] += _nbytes(tensor)
        counts["total"] += _nweights(name, tensor)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return {
        "param_bytes": stats["total"],
        "dense_bytes": stats["dense"],
        "routed_expert_bytes": stats["experts"],
        "embedding_bytes": stats["embedding"],
        "embedding_row_bytes": stats["embedding"] / cfg.vocab_size,
        "expert_bytes_each": stats["experts"] / max(moe_layers * cfg.n_routed_experts, 1),
        "moe_layers": moe_layers,
        "dense_weights": counts["dense"],
        "expert_weights_each": counts["experts"] / max(moe_layers * cfg.n_routed_experts, 1),
    }


def kv_bytes_per_token(cfg: Any, dtype: str, act_dtype: str = "float16") -> int:
    """Latent KV cache bytes per token of context (all layers) in the cache's ``dtype``; an
    FP8 cache keeps the rope part in the build's ``act_dtype``."""
    if dtype.startswith("float8"):
        rope = cfg.latent_dim - cfg.kv_lora_rank
        row = cfg.kv_lora_rank + rope * np.dtype(act_dtype).itemsize
    else:
        row = cfg.latent_dim * np.dtype(dtype).itemsize
    return cfg.num_hidden_layers * row


def expected_experts(n_experts: int, k: int, tokens: int) -> float:
    """Expected distinct experts that ``tokens`` tokens with uniform top-``k`` routing touch."""
    if n_experts == 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens)


def decode_bytes(
    ws: dict[str, float], cfg: Any, dtype: str, contexts: list[float], act_dtype: str = "float16"
) -> dict:
    """Bytes one decode step over sequences at ``contexts`` must read from device memory (the
    cache in ``dtype``, :func:`kv_bytes_per_token`)."""
    batch = len(contexts)
    experts = ws["moe_layers"] * expected_experts(
        cfg.n_routed_experts, cfg.num_experts_per_tok, batch
    )
    weights = ws["dense_bytes"] + experts * ws["expert_bytes_each"]
    weights += batch * ws["embedding_row_bytes"]
    kv = sum(contexts) * kv_bytes_per_token(cfg, dtype, act_dtype)
    return {"weight_bytes": weights, "kv_bytes": kv, "total_bytes": weights + kv}


def prefill_flops(ws: dict[str, float], cfg: Any, tokens: int, batch: int) -> float:
    """Approximate FLOPs of a causal prefill of ``batch`` x ``tokens`` (matmuls + attention)."""
    per_token = (
        ws["dense_weights"] + cfg.num_experts_per_tok * ws["moe_layers"] * ws["expert_weights_each"]
    )
    attn = cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    return batch * (2.0 * per_token * tokens + attn * tokens * tokens)


# -- timing helpers --------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device == "cuda":
        import tvm_ffi

        from .runtime.tvm_runtime import global_func

        global_func("runtime.Device_StreamSync")(tvm_ffi.device("cuda", 0), 0)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _host_argmax_us(batch: int, vocab: int, reps: int = 200) -> float:
    logits = np.random.default_rng(0).standard_normal((batch, vocab), dtype=np.float32)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        logits.argmax(-1)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def bench_prompts(opts: BenchOptions, vocab: int) -> list[list[int]]:
    """The ``batch`` prompts of random ids (seed ``opts.seed``): ``prompt_len`` tokens each, or
    with ``mixed_lengths`` lengths drawn uniformly from ``[max(1, prompt_len // 8),
    prompt_len]``."""
    rng = np.random.default_rng(opts.seed)
    ids = rng.integers(0, vocab, (opts.batch, opts.prompt_len), dtype=np.int64)
    if not opts.mixed_lengths:
        return ids.tolist()
    lengths = rng.integers(max(1, opts.prompt_len // 8), opts.prompt_len + 1, opts.batch)
    return [row[:n].tolist() for row, n in zip(ids, lengths, strict=True)]


def _one_run(engine: Any, prompts: list[list[int]], gen_len: int) -> dict[str, Any]:
    """Prefill ``prompts`` on fresh sequences, then ``gen_len - 1`` greedy steps."""
    seqs = [engine.add_sequence() for _ in range(len(prompts))]
    try:
        t0 = time.perf_counter()
        logits = np.stack(engine.prefill(seqs, prompts))
        t1 = time.perf_counter()
        tokens = logits.argmax(-1)
        t2 = time.perf_counter()
        first_logits = logits[0].copy()
        steps, argmax = [], []
        on_device = engine.has_device_greedy
        for i in range(gen_len - 1):
            s0 = time.perf_counter()
            if on_device:  # the next step's host bookkeeping overlaps this one on the device
                pending = engine.launch_greedy(seqs, tokens.tolist(), next_step=i < gen_len - 2)
                tokens = pending.result()
                steps.append(time.perf_counter() - s0)
                continue
            out = engine.decode(seqs, tokens.tolist())
            s1 = time.perf_counter()
            tokens = out.argmax(-1)
            s2 = time.perf_counter()
            steps.append(s2 - s0)
            argmax.append(s2 - s1)
    finally:
        for s in seqs:
            engine.remove_sequence(s)
    return {
        "prefill_s": t1 - t0,
        "ttft_s": t2 - t0,
        "step_s": steps,
        "argmax_s": argmax,
        "first_logits": first_logits,
    }


def _expert_major(opts: BenchOptions) -> dict[str, int | None]:
    """The engine's ``expert_major_from`` / ``gemm_decode_from`` / ``swap_decode_from``
    keywords for ``opts`` (none: its defaults)."""
    out: dict[str, int | None] = {}
    if opts.gemm_decode_from is not None:
        out["gemm_decode_from"] = opts.gemm_decode_from
    if opts.swap_decode_from is not None:
        out["swap_decode_from"] = opts.swap_decode_from
    if opts.token_major:
        off = ("expert_major_from", "gemm_decode_from", "swap_decode_from")
        return {**out, **dict.fromkeys(off)}
    if opts.expert_major_from is not None:
        out["expert_major_from"] = opts.expert_major_from
    return out


def _graph_report(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """Decode CUDA graphs: totals, and what the timed runs themselves captured / replayed."""
    if before is None or after is None:
        return None
    timed = {
        k: after[k] - before[k]
        for k in ("captures", "replays", "failures", "mismatches", "capture_s", "relocations")
    }
    return {"total": after, "timed_runs": timed}


SYNC_CHECK_PROMPT = 512  # prompt tokens of the sync check's sequence


def sync_check(engine: Any, prompt: list[int], steps: int = 3) -> dict[str, float]:
    """One sequence: per decode step, host time until the VM call returns (kernels enqueued),
    until the device is idle (stream sync), and until the logits are on the host. Uses the
    engine's internals to split its decode call into those parts (read only)."""
    import tvm_ffi

    from .runtime.device import to_device, to_numpy

    seq = engine.add_sequence()
    rows = []
    try:
        token = int(engine.prefill([seq], [prompt])[0].argmax())
        for _ in range(steps):
            ids = to_device(np.array([[token]], np.int32), engine.device)
            t0 = time.perf_counter()
            engine._kv_state["begin_forward"](
                engine._cache, tvm_ffi.Shape([seq]), tvm_ffi.Shape([1])
            )
            out = engine._fn["batch_decode"](ids, engine._cache, engine._params)
            t1 = time.perf_counter()
            _sync(engine.device)
            t2 = time.perf_counter()
            engine._kv_state["end_forward"](engine._cache)
            engine._seq_len[seq] += 1
            token = int(to_numpy(out[0]).reshape(-1).argmax())
            t3 = time.perf_counter()
            rows.append((t1 - t0, t2 - t0, t3 - t0))
    finally:
        engine.remove_sequence(seq)
    enq, synced, copied = (float(np.median(c)) * 1e3 for c in zip(*rows, strict=True))
    return {"call_returns_ms": enq, "device_idle_ms": synced, "logits_on_host_ms": copied}


def profile_kernels(engine: Any, prompt: list[int], steps: int) -> dict[str, list[dict[str, Any]]]:
    """Per VM call name: calls and synchronised time, for one prefill and ``steps`` decodes."""
    device = engine.device
    vm = engine._vm
    current: dict[str, dict[str, list[float]]] = {}
    start = [0.0]

    def hook(func: Any, name: str, before: bool, ret: Any, *args: Any) -> None:
        _sync(device)
        if before:
            start[0] = time.perf_counter()
        else:
            current.setdefault(str(name), []).append(time.perf_counter() - start[0])

    def table(records: dict[str, list[float]], per: int) -> list[dict[str, Any]]:
        total = sum(sum(v) for v in records.values()) or 1.0
        rows = [
            {
                "name": name,
                "calls_per_step": len(v) / per,
                "ms_per_step": sum(v) * 1e3 / per,
                "mean_us": float(np.mean(v)) * 1e6,
                "share": sum(v) / total,
            }
            for name, v in records.items()
        ]
        return sorted(rows, key=lambda r: -r["ms_per_step"])

    seq = engine.add_sequence()
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        vm["set_instrument"](hook)
        token = int(engine.prefill([seq], [prompt])[0].argmax())
        out["prefill"], current = table(current, 1), {}
        for _ in range(steps):
            token = int(engine.decode_greedy([seq], [token])[0])
        out["decode"] = table(current, steps)
    finally:
        vm["set_instrument"](None)
        engine.remove_sequence(seq)
    return out


# -- the benchmark ---------------------------------------------------------------------------------
def _gpu_info() -> dict[str, str]:
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return {}
    name, driver, memory = (s.strip() for s in line.split(","))
    return {"gpu": name, "driver": driver, "gpu_memory": memory}


def _open_engine(opts: BenchOptions, log: Callable[[str], None]) -> tuple[Any, float]:
    from .layout import PARAMS_DIR, BuildConfig, has_spec
    from .runtime.engine import Engine

    path = Path(opts.model)
    build = BuildConfig.read(path)
    ctx = opts.prompt_len + opts.gen_len
    limit = build.model["max_position_embeddings"]
    if ctx > limit:
        raise BenchError(f"prompt + generation = {ctx} tokens exceeds the model's {limit}")
    has_params = (path / PARAMS_DIR / "tensor-cache.json").is_file()
    if not has_params and not has_spec(path):
        raise BenchError(f"{path}: the build has neither params/ nor random-params.json")
    t0 = time.perf_counter()
    engine = Engine(
        path,
        context_window=ctx,
        max_batch_size=opts.batch,
        kv_capacity=ctx * opts.batch,
        prefill_chunk_size=opts.prefill_chunk,  # None: the engine's default chunk
        lib_dir=opts.lib_dir,
        random_weights=None if has_params else opts.seed,
        cuda_graph=opts.cuda_graph,
        verify=opts.verify,
        experts=opts.experts,
        gpu_memory=opts.gpu_memory,
        **_expert_major(opts),
    )
    if engine.memory_plan is not None:
        log(engine.memory_plan.table())
    _sync(engine.device)
    seconds = time.perf_counter() - t0
    log(
        f"loaded {path} ({build.quantization}, {build.device}, "
        f"{'random weights seed ' + str(opts.seed) if not has_params else 'converted weights'}) "
        f"in {seconds:.2f} s"
    )
    return engine, seconds


def run_bench(opts: BenchOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; returns the report (every raw number; see the module docstring)."""
    opts.check()
    from .layout import BuildConfig
    from .model.config import DeepseekV2Config
    from .runtime.tvm_runtime import load_runtime

    build = BuildConfig.read(opts.model)
    build_device = build.device
    if opts.gpu_memory is not None:  # a budget too small is refused before the runtime loads
        from .runtime.engine import DEFAULT_PREFILL_CHUNK
        from .runtime.memory_plan import plan_engine

        ctx = opts.prompt_len + opts.gen_len
        plan_engine(
            opts.model, build, opts.gpu_memory, ctx, opts.batch, ctx * opts.batch,
            opts.prefill_chunk, DEFAULT_PREFILL_CHUNK[build_device], opts.cuda_graph,
            opts.experts,
        )  # fmt: skip
    load_runtime(build_device, opts.lib_dir)
    memory = _MemoryTracker(build_device)
    memory.sample()  # before the model: the CUDA context (and nothing else)
    engine, load_s = _open_engine(opts, log)
    memory.sample()
    cfg, vocab = DeepseekV2Config.from_dict(engine.build.model), engine.config.vocab_size
    prompts = bench_prompts(opts, vocab)
    lengths = [len(p) for p in prompts]

    # Kernels are loaded lazily on first use: a short run first, then the warm-up runs.
    _one_run(engine, [p[:16] for p in prompts], 3)
    first_run = None  # the first warm-up run: decode graphs captured (and checked) on the way
    for i in range(opts.warmup):
        log(f"warm-up {i + 1}/{opts.warmup}")
        stats = engine.cuda_graph_stats
        run = _one_run(engine, prompts, opts.gen_len)
        memory.sample()
        if i == 0 and run["step_s"]:
            first_run = {
                "decode_tok_s": opts.batch * len(run["step_s"]) / sum(run["step_s"]),
                "tpot_ms_max": max(run["step_s"]) * 1e3,
                "cuda_graph": _graph_report(stats, engine.cuda_graph_stats),
            }
    graphs_before = engine.cuda_graph_stats
    runs = []
    for i in range(opts.repeat):
        runs.append(_one_run(engine, prompts, opts.gen_len))
        memory.sample()
        log(
            f"run {i + 1}/{opts.repeat}: prefill {runs[-1]['prefill_s'] * 1e3:.1f} ms, decode "
            f"{np.mean(runs[-1]['step_s']) * 1e3 if runs[-1]['step_s'] else float('nan'):.2f} "
            "ms/step"
        )

    ws = weight_stats(engine.named_params(), cfg)
    steps = [s for r in runs for s in r["step_s"]]
    in_loop = [a for r in runs for a in r["argmax_s"]]  # host arg-max (builds without the kernel)
    n_steps = opts.gen_len - 1
    prefill_s = [r["prefill_s"] for r in runs]
    ttft_s = [r["ttft_s"] for r in runs]
    # step i attends to prompt + i + 1 tokens
    contexts = [n + (n_steps + 1) / 2 for n in lengths]
    mean_ctx = float(np.mean(contexts))
    per_step = decode_bytes(ws, cfg, engine.build.cache_dtype, contexts, engine.build.dtype)
    flops = sum(prefill_flops(ws, cfg, n, 1) for n in lengths)
    report: dict[str, Any] = {
        "options": asdict(opts),
        "setup": {
            "device": engine.device,
            "host": platform.node(),
            "python": platform.python_version(),
            **(_gpu_info() if engine.device == "cuda" else {"cpu": platform.processor()}),
        },
        "model": {
            "path": str(Path(opts.model).resolve()),
            "quantization": engine.build.quantization,
            "dtype": engine.build.dtype,
            "target": engine.build.target,
            "weights": (
                f"random (seed {opts.seed})"
                if engine.random_weights is not None
                else "converted checkpoint"
            ),
            "config": {
                k: getattr(cfg, k)
                for k in (
                    "vocab_size",
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "kv_lora_rank",
                    "n_routed_experts",
                    "num_experts_per_tok",
                    "moe_intermediate_size",
                )
            },
            **ws,
            "kv_bytes_per_token": engine.build.kv_bytes_per_token(),
            "load_s": load_s,
            # where the weights live (Engine(experts=...)): bytes in device and in host memory
            "placement": {"experts": engine.experts, "weight_bytes": engine.weight_bytes()},
        },
        "prefill": {
            "tokens": sum(lengths),
            "prompt_lengths": lengths,
            "chunk_size": engine.prefill_chunk_size,
            "prefill_s": prefill_s,
            "ttft_s": ttft_s,
            "prefill_s_median": float(np.median(prefill_s)),
            "ttft_ms_median": float(np.median(ttft_s)) * 1e3,
            "prefill_tok_s": sum(lengths) / float(np.median(prefill_s)),
            "flops": flops,
            "tflop_s": flops / float(np.median(prefill_s)) / 1e12,
        },
        "decode": {
            "steps_per_run": n_steps,
            "expert_major": engine.expert_major_from is not None
            and opts.batch >= engine.expert_major_from,
            "gemm_path": engine.gemm_decode_from is not None
            and opts.batch >= engine.gemm_decode_from,
            "swap_moe": engine.swap_decode_from is not None
            and opts.batch >= engine.swap_decode_from,
            "step_s": steps,
            "decode_tok_s": opts.batch * len(steps) / sum(steps) if steps else None,
            "tpot_ms_mean": float(np.mean(steps)) * 1e3 if steps else None,
            "tpot_ms_p50": _percentile(steps, 50) * 1e3 if steps else None,
            "tpot_ms_p99": _percentile(steps, 99) * 1e3 if steps else None,
            "argmax_on_device": engine.has_device_greedy,
            "host_argmax_us_in_loop": float(np.median(in_loop)) * 1e6 if in_loop else None,
            "host_argmax_us": _host_argmax_us(opts.batch, vocab),
            "cuda_graph": _graph_report(graphs_before, engine.cuda_graph_stats),
            "first_run": first_run,
        },
        "roofline": {
            "hbm_bandwidth": opts.hbm_bandwidth,
            "mean_context": mean_ctx,
            **per_step,
            "bytes_per_token": per_step["total_bytes"] / opts.batch,
            "roofline_tok_s": opts.batch * opts.hbm_bandwidth / per_step["total_bytes"],
        },
    }
    if steps:
        achieved = per_step["total_bytes"] / float(np.mean(steps))
        report["roofline"]["achieved_bytes_s"] = achieved
        report["roofline"]["fraction_of_hbm"] = achieved / opts.hbm_bandwidth
    prompt0 = prompts[0]
    # (a short prompt: the check is about one step's parts, and a 128K prefill takes a minute)
    report["sync_check"] = sync_check(engine, prompt0[:SYNC_CHECK_PROMPT])
    if opts.profile:
        log("profiling (a device sync around every VM call)")
        report["profile"] = profile_kernels(engine, prompt0, opts.profile_steps)
    memory.sample()
    report["memory"] = memory.report()
    if engine.memory_plan is not None:
        report["memory_plan"] = engine.memory_plan.to_dict()
    if opts.compare_hf:
        from .bench_hf import compare_hf

        report["hf"] = compare_hf(engine, prompts, opts, runs[-1]["first_logits"], report, log)
    return report


def format_report(r: dict[str, Any]) -> str:
    """A short human-readable summary of a report."""
    o, p, d, f, m = r["options"], r["prefill"], r["decode"], r["roofline"], r["memory"]
    lines = [
        f"model {r['model']['path']} ({r['model']['quantization']}, {r['setup']['device']}"
        + (f", {r['setup']['gpu']}" if "gpu" in r["setup"] else "")
        + f"), batch {o['batch']}, prompt {o['prompt_len']}"
        + (" (mixed lengths)" if o.get("mixed_lengths") else "")
        + f", gen {o['gen_len']}"
        + (
            f", prefill chunks of {p['chunk_size']}"
            if p.get("chunk_size", p["tokens"]) < p["tokens"]
            else ""
        ),
        f"prefill: {p['prefill_tok_s']:,.0f} tok/s, TTFT {p['ttft_ms_median']:.1f} ms "
        f"({p['tflop_s']:.1f} TFLOP/s)",
    ]
    if d["decode_tok_s"] is not None:
        lines.append(
            f"decode: {d['decode_tok_s']:,.1f} tok/s, TPOT p50 {d['tpot_ms_p50']:.3f} ms, "
            f"p99 {d['tpot_ms_p99']:.3f} ms ("
            + (
                "GEMM path, swap MoE; "
                if d.get("swap_moe")
                else "GEMM path; "
                if d.get("gemm_path")
                else "expert-major MoE; "
                if d.get("expert_major")
                else ""
            )
            + (
                f"arg-max on the device; on the host it would take {d['host_argmax_us']:.0f} us)"
                if d.get("argmax_on_device")
                else f"host arg-max {d['host_argmax_us']:.0f} us/step)"
            )
        )
        first = d.get("first_run")
        if first is not None:
            timed = (first.get("cuda_graph") or {}).get("timed_runs") or {}
            captured, moved = timed.get("captures"), timed.get("relocations")
            note = ""
            if captured:
                also = f", {moved:.0f} moved" if moved else ""
                note = f" ({captured:.0f} graphs captured on the way{also})"
            lines.append(
                f"decode, first run: {first['decode_tok_s']:,.1f} tok/s, slowest step "
                f"{first['tpot_ms_max']:.2f} ms{note}"
            )
        lines.append(
            f"roofline: {f['bytes_per_token'] / 1e9:.3f} GB/token at context "
            f"{f['mean_context']:.0f} -> {f['achieved_bytes_s'] / 1e9:,.0f} GB/s = "
            f"{100 * f['fraction_of_hbm']:.1f}% of {f['hbm_bandwidth'] / 1e12:.2f} TB/s "
            f"(ceiling {f['roofline_tok_s']:,.0f} tok/s)"
        )
    placed = r["model"].get("placement")
    if placed and placed["experts"] != "gpu":
        wb = placed["weight_bytes"]
        lines.append(
            f"weights: {wb['gpu'] / 2**30:.2f} GiB on the device, {wb['host'] / 2**30:.2f} GiB "
            f"of routed experts in pinned host memory (experts={placed['experts']})"
        )
    peak = m.get("peak_bytes")
    if peak:
        extra = m.get("peak_minus_before_load_bytes")
        lines.append(
            f"memory: peak {peak / 2**30:.2f} GiB"
            + (f" ({extra / 2**30:.2f} GiB above the empty context)" if extra else "")
            + f" [{m['source'].split(' (')[0]}]"
        )
    s = r["sync_check"]
    lines.append(
        f"decode step split: VM call returns {s['call_returns_ms']:.3f} ms, device idle "
        f"{s['device_idle_ms']:.3f} ms, logits on host {s['logits_on_host_ms']:.3f} ms"
    )
    for phase, rows in r.get("profile", {}).items():
        lines.append(f"top VM calls ({phase}, ms per {'call' if phase == 'prefill' else 'step'}):")
        for row in rows[:10]:
            lines.append(
                f"  {row['ms_per_step']:9.3f} ms {100 * row['share']:5.1f}%  "
                f"x{row['calls_per_step']:<6g} {row['name']}"
            )
    if "hf" in r:
        h = r["hf"]
        lines.append(
            f"HF transformers ({h['dtype']}, {h['attn_implementation']}): prefill "
            f"{h['prefill_tok_s']:,.0f} tok/s, decode {h['decode_tok_s']:,.2f} tok/s -> ours/HF: "
            f"prefill x{h['ratio_prefill_tok_s']:.2f}, decode x{h['ratio_decode_tok_s']:.1f}; "
            f"first-token logits max |diff| {h['first_logits_max_abs_diff']:.3g} "
            f"(|max| {h['first_logits_max_abs']:.3g}, same arg-max: {h['first_token_agrees']})"
        )
    return "\n".join(lines)


def bench_main(opts: BenchOptions, json_path: str | None = None) -> dict[str, Any]:
    """Run, print the summary, and write the JSON report to ``json_path`` (if given)."""
    report = run_bench(opts)
    print(format_report(report))
    if json_path:
        Path(json_path).write_text(json.dumps(_jsonable(report), indent=1))
    return report


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return obj
