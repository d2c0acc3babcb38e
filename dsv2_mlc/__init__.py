"""dsv2-mlc: a kernel-first compiler and runtime for the DeepSeek-V2 model family on Apache TVM."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "GenerationResult", "__version__"]

if TYPE_CHECKING:
    from .runtime.engine import Engine, GenerationResult


def __getattr__(name: str) -> Any:
    # Lazy, so `import dsv2_mlc` stays cheap and never loads TVM by itself.
    if name in ("Engine", "GenerationResult"):
        from .runtime import engine

        return getattr(engine, name)
    raise AttributeError(name)
