"""The thin runtime: load a compiled model folder, own its paged KV cache and sequences, run it.

Only ``tvm_ffi`` and the TVM runtime libraries are used (no ``import tvm``), so a compiled model
runs where the compiler is not installed.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tvm_ffi

from ..layout import LIBRARY, PARAMS_DIR, BuildConfig, BuildError, ModelInfo, has_spec, read_spec
from . import api_checks as check
from .cublas import init_cublas, set_cublas_workspace
from .cuda_graph import DecodeGraphs, decode_graph_key, same_greedy, same_logits
from .device import copy_into, to_device, to_numpy
from .generation import GenerationResult, GenerationStream, StreamDelta
from .host_memory import HostWeights, load_params_placed
from .integrity import verify_build
from .memory_plan import GEMM_DECODE_FROM, SWAP_DECODE_FROM, plan_engine, reports_oom
from .pdl import PORTS as PDL_PORTS
from .pending import PendingTokens
from .placement import placed_bytes
from .text import ContextLengthError, PromptError, TextMixin
from .tokenizer import Tokenizer
from .tvm_runtime import global_func, load_runtime

if TYPE_CHECKING:
    from .openai_compat import ChatNamespace

__all__ = [
    "ContextLengthError",
    "Engine",
    "GenerationResult",
    "GenerationStream",
    "PendingTokens",
    "PromptError",
    "StreamDelta",
]

PAGE_SIZE = 16  # TVM's paged KV kernels are built for 16-token pages (notes/tvm-0.27.md 7.5).
_DEVICE_TYPE = {"cpu": 1, "cuda": 2}
# Tokens one prefill call takes by default (capped by the KV capacity). A longer prompt goes in
# chunks, every chunk after the first an extend attending to the cached prefix, which costs
# several times a prefill of the same tokens (schedules/results/mla_attention.md, "Prefill in
# chunks"): on CUDA a prompt of up to 8K tokens is one call.
DEFAULT_PREFILL_CHUNK = {"cpu": 512, "cuda": 8192}
# with all_logits the logits of every token come back ([tokens, vocab] float32): chunks of at most
# this many tokens bound that (210 MB at a 102,400-token vocabulary)
ALL_LOGITS_CHUNK = 512
_POOLED_ALLOCATOR = 2
# TVM's paged cache appends decode tokens *after* attention (so absorbed-only decode would miss
# the new token) when, at the last block depth, the batch's pages over the pages of its coalesced
# (consecutive equal) blocks reach 32 (attn_utils.h GetChunkedBlockIds). Only sequences that
# share pages (forks) coalesce, and the ratio is at most the number of them in the step: a
# step with 32 or more of them is split into groups of at most this many sequences.
MAX_DECODE_GROUP = 31
# Decode steps of at least this many sequences run ``batch_decode_expert_major`` (each expert the
# batch selects read once, on tensor cores) where the build has it; fewer run the fused per-token
# MoE kernels, the faster ones up to batch 8 (docs/benchmarks.md, "Decode batches").
EXPERT_MAJOR_FROM = 16
# From GEMM_DECODE_FROM (memory_plan, which counts its workspace) sequences a decode step runs
# ``batch_decode_gemm`` (the prefill path's GEMMs, the expert-major MoE kernels over the whole
# step, the decode path's attention) where the build has it (docs/benchmarks.md, "Decode
# batches").


def _shape(v: int) -> tvm_ffi.Shape:
    return tvm_ffi.Shape([int(v)])


def _pdl_port(build: BuildConfig, pdl: str | None) -> int | None:
    """The graph edge port for ``Engine(pdl=...)`` on ``build`` (None: plain edges)."""
    if pdl == "off" or (pdl is None and not build.pdl):
        return None
    name = pdl or "programmatic"
    if name not in PDL_PORTS:
        raise check.EngineOptionError(f"pdl={pdl!r}: use one of off, {', '.join(PDL_PORTS)}")
    if not build.pdl:
        raise BuildError(
            f"pdl={pdl!r} needs a build compiled with --pdl (its kernels wait for their "
            "predecessors); this one was not"
        )
    return PDL_PORTS[name]


class Engine(TextMixin):
    """A compiled DeepSeek-V2 model with its KV cache.

    ``model`` is a folder written by ``dsv2-mlc compile`` (:func:`dsv2_mlc.load` also opens
    checkpoints, compiling them on first use, and installed artifacts). ``context_window`` bounds
    one sequence (default: the model's maximum, capped at 4096); a prefill or decode step takes at
    most ``max_batch_size`` sequences; the live sequences share a page pool of ``kv_capacity``
    tokens (default: context_window x max_batch_size).
    """

    @reports_oom
    def __init__(
        self,
        model: str | Path,
        *,
        context_window: int | None = None,
        max_batch_size: int = 4,
        kv_capacity: int | None = None,
        prefill_chunk_size: int | None = None,
        lib_dir: str | Path | None = None,
        random_weights: int | None = None,
        cuda_graph: bool = True,
        pdl: str | None = None,
        overlap_steps: bool = True,
        expert_major_from: int | None = EXPERT_MAJOR_FROM,
        gemm_decode_from: int | None = GEMM_DECODE_FROM,
        swap_decode_from: int | None = SWAP_DECODE_FROM,
        verify: bool = False,
        experts: str | None = None,
        gpu_memory: int | str | None = None,
    ):
        """``random_weights=SEED`` creates deterministic random weights on the device instead of
        reading ``params/`` (required for builds made with ``--random-weights``; see
        :mod:`dsv2_mlc.runtime.random_params`). ``cuda_graph`` (CUDA builds): replay decode steps
        from captured CUDA graphs (:mod:`dsv2_mlc.runtime.cuda_graph`).

        ``prefill_chunk_size``: the most tokens one prefill call takes (longer prompts go in
        chunks); default :data:`DEFAULT_PREFILL_CHUNK` of the build's device, at most
        ``kv_capacity``.

        ``pdl``: how the kernels of a decode graph are linked in a build compiled with ``--pdl``
        (:mod:`dsv2_mlc.runtime.pdl`): ``"programmatic"`` (the default for such builds),
        ``"launch-completion"``, or ``"off"`` (plain edges, the only choice for other builds).

        ``overlap_steps``: greedy generation (:meth:`generate`, :meth:`stream`, chat, the HTTP
        server) launches each decode step as soon as the previous step's token is known
        (:meth:`launch_greedy` with ``follow``), so the host's per-token work (detokenizing,
        stop checks, streaming the text) overlaps the device; False: each step waits for it.

        ``expert_major_from``: decode steps of at least this many sequences run the MoE blocks'
        expert-major kernels (``batch_decode_expert_major``, CUDA builds that have it: each
        expert the batch selects read once); None: never (the fused per-token kernels).
        ``gemm_decode_from``: decode steps of at least this many sequences run
        ``batch_decode_gemm`` (builds that have it; on CUDA the projections and experts as
        GEMMs on tensor cores, each weight read once for the step); None: never.
        ``swap_decode_from``: decode steps of at least this many sequences run
        ``batch_decode_swap`` (sm_90 builds that have it: ``batch_decode_gemm`` with the routed
        experts as grouped GEMMs over tiles of a few tokens); None: never.

        Before anything is loaded the folder is checked against the sizes and SHA-256 recorded
        when it was made (:mod:`dsv2_mlc.runtime.integrity`: the library and the weight index
        hashed, the weight files' sizes); ``verify``: the weight files hashed too.

        ``experts``: where the routed experts' weights live (:mod:`dsv2_mlc.runtime.placement`):
        ``"gpu"`` in device memory with the rest; ``"host"`` in pinned host memory that the same
        kernels read over PCIe (:mod:`dsv2_mlc.runtime.host_memory`: the same tokens, ~7 GB less
        device memory for V2-Lite INT4, each token's expert reads crossing PCIe). On a CPU build
        both are host memory; ``"host"`` still allocates and loads the experts apart. None:
        ``"gpu"``, or where the memory plan puts them.

        ``gpu_memory`` (bytes, or text such as ``"4GiB"``): plan the engine inside this budget
        before anything is loaded (:mod:`dsv2_mlc.runtime.memory_plan`; :attr:`memory_plan`,
        None without one): it picks ``prefill_chunk_size`` unless given, and refuses a budget
        that cannot hold ``kv_capacity`` tokens with the breakdown and what would fit."""
        self.path = Path(model)
        self.overlap_steps = overlap_steps
        self.build = BuildConfig.read(self.path)
        self.config = ModelInfo.from_build(self.build)  # vocabulary, context limit, EOS
        self.device = self.build.device
        port = _pdl_port(self.build, pdl)
        if experts is not None:
            check.expert_placement(experts)
        limit = self.config.max_position_embeddings
        window = check.positive_option("context_window", context_window, limit, optional=True)
        self.context_window = window or min(limit, 4096)
        self.max_batch_size = check.positive_option(
            "max_batch_size", max_batch_size, check.MAX_BATCH_SIZE
        )
        self.kv_capacity = check.positive_option(
            "kv_capacity", kv_capacity, check.MAX_KV_CAPACITY, optional=True
        ) or min(self.context_window * self.max_batch_size, check.MAX_KV_CAPACITY)
        check.positive_option(
            "prefill_chunk_size", prefill_chunk_size, check.MAX_KV_CAPACITY, optional=True
        )
        self.memory_plan = None if gpu_memory is None else plan_engine(
            self.path, self.build, gpu_memory, self.context_window, self.max_batch_size,
            kv_capacity, prefill_chunk_size, DEFAULT_PREFILL_CHUNK[self.device], cuda_graph,
            experts,
        )  # fmt: skip
        if self.memory_plan is not None:
            prefill_chunk_size = self.memory_plan.prefill_chunk_size
            experts = self.memory_plan.experts
        self.experts = experts or "gpu"
        self.prefill_chunk_size = prefill_chunk_size or min(
            DEFAULT_PREFILL_CHUNK[self.device], self.kv_capacity
        )

        verify_build(self.path, self.build, full=verify)  # before any of its files is loaded
        bundled = self.path / "lib"  # an installed artifact carries its own TVM runtime
        if lib_dir is None and (bundled / "libtvm_runtime.so").is_file():
            lib_dir = bundled
        load_runtime(self.device, lib_dir)
        lib_path = (self.path / LIBRARY).resolve()
        if not lib_path.is_file():
            raise BuildError(f"{lib_path}: compiled library missing; compile the model again")
        try:
            library = tvm_ffi.load_module(str(lib_path))
            vm = library["vm_load_executable"]()
        except Exception as err:  # the loader raises plain RuntimeErrors from C++
            raise BuildError(f"{lib_path}: cannot load ({err}); compile the model again") from err
        if self.build.gemm == "cublas":
            init_cublas()  # the library's prefill GEMMs call cuBLAS (runtime/cublas.py)
        dev = _DEVICE_TYPE[self.device]
        vm["vm_initialization"](dev, 0, _POOLED_ALLOCATOR, 1, 0, _POOLED_ALLOCATOR)
        if self.build.gemm == "cublas":
            set_cublas_workspace(0)  # graphs of its GEMMs then hold no allocation nodes
        self._vm = vm
        self._host = HostWeights(self.device) if self.experts == "host" else None
        if random_weights is None:
            self._params = self._load_params(dev)
        else:
            from .random_params import create_random_params

            spec = read_spec(self.path)
            self._params = create_random_params(
                library, spec, self.device, random_weights, host=self._host
            )
        self.random_weights = random_weights
        self._fn = {name: vm[name] for name in ("batch_prefill", "batch_extend", "batch_decode")}
        # the decode entries for larger batches, each from a batch size where the build has it
        # (batch_decode_expert_major: CUDA builds; batch_decode_gemm: every build since it
        # exists; batch_decode_swap: sm_90 builds with INT4 experts)
        self._major_from = self._entry_from(vm, "batch_decode_expert_major", expert_major_from)
        self._gemm_from = self._entry_from(vm, "batch_decode_gemm", gemm_decode_from)
        self._swap_from = self._entry_from(vm, "batch_decode_swap", swap_decode_from)
        # the device arg-max (``greedy_tokens``); builds compiled before it have none
        self._greedy = vm["greedy_tokens"] if vm.implements_function("greedy_tokens") else None
        self._kv_state = {
            name: global_func(f"vm.builtin.kv_state_{name}")
            for name in (
                "add_sequence",
                "remove_sequence",
                "fork_sequence",
                "popn",
                "begin_forward",
                "end_forward",
                "clear",
            )
        }
        # the page pool: kv_capacity tokens, plus a page for each sequence of a full batch (each
        # sequence fills whole pages: its last one partly)
        pool = self.kv_capacity + PAGE_SIZE * max_batch_size
        self._pool_pages = -(-pool // PAGE_SIZE)
        self._cache = vm["create_paged_kv_cache"](
            _shape(max_batch_size),
            _shape(pool),
            _shape(self.prefill_chunk_size),
            _shape(PAGE_SIZE),
            _shape(0),
        )
        self._seq_len: dict[int, int] = {}
        self._shared: set[int] = set()  # sequences that share pages (forks): no graphs
        self._inflight: PendingTokens | None = None  # a launched greedy step (launch_greedy)
        self._ahead: list[int] | None = None  # sequences whose next step was begun ahead
        # a step launched by a ``follow`` before its caller asked for it: (seq_ids, ids, tokens)
        self._followed: tuple[list[int], np.ndarray, PendingTokens] | None = None
        use_graphs = cuda_graph and self.device == "cuda"
        self._graphs = DecodeGraphs(self.device, pdl_port=port) if use_graphs else None
        self._query_positions = global_func("vm.builtin.attention_kv_cache_get_query_positions")
        self._available_pages = global_func("vm.builtin.attention_kv_cache_get_num_available_pages")
        self._cudart: Any = None  # CudaRuntime, opened on the first device_memory_used()
        self._ids = itertools.count()
        self._tokenizer: Tokenizer | None = None
        self._chat: ChatNamespace | None = None

    def named_params(self) -> list[tuple[str, tvm_ffi.Tensor]]:
        """The model's parameters as (name, device tensor), in the compiled layout."""
        return list(zip(self.build.param_names, self._params, strict=True))

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the loaded weights by where they live: ``{"gpu": n, "host": n}`` ("gpu":
        the build's device memory, all of it on a CPU build; "host": the routed experts placed
        with ``experts="host"``)."""
        host = set(self._host.names) if self._host is not None else set()
        return placed_bytes(self.named_params(), host)

    def _load_params(self, dev: int) -> tvm_ffi.Array:
        params_dir = (self.path / PARAMS_DIR).resolve()
        if not (params_dir / "tensor-cache.json").is_file():
            if has_spec(self.path):
                raise BuildError(
                    f"{self.path}: a config-only build (compiled with --random-weights) has no "
                    "weights to read; open it with random weights (Engine(..., random_weights="
                    "SEED), dsv2-mlc bench --seed)"
                )
            raise BuildError(f"{params_dir}: converted weights missing; compile the model again")
        if self._host is not None:
            return load_params_placed(params_dir, self.build.param_names, self.device, self._host)
        global_func("vm.builtin.tensor_cache.load")(str(params_dir), dev, 0)
        try:
            params = global_func("vm.builtin.param_array_from_cache_by_name")(
                list(self.build.param_names)
            )
        finally:
            global_func("vm.builtin.tensor_cache.clear")()
        return params

    # -- sequences ------------------------------------------------------------------------------
    def add_sequence(self) -> int:
        """Start an empty sequence; returns its id."""
        self.settle()
        seq = next(self._ids)
        self._kv_state["add_sequence"](self._cache, seq)
        self._seq_len[seq] = 0
        return seq

    def remove_sequence(self, seq: int) -> None:
        """Drop a sequence and free its pages."""
        seq = check.live_sequence(seq, self._seq_len)
        self.settle()
        self._kv_state["remove_sequence"](self._cache, seq)
        del self._seq_len[seq]
        self._shared.discard(seq)

    def fork_sequence(self, parent: int, fork_pos: int = -1) -> int:
        """A new sequence sharing ``parent``'s first ``fork_pos`` tokens (-1: all of them)."""
        parent = check.live_sequence(parent, self._seq_len)
        self.settle()
        fork_pos = check.fork_position(fork_pos, self._seq_len[parent])
        child = next(self._ids)
        self._kv_state["fork_sequence"](self._cache, parent, child, fork_pos)
        self._shared.update((parent, child))
        length = self._seq_len[parent]
        self._seq_len[child] = length if fork_pos < 0 else min(fork_pos, length)
        return child

    def popn(self, seq: int, n: int) -> None:
        """Remove the last ``n`` tokens of a sequence."""
        seq = check.live_sequence(seq, self._seq_len)
        self.settle()
        if not check._is_int(n) or not 0 <= n <= self._seq_len[seq]:
            raise check.SequenceError(
                f"cannot pop {n!r} tokens from a sequence of {self._seq_len[seq]}"
            )
        self._kv_state["popn"](self._cache, seq, n)
        self._seq_len[seq] -= n

    def sequence_length(self, seq: int) -> int:
        """Tokens cached for ``seq`` (a followed step nobody has asked for yet not counted)."""
        seq = check.live_sequence(seq, self._seq_len)
        ahead = self._followed is not None and seq in self._followed[0]
        return self._seq_len[seq] - int(ahead)

    def free_pages(self) -> int:
        """Pages of the KV cache's pool no sequence holds (:attr:`total_pages` in all)."""
        return int(self._available_pages(self._cache))

    @property
    def total_pages(self) -> int:
        """Pages in the KV cache's pool: ``kv_capacity`` tokens plus one page a sequence of a
        full batch."""
        return self._pool_pages

    def live_sequences(self) -> list[int]:
        """Ids of the sequences that exist (added or forked, not removed)."""
        return list(self._seq_len)

    def device_memory_used(self) -> int | None:
        """Bytes of device memory in use on this engine's device (``cudaMemGetInfo``: every
        process's, the CUDA context included); None on the CPU or when it cannot be read."""
        if self.device != "cuda":
            return None
        if self._cudart is None:
            from .cudart import CudaRuntime

            try:
                self._cudart = CudaRuntime()
            except RuntimeError:
                return None
        got = self._cudart.memory_used()
        return None if got is None else got[0]

    def reset(self) -> None:
        """Remove every sequence."""
        self.settle()
        self._kv_state["clear"](self._cache)
        self._seq_len.clear()
        self._shared.clear()

    def settle(self) -> None:
        """Wait for a greedy step launched by :meth:`launch_greedy`, undo a next step begun
        ahead and a followed step nobody asked for (every other call that touches the cache or
        the device does this first)."""
        self._wait_inflight()
        if self._ahead is not None:
            seqs, self._ahead = self._ahead, None
            for seq in seqs:  # begun, never run: the reserved slot goes back
                self._kv_state["popn"](self._cache, seq, 1)
        if self._followed is not None:
            seqs = self._followed[0]
            self._followed = None
            for seq in seqs:  # run on a token its caller did not keep: its KV entry goes
                self._kv_state["popn"](self._cache, seq, 1)
                self._seq_len[seq] -= 1

    def _wait_inflight(self) -> None:
        """Wait for a launched greedy step, if any (its tokens stay with its PendingTokens;
        it launches no followed step any more)."""
        if self._inflight is not None:
            pending, self._inflight = self._inflight, None
            pending._follow(None)
            pending.result()

    # -- forward --------------------------------------------------------------------------------
    def _check_room(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> None:
        # the KV cache's auxiliary arrays (page tables, positions) hold max_batch_size sequences
        if len(seq_ids) > self.max_batch_size:
            raise check.SequenceError(
                f"a step of {len(seq_ids)} sequences exceeds max_batch_size="
                f"{self.max_batch_size}; run them in smaller groups or open the engine with a "
                "larger max_batch_size"
            )
        # every live sequence's length after the step, in one pass (a followed step nobody asked
        # for is not counted: the step that is asked for undoes it)
        more = dict(zip(seq_ids, lengths, strict=True))
        after = {s: self.sequence_length(s) + more.get(s, 0) for s in self._seq_len}
        for seq in seq_ids:
            if after[seq] > self.context_window:
                raise ContextLengthError(
                    f"sequence {seq} would hold {after[seq]} tokens, more than the context "
                    f"window of {self.context_window}; shorten the prompt or raise context_window"
                )
        if sum(after.values()) > self.kv_capacity:
            raise ContextLengthError(
                f"the KV cache holds {self.kv_capacity} tokens in all; remove finished sequences "
                "or raise kv_capacity"
            )
        pages = sum(-(-n // PAGE_SIZE) for n in after.values())
        if pages > self._pool_pages:  # (a fork's shared pages are counted for each sequence)
            raise ContextLengthError(
                f"{len(after)} sequences would fill {pages} pages of {PAGE_SIZE} tokens, more "
                f"than the KV cache's {self._pool_pages}; remove finished sequences or raise "
                "kv_capacity"
            )

    @reports_oom
    def _forward(
        self, seq_ids: list[int], chunks: list[list[int]], all_logits: bool, greedy: bool = False
    ) -> np.ndarray:
        """One model call over one chunk per sequence; logits of the last (or every) token, or
        with ``greedy`` (decode steps, a build with ``greedy_tokens``) each sequence's arg-max
        token, picked on the device."""
        lengths = [len(c) for c in chunks]
        if greedy and any(n != 1 for n in lengths):
            raise check.TokenIdError("greedy steps take one token per sequence")
        if all(n == 1 for n in lengths) and self._split_decode(seq_ids):
            parts = range(0, len(seq_ids), MAX_DECODE_GROUP)
            return np.concatenate(
                [
                    self._forward(
                        seq_ids[i : i + MAX_DECODE_GROUP],
                        chunks[i : i + MAX_DECODE_GROUP],
                        False,
                        greedy,
                    )
                    for i in parts
                ]
            )
        ids = np.array([t for c in chunks for t in c], dtype=np.int32)  # checked by the caller
        if greedy:
            return self._greedy_step(seq_ids, ids, ahead=False).result()
        fresh = all(self._seq_len[s] == 0 for s in seq_ids)
        self._begin(seq_ids, lengths)
        try:
            if all(n == 1 for n in lengths):
                out = self._decode_call(seq_ids, ids.reshape(-1, 1))
            else:
                ends = np.cumsum(lengths)
                if all_logits:
                    pos = np.arange(ends[-1], dtype=np.int32)
                else:
                    pos = (ends - 1).astype(np.int32)
                fn = self._fn["batch_prefill" if fresh else "batch_extend"]
                out = fn(
                    to_device(ids.reshape(1, -1), self.device),
                    to_device(pos, self.device),
                    self._cache,
                    self._params,
                )
        finally:
            self._kv_state["end_forward"](self._cache)
        for seq, n in zip(seq_ids, lengths, strict=True):
            self._seq_len[seq] += n
        logits = to_numpy(out[0])  # a copy on the host, whatever the device
        return logits.reshape(-1, self.config.vocab_size)

    def _split_decode(self, seq_ids: Sequence[int]) -> bool:
        """Whether a decode step of ``seq_ids`` runs in groups of :data:`MAX_DECODE_GROUP`: it
        holds more than that many sequences that share pages."""
        if len(seq_ids) <= MAX_DECODE_GROUP:
            return False
        return len(self._shared.intersection(seq_ids)) > MAX_DECODE_GROUP

    def _begin(self, seq_ids: list[int], lengths: list[int]) -> None:
        """``begin_forward`` for one chunk per sequence: after :meth:`settle`, or nothing when
        this very step (one token for each of ``seq_ids``) was begun ahead."""
        if self._followed is not None:
            self.settle()  # a step other than the followed one (which is taken, never begun)
        if self._ahead == seq_ids and all(n == 1 for n in lengths):
            self._wait_inflight()  # the cache copies this step's page tables after it
            self._ahead = None
            return
        self.settle()
        self._begin_forward(seq_ids, lengths)

    def _begin_forward(self, seq_ids: list[int], lengths: list[int]) -> None:
        self._kv_state["begin_forward"](self._cache, tvm_ffi.Shape(seq_ids), tvm_ffi.Shape(lengths))

    @reports_oom
    def _greedy_step(self, seq_ids: list[int], ids: np.ndarray, ahead: bool) -> PendingTokens:
        """One begun-to-ended greedy decode step (``ids`` int32 ``[b]``, already checked); a
        replay of a verified graph is left running (:attr:`_inflight`). With ``ahead``, the
        next step (one more token for each sequence) is begun while it runs, if it fits."""
        self._begin(seq_ids, [1] * len(seq_ids))
        try:
            wait = self._launch_greedy(seq_ids, ids.reshape(-1, 1))
        finally:
            self._kv_state["end_forward"](self._cache)  # host-side: the replay may still run
        for seq in seq_ids:
            self._seq_len[seq] += 1
        pending = PendingTokens(wait)
        self._inflight = pending
        if ahead and self._fits(seq_ids):
            # host-only page bookkeeping, overlapping the device; the page tables are copied
            # to the device only when the step is launched, after this one has completed
            self._begin_forward(seq_ids, [1] * len(seq_ids))
            self._ahead = list(seq_ids)
            key = self._next_key(seq_ids)
            if key is not None:  # its graph moved to its page bucket now, not at its launch
                assert self._graphs is not None
                self._graphs.prepare((*key, "greedy"), True)
        return pending

    def _fits(self, seq_ids: list[int]) -> bool:
        """Whether one more token for each of ``seq_ids`` fits (:meth:`_check_room`)."""
        try:
            self._check_room(seq_ids, [1] * len(seq_ids))
        except ContextLengthError:
            return False
        return True

    def _launch_greedy(self, seq_ids: list[int], ids: np.ndarray) -> Callable[[], np.ndarray]:
        """A begun greedy step (the device arg-max right after ``batch_decode``; on CUDA in the
        same graph, whose key is marked ``"greedy"`` and which copies the ids in and the tokens
        out through pinned host memory): the replay of a verified graph launched (the result
        waits for it), else the step run through (the result returns its tokens, int64)."""
        if self._greedy is None:
            raise RuntimeError("this build has no greedy_tokens function")
        greedy_fn = self._greedy

        def call(ids_t: tvm_ffi.Tensor) -> Any:
            out = self._batch_decode(ids_t)
            return out[0], greedy_fn(out[0])  # logits first: the graphs' replay check

        key = self._graph_key(seq_ids)
        if key is None:
            tokens = to_numpy(call(to_device(ids, self.device))[1]).astype(np.int64)
        else:
            graphs, key = self._graphs, (*key, "greedy")
            assert graphs is not None
            graph = graphs.launch_greedy(key, ids)
            if graph is not None:
                return functools.partial(graphs.wait_greedy, graph)
            upload = functools.partial(to_device, device=self.device)
            tokens = graphs.run_greedy(key, ids, call, upload, same_greedy)
        return lambda: tokens

    def _decode_call(self, seq_ids: list[int], ids: np.ndarray) -> Any:
        """``batch_decode`` for a begun step: from a CUDA graph where one applies."""
        key = self._graph_key(seq_ids)
        if key is None:
            return self._batch_decode(to_device(ids, self.device))
        assert self._graphs is not None
        upload = functools.partial(to_device, device=self.device)
        return self._graphs.run(key, ids, self._batch_decode, upload, copy_into, same_logits)

    def _entry_from(self, vm: Any, name: str, first: int | None) -> int | None:
        """The smallest decode batch that runs the entry ``name`` (``first``; None where the
        build lacks it or ``first`` is None), its function kept in ``self._fn``."""
        option = {"batch_decode_expert_major": "expert_major_from",
                  "batch_decode_gemm": "gemm_decode_from",
                  "batch_decode_swap": "swap_decode_from"}[name]  # fmt: skip
        if first is not None and first < 1:
            raise check.EngineOptionError(f"{option} must be at least 1 (got {first})")
        if first is None or not vm.implements_function(name):
            return None
        self._fn[name] = vm[name]
        return first

    def _batch_decode(self, ids_t: tvm_ffi.Tensor) -> Any:
        batch, start, gemm = ids_t.shape[0], self._major_from, self._gemm_from
        name = "batch_decode" if start is None or batch < start else "batch_decode_expert_major"
        if gemm is not None and batch >= gemm:
            name = "batch_decode_gemm"
        if self._swap_from is not None and batch >= self._swap_from:
            name = "batch_decode_swap"
        return self._fn[name](ids_t, self._cache, self._params)

    def _graph_key(self, seq_ids: list[int]) -> tuple[int, int] | None:
        """The decode graph key of a begun step (its page tables copied to the device now,
        outside any graph); None where no graph applies (CPU, graphs off, shared pages)."""
        key = self._next_key(seq_ids)
        if key is not None:
            self._query_positions(self._cache)
        return key

    def _next_key(self, seq_ids: list[int]) -> tuple[int, int] | None:
        """The decode graph key of the sequences' begun step, from the host's lengths alone
        (nothing copied); None where no graph applies (CPU, graphs off, shared pages)."""
        if self._graphs is None or self._shared.intersection(seq_ids):
            return None
        return decode_graph_key(PAGE_SIZE, [self._seq_len[s] + 1 for s in seq_ids])

    @property
    def expert_major_from(self) -> int | None:
        """The smallest decode batch that runs the MoE blocks' expert-major kernels
        (``batch_decode_expert_major``); None: none does (a build without it, or turned off)."""
        return self._major_from

    @property
    def gemm_decode_from(self) -> int | None:
        """The smallest decode batch that runs ``batch_decode_gemm``; None: none does."""
        return self._gemm_from

    @property
    def swap_decode_from(self) -> int | None:
        """The smallest decode batch that runs ``batch_decode_swap``; None: none does."""
        return self._swap_from

    @property
    def cuda_graph_stats(self) -> dict[str, float] | None:
        """Decode graphs captured / replayed / failed (None: graphs off or not CUDA)."""
        return None if self._graphs is None else dict(self._graphs.stats)

    def prefill(
        self, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]], all_logits: bool = False
    ) -> list[np.ndarray]:
        """Append tokens to sequences (chunked by ``prefill_chunk_size``; by at most
        :data:`ALL_LOGITS_CHUNK` with ``all_logits``).

        Returns, per sequence, the float32 logits of its last token ``[vocab]``, or of every new
        token ``[len, vocab]`` with ``all_logits``.
        """
        seq_ids = check.sequence_ids(seq_ids, self._seq_len)
        check.same_length(seq_ids, token_lists, "token lists")
        vocab = self.config.vocab_size
        lists = [check.token_ids(t, vocab, "each token list") for t in token_lists]
        if any(len(t) == 0 for t in lists):
            raise check.TokenIdError("every sequence needs at least one token to prefill")
        self._check_room(seq_ids, [len(t) for t in lists])
        pending = dict(zip(seq_ids, lists, strict=True))
        collected: dict[int, list[np.ndarray]] = {s: [] for s in seq_ids}
        while any(pending.values()):
            budget = self.prefill_chunk_size
            if all_logits:
                budget = min(budget, ALL_LOGITS_CHUNK)
            batch, chunks = [], []
            for s in seq_ids:
                if pending[s] and budget > 0:
                    take = pending[s][:budget]
                    pending[s] = pending[s][len(take) :]
                    budget -= len(take)
                    batch.append(s)
                    chunks.append(take)
            want_all = all_logits and not all(len(c) == 1 for c in chunks)
            logits = self._forward(batch, chunks, want_all)
            if want_all:
                ends = np.cumsum([len(c) for c in chunks])
                for s, end, c in zip(batch, ends, chunks, strict=True):
                    collected[s].append(logits[end - len(c) : end])
            else:
                for s, row in zip(batch, logits, strict=True):
                    collected[s].append(row[None])
        if all_logits:
            return [np.concatenate(collected[s]) for s in seq_ids]
        return [collected[s][-1][0] for s in seq_ids]

    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Append one token to each sequence; returns float32 logits ``[len(seq_ids), vocab]``."""
        seq_ids, tokens = self._step_args(seq_ids, tokens)
        self._check_room(seq_ids, [1] * len(seq_ids))
        return self._forward(seq_ids, [[t] for t in tokens], all_logits=False)

    def _step_args(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> tuple[list, list]:
        """A decode step's sequences (live, each once) and tokens (one in the vocabulary each)."""
        seq_ids = check.sequence_ids(seq_ids, self._seq_len)
        tokens = check.token_ids(tokens, self.config.vocab_size, "tokens")
        check.same_length(seq_ids, tokens, "tokens")
        if not seq_ids:
            raise check.SequenceError("a decode step needs at least one sequence")
        return seq_ids, tokens

    @property
    def has_device_greedy(self) -> bool:
        """Whether :meth:`decode_greedy` picks the tokens on the device (the build has the
        ``greedy_tokens`` function; older builds fall back to the host)."""
        return self._greedy is not None

    def decode_greedy(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """:meth:`decode`, then the arg-max of each sequence's logits (``np.argmax``: ties to
        the lowest id): the next token ids, int64 ``[len(seq_ids)]``. The arg-max runs on the
        device and only the ids are copied back (on CUDA inside the decode step's graph); a
        build without ``greedy_tokens`` copies the logits and takes the arg-max on the host."""
        if self._greedy is None:
            return self.decode(seq_ids, tokens).argmax(-1)
        seq_ids, tokens = self._step_args(seq_ids, tokens)
        self._check_room(seq_ids, [1] * len(seq_ids))
        return self._forward(seq_ids, [[t] for t in tokens], all_logits=False, greedy=True)

    def launch_greedy(
        self,
        seq_ids: Sequence[int],
        tokens: Sequence[int],
        next_step: bool = True,
        follow: bool = False,
    ) -> PendingTokens:
        """:meth:`decode_greedy`, returning as soon as the step runs on the device: its
        :meth:`~PendingTokens.result` waits for the tokens. Meanwhile the host may do its own
        work; with ``next_step`` (the caller will decode these sequences again, one token each)
        the KV cache's host bookkeeping of that step is done now too, overlapping the device.
        Any other call that touches the cache waits for the step first and undoes a next step
        begun ahead (:meth:`settle`). Only a replay of a verified CUDA graph runs on; other
        steps (CPU, eager, first replays) complete before this returns.

        ``follow`` (with ``next_step``): moreover, :meth:`~PendingTokens.result` launches that
        next step on the tokens it returns, right after its wait, before the caller's own work
        (streaming the text, checking stop conditions) delays the device. The caller's next
        ``launch_greedy`` with exactly those tokens returns the running step; anything else
        (other tokens or sequences, any call that touches the cache) first undoes it."""
        seq_ids, tokens = self._step_args(seq_ids, tokens)
        if follow and not next_step:
            raise check.EngineOptionError("follow launches the next step: it needs next_step")
        if self._greedy is None or self._split_decode(seq_ids):
            tokens_now = self.decode_greedy(seq_ids, tokens)
            return PendingTokens(lambda: tokens_now)
        pending = self._claim_followed(seq_ids, tokens)
        if pending is None:
            if self._ahead != seq_ids:  # a step begun ahead was checked for room then
                self._check_room(seq_ids, [1] * len(seq_ids))
            ids = np.array(tokens, dtype=np.int32)
            pending = self._greedy_step(seq_ids, ids, ahead=next_step)
        if follow:
            pending._follow(functools.partial(self._launch_followed, seq_ids))
        return pending

    def _claim_followed(self, seq_ids: list[int], tokens: Sequence[int]) -> PendingTokens | None:
        """The followed step, if it is the one asked for (same sequences, same tokens); else
        None, the followed step (if any) undone."""
        if self._followed is None:
            return None
        seqs, ids, pending = self._followed
        if seqs != seq_ids or ids.tolist() != [int(t) for t in tokens]:
            self.settle()
            return None
        self._followed = None
        return pending

    def _launch_followed(self, seq_ids: list[int], tokens: np.ndarray) -> None:
        """Launch the step begun ahead on ``tokens`` (the device's arg-max of the step that
        just completed, so within the vocabulary); it begins its own next step ahead."""
        if self._ahead != seq_ids:  # it did not fit, or the caller did something else
            return
        ids = tokens.astype(np.int32)
        self._followed = (seq_ids, ids, self._greedy_step(seq_ids, ids, ahead=True))
