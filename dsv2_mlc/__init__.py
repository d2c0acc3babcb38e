"""dsv2-mlc: a kernel-first compiler and runtime for the DeepSeek-V2 model family on Apache TVM."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .version import __version__

__all__ = [
    "ChatSession",
    "Engine",
    "GenerationResult",
    "GenerationStream",
    "SamplingParams",
    "StreamDelta",
    "Tokenizer",
    "__version__",
    "load",
]

if TYPE_CHECKING:
    from .runtime.chat import ChatSession
    from .runtime.engine import Engine, GenerationResult, GenerationStream, StreamDelta
    from .runtime.sampling import SamplingParams
    from .runtime.tokenizer import Tokenizer

_LAZY = {
    "Engine": "engine",
    "GenerationResult": "engine",
    "GenerationStream": "engine",
    "StreamDelta": "engine",
    "ChatSession": "chat",
    "SamplingParams": "sampling",
    "Tokenizer": "tokenizer",
}


def load(model: str | None = None, **kwargs: Any) -> Engine:
    """Open MODEL (a checkpoint folder, compiled on first use and cached; a compiled folder; an
    installed artifact's name; or ``None`` for the embedded default model); keyword arguments go to
    :func:`dsv2_mlc.resolve.open_engine` (cache_dir, device, dtype, quantization, context_window,
    max_batch_size, prefill_chunk_size, progress, log, verify: hash the weights too, kv_dtype:
    "fp8" for an e4m3 KV cache)."""
    from .resolve import open_engine

    return open_engine(model, **kwargs)


def __getattr__(name: str) -> Any:
    # Lazy, so `import dsv2_mlc` stays cheap and never loads TVM by itself.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".runtime.{_LAZY[name]}", __name__), name)
    raise AttributeError(name)
