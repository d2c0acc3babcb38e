"""Every error class of dsv2-mlc derives from the one base, ``dsv2_mlc.errors.Dsv2Error``, so
``except Dsv2Error`` (the CLI's, the chat REPL's) catches all of them."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import dsv2_mlc
from dsv2_mlc.errors import Dsv2Error


def _project_errors() -> list[type[BaseException]]:
    found = []
    for info in pkgutil.walk_packages(dsv2_mlc.__path__, "dsv2_mlc."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == info.name:
                found.append(obj)
    return found


def test_every_project_error_derives_from_dsv2error():
    errors = _project_errors()
    names = {e.__name__ for e in errors}
    # the walk reaches every layer (a check that cannot pass on an empty list)
    assert {"ConfigError", "BuildError", "ContextLengthError", "ArtifactError"} <= names
    assert {"CompileError", "ModelNotFoundError", "BrokenGraphError"} <= names
    assert [e.__name__ for e in errors if not issubclass(e, Dsv2Error)] == []


def test_errors_keep_their_standard_bases():
    from dsv2_mlc.artifacts.errors import ArtifactError
    from dsv2_mlc.layout import BuildError
    from dsv2_mlc.model.config import ConfigError
    from dsv2_mlc.runtime.tvm_runtime import RuntimeLibraryError

    assert issubclass(ConfigError, ValueError) and issubclass(BuildError, ValueError)
    assert issubclass(ArtifactError, ValueError)
    assert issubclass(RuntimeLibraryError, RuntimeError)
