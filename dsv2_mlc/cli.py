"""``dsv2-mlc`` command line: argument parsing only; typed functions do the work."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from .errors import Dsv2Error

GPU_MEMORY_HELP = (
    "plan the engine inside this much device memory, e.g. 4GiB, 4.5G, 3500MiB: the KV cache of "
    "the requested context, weights (routed experts to pinned host memory if they do not fit), "
    "prefill chunks small enough; refused with the breakdown if it cannot hold the context"
)
VERIFY_HELP = (
    "check the SHA-256 of the weight files too before loading them (the library's is checked "
    "on every open; see dist/README.md)"
)
EXPERTS_HELP = (
    "where the routed experts' weights live: gpu (device memory) or host (pinned host memory "
    "the same kernels read over PCIe: far less device memory, slower decode); default: gpu, "
    "or where the --gpu-memory plan puts them"
)


def _memory_size(text: str) -> str:
    """``--gpu-memory``: checked here (the planner reads it again)."""
    from .runtime.memory_plan import MemoryBudgetError, parse_size

    try:
        parse_size(text)
    except MemoryBudgetError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return text


def _compile(args: argparse.Namespace) -> int:
    from .compiler.compile import compile_model, compile_random_model

    options = dict(
        device=args.device,
        arch=args.arch,
        dtype=args.dtype,
        quantization=args.quantization,
        quantize_embedding=args.quantize_embedding,
        quantize_lm_head=args.quantize_lm_head,
        dump_ir=args.dump_ir,
        pdl=args.pdl,
        gemm=args.gemm,
        kv_dtype=args.kv_dtype,
        kv_scale=args.kv_scale,
    )
    if args.random_weights:
        result = compile_random_model(args.model_dir, args.output, **options)
        what = f"{args.model_dir} (random weights)"
    else:
        result = compile_model(args.model_dir, args.output, progress=not args.quiet, **options)
        what = str(args.model_dir)
    print(f"compiled {what} -> {result.out_dir} in {result.seconds:.1f} s")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from .bench import BenchOptions, bench_main

    opts = BenchOptions(**{f.name: getattr(args, f.name) for f in fields(BenchOptions)})
    if args.sweep:
        from .bench_sweep import DEFAULT_BATCHES, DEFAULT_CONTEXTS, parse_ints, run_sweep

        contexts = parse_ints(args.contexts, "--contexts") if args.contexts else DEFAULT_CONTEXTS
        batches = parse_ints(args.batches, "--batches") if args.batches else DEFAULT_BATCHES
        run_sweep(opts, contexts, batches, args.out)
        return 0
    bench_main(opts, args.json)
    return 0


def _add_bench_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure prefill / decode speed (optionally against HF transformers)",
        description="Prefill and decode speed of a compiled model at a given shape: TTFT, "
        "tok/s, TPOT p50/p99, GB/s against the HBM roofline, peak memory (see docs/benchmarks.md).",
    )
    p.add_argument("model", help="a compiled folder (with --random-weights: weights made on load)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per sequence (512)")
    p.add_argument("--gen-len", type=int, default=128, help="generated tokens per sequence (128)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (1)")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="at most this many tokens a prefill call; longer prompts go in chunks (default: "
        "the engine's chunk, 8192 on CUDA; the prompt length for one call)",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed full runs first (1)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs (3)")
    p.add_argument("--seed", type=int, default=0, help="random weights and prompt ids (0)")
    p.add_argument(
        "--hbm-bandwidth", type=float, default=4.8e12, help="bytes/s for the roofline (4.8e12)"
    )
    p.add_argument("--profile", action="store_true", help="time every VM call (synchronised)")
    p.add_argument("--profile-steps", type=int, default=8, help="decode steps profiled (8)")
    p.add_argument(
        "--compare-hf", action="store_true", help="also run HF transformers on the same weights"
    )
    p.add_argument("--hf-dtype", default="bfloat16", help="HF weights/activations (bfloat16)")
    p.add_argument("--hf-attn", default="eager", help="HF attention implementation (eager)")
    p.add_argument("--hf-decode-tokens", type=int, default=32, help="HF decode steps (32)")
    p.add_argument("--lib-dir", default=None, help="folder of libtvm_runtime*.so")
    p.add_argument(
        "--no-cuda-graph",
        dest="cuda_graph",
        action="store_false",
        help="decode without CUDA graphs (each step enqueued by the VM)",
    )
    p.add_argument(
        "--expert-major-from",
        type=int,
        default=None,
        help="decode batches of at least this many sequences read each expert they select once "
        "(the expert-major MoE kernels on tensor cores; default: the engine's, 16)",
    )
    p.add_argument(
        "--mixed-lengths",
        action="store_true",
        help="draw each sequence's prompt length from [prompt-len/8, prompt-len]: decode steps "
        "over sequences of different lengths",
    )
    p.add_argument(
        "--gemm-decode-from",
        type=int,
        default=None,
        help="decode batches of at least this many sequences run the GEMM path (projections "
        "and experts as the prefill path runs them; default: the engine's, 32)",
    )
    p.add_argument(
        "--swap-decode-from",
        type=int,
        default=None,
        help="decode batches of at least this many sequences run the GEMM path with the routed "
        "experts as grouped GEMMs over tiles of a few tokens (sm_90 builds; default: the "
        "engine's, 128)",
    )
    p.add_argument(
        "--token-major",
        action="store_true",
        help="every decode step on the fused per-token MoE kernels",
    )
    p.add_argument("--json", default=None, help="write the full report (every raw number) here")
    p.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    p.add_argument("--experts", choices=("gpu", "host"), default=None, help=EXPERTS_HELP)
    p.add_argument("--gpu-memory", type=_memory_size, default=None, help=GPU_MEMORY_HELP)
    p.add_argument(
        "--sweep",
        action="store_true",
        help="one bench per (context, batch) point; writes sweep.json and a sweep.png heatmap "
        "into --out (prompt = context - gen-len, prefill in chunks)",
    )
    p.add_argument(
        "--contexts", default=None, help="sweep contexts, e.g. 4096,8192 (4K, 8K, ... 128K)"
    )
    p.add_argument("--batches", default=None, help="sweep batch sizes, e.g. 1,8 (1,8)")
    p.add_argument("--out", default=".", help="folder of sweep.json and sweep.png (.)")
    p.set_defaults(func=_bench)


def _chat(args: argparse.Namespace) -> int:
    from .chat_repl import ChatOptions, run_chat

    sampling = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "stop": tuple(args.stop) if args.stop else None,
    }
    options = ChatOptions(
        model=args.model,
        prompt=args.prompt,
        system=args.system,
        cache_dir=args.cache_dir,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        context_window=args.context_window,
        sampling=sampling,
        verify=args.verify,
        experts=args.experts,
        gpu_memory=args.gpu_memory,
    )
    return run_chat(options)


def _serve(args: argparse.Namespace) -> int:
    from .serve.app import run_server

    run_server(
        args.model,
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        context_window=args.context_window,
        kv_capacity=args.kv_capacity,
        gpu_memory=args.gpu_memory,
        max_queue=args.max_queue,
        step_tokens=args.step_tokens,
        prefix_cache=not args.no_prefix_cache,
        cache_dir=args.cache_dir,
        device=args.device,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        random_weights=args.random_weights,
        lib_dir=args.lib_dir,
    )
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from .serve.bench_serve import bench_serve

    report = bench_serve(
        args.url,
        concurrency=args.concurrency,
        requests=args.requests,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        model=args.model,
        seed=args.seed,
        timeout=args.timeout,
    )
    report.print(args.json)
    return 1 if report.errors else 0


def _add_serve_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible server (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /metrics) with continuous batching and prefix caching.",
    )
    p.add_argument("model", nargs="?", default=None, help="as for chat (nothing: the default)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences run at once (8)")
    p.add_argument("--context-window", type=int, default=None, help="tokens of one sequence")
    p.add_argument(
        "--kv-capacity",
        type=int,
        default=None,
        help="tokens of the KV cache shared by all sequences and cached prefixes "
        "(default: context window x max batch)",
    )
    p.add_argument(
        "--gpu-memory",
        type=_memory_size,
        default=None,
        help="the memory budget, e.g. 4GiB: weights, workspace and runtime first, the KV cache "
        "gets the rest (instead of --kv-capacity)",
    )
    p.add_argument("--max-queue", type=int, default=256, help="waiting sequences before 429s")
    p.add_argument(
        "--step-tokens",
        type=int,
        default=None,
        help="tokens one batching step takes (256 on the CPU, 2048 on CUDA)",
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="no prefix caching")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API")
    p.add_argument("--cache-dir", default=None, help="where compiled checkpoints are cached")
    p.add_argument("--device", default=None, help="device to compile for / run on (cpu)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (info)")
    p.add_argument(
        "--random-weights",
        type=int,
        default=None,
        metavar="SEED",
        help="serve a build compiled with --random-weights, its weights made from SEED",
    )
    p.add_argument("--lib-dir", default=None, help="folder of the TVM runtime library")
    p.set_defaults(func=_serve)

    p = sub.add_parser(
        "bench-serve",
        help="load-test an OpenAI-compatible server",
        description="Streamed completions against a server; reports throughput, TTFT and "
        "TPOT (p50, p99) and errors as JSON on stdout.",
    )
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (8)")
    p.add_argument("--requests", type=int, default=64, help="requests in all (64)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (128)")
    p.add_argument("--gen-len", type=int, default=64, help="tokens to generate (64)")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", default=None, help="write the report here too")
    p.set_defaults(func=_bench_serve)


def _package(args: argparse.Namespace) -> int:
    from .artifacts.package import package_artifact

    r = package_artifact(
        args.compiled_dir,
        args.output,
        name=args.name,
        model_name=args.model_name,
        lib_dir=args.lib_dir,
    )
    print(
        f"packaged {r.manifest.name} ({r.manifest.target.describe()}) -> {r.path}: "
        f"{r.size} bytes, sha256 {r.sha256}, manifest sha256 {r.manifest_sha256}"
    )
    return 0


def _pull(args: argparse.Namespace) -> int:
    from .artifacts.pull import pull

    try:
        r = pull(
            args.source,
            cache_dir=args.cache_dir,
            sha256=args.sha256,
            index=args.index,
            force=args.force,
            check=not args.no_check,
            progress=not args.quiet,
        )
    except KeyboardInterrupt as err:  # say where a resumable partial download was kept
        for note in getattr(err, "__notes__", ()):
            print(note, file=sys.stderr)
        raise
    state = "already installed" if r.already_installed else "installed"
    print(f"{state} {r.name} ({r.manifest.target.describe()}) at {r.path}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from .artifacts.pull import cache_access
    from .artifacts.store import format_listing, list_installed

    with cache_access(args.cache_dir, write=False):
        print(format_listing(list_installed(args.cache_dir)))
    return 0


def _rm(args: argparse.Namespace) -> int:
    from .artifacts.pull import cache_access
    from .artifacts.store import remove_installed

    with cache_access(args.cache_dir):
        for name in args.names:
            print(f"removed {name} ({remove_installed(name, args.cache_dir)})")
    return 0


def _add_artifact_commands(sub: argparse._SubParsersAction) -> None:
    """``package``, ``pull``, ``list`` and ``rm`` (see dist/README.md)."""
    cache_help = (
        "artifact cache (default: $DSV2_MLC_CACHE_DIR, $XDG_CACHE_HOME/dsv2-mlc or "
        "~/.cache/dsv2-mlc)"
    )
    p = sub.add_parser("package", help="package a compiled folder as a prebuilt artifact")
    p.add_argument("compiled_dir", help="a folder written by `dsv2-mlc compile`")
    p.add_argument("-o", "--output", required=True, help="artifact file (or a folder for NAME.tar)")
    p.add_argument("--name", default=None, help="default: MODEL-QUANT-DEVICE[-ARCH]")
    p.add_argument("--model-name", default=None, help="model name (default: the folder's name)")
    p.add_argument(
        "--lib-dir", default=None, help="TVM runtime libraries to bundle (default: TVM's own)"
    )
    p.set_defaults(func=_package)

    p = sub.add_parser(
        "pull",
        help="download, verify and install an artifact",
        description="Download, verify and install an artifact. SOURCE spelled as a name "
        "(letters, digits, '.', '_', '-'; no '/'; not ending in .tar/.tar.gz/.tgz) is looked up "
        "in the index and checked against its hashes, even where a file or folder of that name "
        "is in the current directory; a local file or folder is given as a path: ./NAME, any "
        "path with a '/', or NAME.tar. Downloads stop at the index's size, else the server's "
        "Content-Length, else 32 GiB; Ctrl-C or a broken connection keeps a partial download "
        "of known size, which the same command resumes, and deletes any other.",
    )
    p.add_argument(
        "source",
        help="a name in the index, an artifact file or folder given as a path (./NAME, a path "
        "with '/', or NAME.tar), or a file:// or http(s):// URL",
    )
    p.add_argument("--sha256", default=None, help="expected SHA-256 of its manifest.json")
    p.add_argument(
        "--index",
        default=None,
        help="artifact index path or URL (default: $DSV2_MLC_INDEX or dist/index.json)",
    )
    p.add_argument("--force", action="store_true", help="replace another build of the same name")
    p.add_argument(
        "--no-check", action="store_true", help="install even if this machine cannot run it"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--cache-dir", default=None, help=cache_help)
    p.set_defaults(func=_pull)

    p = sub.add_parser("list", help="list the installed artifacts")
    p.add_argument("--cache-dir", default=None, help=cache_help)
    p.set_defaults(func=_list)

    p = sub.add_parser("rm", help="remove installed artifacts")
    p.add_argument("names", nargs="+", help="installed artifact names (see `dsv2-mlc list`)")
    p.add_argument("--cache-dir", default=None, help=cache_help)
    p.set_defaults(func=_rm)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    parser = argparse.ArgumentParser(
        prog="dsv2-mlc", description="Compile and run DeepSeek-V2 models with Apache TVM."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="compile a Hugging Face checkpoint folder")
    p.add_argument(
        "model_dir",
        help="folder with config.json and *.safetensors (with --random-weights: a config.json "
        "or its folder)",
    )
    p.add_argument("-o", "--output", required=True, help="output folder (replaced atomically)")
    p.add_argument("--device", default="cpu", help="target device (default: cpu)")
    p.add_argument("--arch", default="sm_90", help="CUDA architecture (default: sm_90)")
    p.add_argument("--dtype", default=None, help="float32 or float16 (default: float32)")
    p.add_argument(
        "--quantization",
        default=None,
        help="q0f32, q0f16, q4f16_g32, q4f16_g128, q4f32_g32 or q4f32_g128 "
        "(default: q0 in --dtype; see docs/quantization.md)",
    )
    p.add_argument(
        "--quantize-embedding",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="store the token embedding in INT4 too (q4 default: yes)",
    )
    p.add_argument(
        "--quantize-lm-head",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="store lm_head in INT4 too (q4 default: yes)",
    )
    p.add_argument("--dump-ir", default=None, help="write the IR after each pipeline phase here")
    p.add_argument(
        "--pdl",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Programmatic Dependent Launch: kernels wait with griddepcontrol.wait and decode "
        "graphs link them with programmatic edges (default: on for CUDA sm_90+)",
    )
    p.add_argument(
        "--gemm",
        choices=("cublas", "tir"),
        default=None,
        help="who runs the prefill GEMMs: cuBLAS (needs libcublas where the model runs) or TIR "
        "kernels in the library (default: cublas for CUDA, tir otherwise)",
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        help="the latent KV cache's element type: the activation dtype (default) or fp8 "
        "(e4m3 latent values, the rope part in the activation dtype: 56 %% of a float16 "
        "cache)",
    )
    p.add_argument(
        "--kv-scale",
        type=float,
        default=None,
        help="fp8 KV cache: its static scale (values stored as x / scale, read as q * scale; "
        "default 1.0)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="compile from the config alone: no weights are converted; the runtime creates "
        "random ones on the device (for benchmarks: dsv2-mlc bench)",
    )
    p.set_defaults(func=_compile)

    p = sub.add_parser(
        "chat",
        help="chat with a model (interactive, or one answer with --prompt)",
        description="Chat with a model: replies stream as they are produced; the conversation "
        "stays in the KV cache between turns. Commands: /help /stats /reset /exit; Ctrl-D exits.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a checkpoint folder (compiled on first use and cached), a compiled folder, an "
        "installed artifact's name (dsv2-mlc list), or nothing for the embedded default model; "
        "a name that is installed means the artifact even where a folder of that name is here "
        "(that folder is ./NAME)",
    )
    p.add_argument("--prompt", default=None, help="answer this one prompt and exit")
    p.add_argument("--system", default=None, help="system prompt (models with a chat template)")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy decoding")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (0, 1]")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely (0: all)")
    p.add_argument("--repetition-penalty", type=float, default=None, help="> 1 discourages repeats")
    p.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per reply (256)")
    p.add_argument("--stop", action="append", default=None, help="stop at this text (repeatable)")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where compiled checkpoints are cached (default: $DSV2_MLC_CACHE_DIR, "
        "$XDG_CACHE_HOME/dsv2-mlc or ~/.cache/dsv2-mlc)",
    )
    p.add_argument("--device", default=None, help="device to compile for / run on (cpu)")
    p.add_argument("--dtype", default=None, help="float32 or float16 when compiling (float32)")
    p.add_argument(
        "--quantization", default=None, help="quantization when compiling (see compile --help)"
    )
    p.add_argument("--context-window", type=int, default=None, help="tokens of one conversation")
    p.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    p.add_argument("--experts", choices=("gpu", "host"), default=None, help=EXPERTS_HELP)
    p.add_argument("--gpu-memory", type=_memory_size, default=None, help=GPU_MEMORY_HELP)
    p.set_defaults(func=_chat)
    _add_bench_command(sub)
    _add_serve_commands(sub)
    _add_artifact_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dsv2-mlc`` console script."""
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except Dsv2Error as err:
        print(f"dsv2-mlc {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
