"""``dsv2-mlc`` command line: argument parsing only; typed functions do the work."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from .errors import USER_ERRORS


def _compile(args: argparse.Namespace) -> int:
    from .compiler.compile import compile_model

    result = compile_model(
        args.model_dir,
        args.output,
        device=args.device,
        dtype=args.dtype,
        dump_ir=args.dump_ir,
        progress=not args.quiet,
    )
    print(f"compiled {args.model_dir} -> {result.out_dir} in {result.seconds:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    parser = argparse.ArgumentParser(
        prog="dsv2-mlc", description="Compile and run DeepSeek-V2 models with Apache TVM."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="compile a Hugging Face checkpoint folder")
    p.add_argument("model_dir", help="folder with config.json and *.safetensors")
    p.add_argument("-o", "--output", required=True, help="output folder (replaced atomically)")
    p.add_argument("--device", default="cpu", help="target device (default: cpu)")
    p.add_argument("--dtype", default="float32", help="float32 or float16 (default: float32)")
    p.add_argument("--dump-ir", default=None, help="write the IR after each pipeline phase here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_compile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dsv2-mlc`` console script."""
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except USER_ERRORS as err:
        print(f"dsv2-mlc {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
