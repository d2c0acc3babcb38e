"""The errors a user can cause (bad input, not bugs): the CLI prints them as one line."""

from __future__ import annotations

from .artifacts.errors import ArtifactError
from .model.checkpoint import CheckpointError
from .model.config import ConfigError
from .model.weights import WeightMapError
from .quant import QuantizationError
from .runtime.chat_template import ChatTemplateError
from .runtime.engine import ContextLengthError, PromptError
from .runtime.layout import BuildError
from .runtime.model_cache import ModelNotFoundError
from .runtime.sampling import SamplingError
from .runtime.tokenizer import TokenizerError
from .runtime.tvm_runtime import RuntimeLibraryError


class UsageError(ValueError):
    """A request the library cannot honour (unknown option value, unsupported combination)."""


USER_ERRORS: tuple[type[BaseException], ...] = (
    UsageError,
    QuantizationError,
    ConfigError,
    CheckpointError,
    WeightMapError,
    BuildError,
    ContextLengthError,
    RuntimeLibraryError,
    SamplingError,
    TokenizerError,
    ChatTemplateError,
    ModelNotFoundError,
    PromptError,
    ArtifactError,
)
