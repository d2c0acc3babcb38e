"""``dsv2-mlc chat``: an interactive REPL (or one ``--prompt`` answer) on a :class:`ChatSession`.

Replies stream to stdout as they are produced, one flush per delta; the banner, prompts and notes
go to stderr, so stdout carries only the answers and the output of commands. Input that is not
UTF-8 (a line on stdin, ``--prompt``, ``--system``) has each undecodable byte replaced by U+FFFD,
with a note, so such a line never ends the conversation.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .errors import Dsv2Error
from .resolve import open_engine
from .runtime.chat import ChatSession
from .runtime.sampling import SamplingParams

HELP = """\
Type a message and press Enter; the reply streams back. A line ending in \\ continues on the next.
Commands:
  /help   this help
  /stats  prefill and decode speed of the last reply, context used
  /reset  start a new conversation (frees the cache)
  /exit   leave (Ctrl-D too)
A line starting with // sends the text after the first /."""

_UNDECODABLE = re.compile("[\ud800-\udfff]")  # bytes that are not UTF-8, as surrogateescape keeps
REPLACEMENT = "\ufffd"


def replace_undecodable(text: str) -> tuple[str, int]:
    """``text`` with each byte that was not UTF-8 replaced by U+FFFD, and how many there were.

    Python decodes argv, and stdin in the C / POSIX locales (and here, see :class:`ChatRepl`), with
    ``surrogateescape``: such a byte arrives as a lone surrogate, which the tokenizer rejects.
    """
    return _UNDECODABLE.subn(REPLACEMENT, text)


def _undecodable_note(where: str, count: int) -> str:
    return f"({where} held {count} bytes that are not UTF-8; each was replaced by U+FFFD)"


@dataclass
class ChatOptions:
    """What ``dsv2-mlc chat`` was asked to do (sampling values left ``None`` use the model's
    defaults)."""

    model: str | Path | None = None
    prompt: str | None = None
    system: str | None = None
    cache_dir: str | Path | None = None
    device: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    context_window: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    verify: bool = False  # hash the weight files too before loading them
    experts: str | None = None  # "gpu" or "host" (Engine(experts=...)); None: gpu or the plan
    gpu_memory: str | int | None = None  # plan the engine inside this budget (memory_plan)


def run_chat(
    options: ChatOptions,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Open the model, then answer ``options.prompt`` or run the REPL; returns the exit status."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    explicit = {k: v for k, v in options.sampling.items() if v is not None}
    SamplingParams(**explicit)  # reject bad values before the (slow) model load

    def note(msg: str) -> None:
        print(msg, file=stderr, flush=True)

    def clean(text: str | None, where: str) -> str | None:
        if text is None:
            return None
        text, bad = replace_undecodable(text)
        if bad:
            note(_undecodable_note(where, bad))
        return text

    prompt, system = clean(options.prompt, "--prompt"), clean(options.system, "--system")

    engine = open_engine(
        options.model,
        cache_dir=options.cache_dir,
        device=options.device,
        dtype=options.dtype,
        quantization=options.quantization,
        context_window=options.context_window,
        max_batch_size=1,
        progress=True,
        log=note,
        verify=options.verify,
        experts=options.experts,
        gpu_memory=options.gpu_memory,
    )
    if engine.memory_plan is not None:
        note(engine.memory_plan.table())
    sampling = SamplingParams.from_generation_config(engine.path).updated(**explicit)
    session = ChatSession(engine, system=system, sampling=sampling)
    repl = ChatRepl(session, stdin, stdout, stderr)
    if prompt is not None:
        repl.answer(prompt)
        return 0
    return repl.run()


class ChatRepl:
    """Reads lines, runs turns and slash commands, writes replies."""

    def __init__(self, session: ChatSession, stdin: TextIO, stdout: TextIO, stderr: TextIO):
        self.session = session
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.interactive = stdin is sys.stdin and stdin.isatty()
        if isinstance(stdin, io.TextIOWrapper):
            # keep undecodable bytes (as lone surrogates) instead of raising UnicodeDecodeError
            # and losing the conversation; run() replaces them with U+FFFD
            with contextlib.suppress(ValueError, io.UnsupportedOperation):
                stdin.reconfigure(errors="surrogateescape")
        if self.interactive:
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:  # pragma: no cover
                pass
        self.commands: dict[str, Callable[[], bool]] = {
            "/help": self._help,
            "/stats": self._stats,
            "/reset": self._reset,
            "/exit": lambda: False,
            "/quit": lambda: False,
        }

    def _note(self, msg: str) -> None:
        print(msg, file=self.stderr, flush=True)

    def banner(self) -> str:
        """What the session runs and how to use it."""
        eng = self.session.engine
        mode = "chat template" if self.session.use_template else "plain completion (base model)"
        return (
            f"dsv2-mlc chat: {eng.path.name} ({eng.device}, {eng.build.dtype}), "
            f"context window {eng.context_window} tokens, {mode}. /help for commands, Ctrl-D "
            "to exit."
        )

    def _read(self, prompt: str) -> str | None:
        """One line without its newline; ``None`` at end of input."""
        if self.interactive:
            try:
                return input(prompt)
            except EOFError:
                return None
        line = self.stdin.readline()
        return None if line == "" else line.rstrip("\n").rstrip("\r")

    def _read_message(self) -> str | None:
        first = self._read(">>> ")
        if first is None:
            return None
        lines = [first]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            more = self._read("... ")
            if more is None:
                break
            lines.append(more)
        return "\n".join(lines)

    def run(self) -> int:
        """The loop: until ``/exit`` or end of input."""
        self._note(self.banner())
        while True:
            try:
                text = self._read_message()
            except KeyboardInterrupt:
                if not self.interactive:
                    raise
                print(file=self.stderr)
                continue
            if text is None:
                if self.interactive:
                    print(file=self.stderr)
                return 0
            text, bad = replace_undecodable(text)
            if bad:
                self._note(_undecodable_note("the line", bad))
            if text.startswith("/") and not text.startswith("//"):
                command = self.commands.get(text.strip().split()[0] if text.strip() else text)
                if command is None:
                    self._note(f"unknown command {text.strip()!r}; /help lists the commands")
                elif not command():
                    return 0
                continue
            if text.startswith("//"):
                text = text[1:]
            if not text.strip():
                continue
            try:
                self.answer(text)
            except Dsv2Error as err:
                self._note(f"error: {err}")

    def answer(self, text: str) -> None:
        """Run one turn, streaming the reply to stdout."""
        stream = self.session.stream(text)
        try:
            for delta in stream:
                if delta.text:
                    self.stdout.write(delta.text)
                    self.stdout.flush()
        except KeyboardInterrupt:
            stream.close()
            if not self.interactive:
                raise
            self.stdout.write("\n")
            self._note("(interrupted)")
            return
        self.stdout.write("\n")
        self.stdout.flush()
        result = stream.result
        if result is not None and result.finish_reason == "length":
            full = self.session.context_used >= self.session.engine.context_window
            self._note("(context window full: /reset)" if full else "(max tokens reached)")

    def _help(self) -> bool:
        print(HELP, file=self.stdout, flush=True)
        return True

    def _stats(self) -> bool:
        print(self.session.stats.summary(), file=self.stdout, flush=True)
        return True

    def _reset(self) -> bool:
        self.session.reset()
        self._note("(new conversation)")
        return True
