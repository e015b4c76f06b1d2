"""The ``fxtp`` command line (also ``python -m fxtp``).

Examples::

    fxtp demo                                   # tiny GPT over 2 local gloo ranks, prints the report
    fxtp inspect llama --world-size 2           # the plan of a tiny Llama, as a table
    fxtp inspect mlp -n 2 --format graph        # rank 0's emitted code with placements
    fxtp inspect mlp -n 2 --format dot --out mlp.svg
    fxtp inspect path/to/config.json -n 8      # a Hugging Face config, on the meta device
    fxtp inspect path/to/checkpoint -n 8       # the config.json in a checkpoint directory
    fxtp inspect my_models.py:build -n 4 --input '2x16:int64[0,1000)' --verify

Exit status: 0 on success, 1 on an fxtp error (one message; ``--verbose`` adds the traceback),
2 on bad usage (a malformed argument or an impossible combination of them).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Any, Callable, Optional, Sequence

__all__ = ["get_args_parser", "main"]

_EPILOG = """\
examples:
  fxtp demo --world-size 4
  fxtp inspect llama --world-size 2
  fxtp inspect --help

exit status: 0 ok, 1 fxtp error (--verbose for the traceback), 2 bad usage
"""

_INSPECT_EPILOG = """\
MODEL:
  a built-in example:  mlp, tiny-gpt, transformer (torch's TP reference model), gpt2, llama,
                       bert, mixtral, qwen2-moe (tiny configs, random weights, real inputs);
                       gpt2-124m, llama-7b, llama-3-8b, mixtral-8x7b, qwen2-moe-a2.7b (full
                       size on the meta device: tables and graphs, no --verify);
                       all but mlp and tiny-gpt need: pip install 'fxtp[examples]'
  path/to/config.json  a Hugging Face config (its architectures / model_type), built on the
                       meta device: no weights, no download; example input: token ids (1, 128)
                       (shorter if its positions are fewer); needs fxtp[examples]
  path/to/checkpoint   a directory holding a config.json (a checkpoint's, as from_pretrained
                       takes it): that config, as above; a built-in name wins over a directory
                       of the same name (write ./NAME)
  package.module:callable, path/to/file.py:callable
                       the callable takes no arguments and returns an nn.Module or
                       (nn.Module, example_inputs); it runs after torch.manual_seed(0)

--input SPEC (one per positional input, replacing the example inputs; quote it in a shell):
  AxBxC[:dtype][[lo,hi)]   dtype defaults to float32 (randn); integer dtypes need a range
                           and draw from [lo,hi); values come from a generator seeded with 0
  2x16x64                  float32 (2, 16, 64)
  '2x16:int64[0,128)'      int64 token ids below 128
The model runs once on the inputs before it is planned: inputs it cannot take are an error.

examples:
  fxtp inspect llama --world-size 2
  fxtp inspect transformer -n 4 --format json > plan.json
  fxtp inspect mlp -n 2 --format graph --rank 1
  fxtp inspect mlp -n 2 --format dot --out mlp.svg     # needs Graphviz's dot
  fxtp inspect llama-7b -n 8
  fxtp inspect path/to/config.json -n 8
  fxtp inspect tiny-gpt -n 2 --input '4x16:int64[0,128)' --verify
  fxtp inspect my_models.py:build -n 2 --input '2x16:int64[0,1000)' --verify
  python -m fxtp inspect mypkg.models:tiny_model -n 2 --format graph

exit status: 0 ok (and --verify within tolerance), 1 fxtp error or --verify over tolerance,
2 bad usage (malformed argument, --rank outside the world, --verify on the meta device)
"""


def _world_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid world size {text!r}: an int >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"world size must be >= 1, got {value}")
    return value


def _checked(fn: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """An argparse ``type=`` from a function that raises ``ValueError`` with a full message."""

    def convert(text: str):
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = what
    return convert


def get_args_parser() -> argparse.ArgumentParser:
    from fxtp.explain.inspection import FORMATS, InputSpec, check_model_arg

    parser = argparse.ArgumentParser(
        prog="fxtp",
        description="Automatic tensor parallelism for PyTorch models.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,inspect}")
    demo = sub.add_parser(
        "demo",
        help="run a tiny GPT over local gloo ranks and check it against the single-device model",
        epilog="example: fxtp demo --world-size 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--world-size", "-n", metavar="N", type=_world_size, default=2, help="number of local ranks (default: 2)")

    inspect = sub.add_parser(
        "inspect",
        help="show a model's tensor-parallel plan, a rank's rewritten graph, or a picture of it",
        description="Plan MODEL for --world-size ranks and print the report, a rank's emitted graph\n"
        "with each value's placement, or a Graphviz picture; --verify runs it on local ranks.",
        epilog=_INSPECT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inspect.add_argument("model", metavar="MODEL", type=_checked(check_model_arg, "MODEL"), help="see MODEL below")
    inspect.add_argument("--world-size", "-n", metavar="N", type=_world_size, required=True, help="tensor-parallel degree, >= 1")
    inspect.add_argument(
        "--input", "-i", dest="inputs", metavar="SPEC", action="append", default=[],
        type=_checked(InputSpec.parse, "SPEC"), help="a positional input, repeatable (see SPEC below)",
    )
    inspect.add_argument(
        "--format", "-f", choices=FORMATS, default="table",
        help="table: report and summary (default); json: the report's dict; graph: the rank's code "
        "with placements; dot: Graphviz DOT",
    )
    inspect.add_argument("--rank", "-r", metavar="R", type=int, default=0, help="the rank shown (default: 0)")
    inspect.add_argument("--sequence-parallel", action="store_true",
                         help="Megatron sequence parallelism: token-sharded regions between rowwise and colwise layers")
    inspect.add_argument("--out", "-o", metavar="FILE", help="write to FILE; with --format dot, FILE.svg/.png/.pdf renders it with dot")
    inspect.add_argument("--verify", action="store_true", help="run the ranks on local gloo and compare outputs and gradients with the single-device model "
                         "(models with weights only: not the meta-device examples or a config.json)")
    inspect.add_argument("--tolerance", metavar="TOL", type=float, default=1e-4, help="max abs error --verify accepts (default: 1e-4)")
    inspect.add_argument(
        "--verbose", "-v", action="store_true",
        help="print the traceback of an fxtp error, and each failed capture frontend's error",
    )
    inspect.set_defaults(subparser=inspect)
    return parser


def _inspect(args: argparse.Namespace) -> int:
    from fxtp.explain.examples import EXAMPLES
    from fxtp.explain.inspection import (
        RENDERED,
        UsageError,
        check_inputs,
        example_name,
        inspect_text,
        load_model,
        resolve_inputs,
        write_output,
    )

    if not 0 <= args.rank < args.world_size:
        raise UsageError(f"--rank {args.rank} is outside world size {args.world_size} (0..{args.world_size - 1})")
    if args.out and args.out.lower().endswith(RENDERED) and args.format != "dot":
        raise UsageError(f"--out {args.out} renders a picture: add --format dot")
    name = example_name(args.model)
    if args.verify and name is not None and EXAMPLES[name].meta:
        raise UsageError(f"--verify runs the model, but {name} is on the meta device (no weights): analysis only")
    loaded = load_model(args.model)
    if args.verify and loaded.on_meta:
        raise UsageError(f"--verify runs the model, but {args.model} is on the meta device (no weights): analysis only")
    inputs = resolve_inputs(loaded, args.inputs)
    check_inputs(loaded, inputs, args.inputs)
    text = inspect_text(loaded, inputs, world_size=args.world_size, rank=args.rank, fmt=args.format, verbose=args.verbose,
                        sequence_parallel=args.sequence_parallel)
    write_output(text, args.out, args.format)
    if not args.verify:
        return 0
    from fxtp.explain.verify import verify

    sys.stdout.flush()
    result = verify(args.model, loaded.model, inputs, args.world_size, tolerance=args.tolerance, verbose=args.verbose,
                    sequence_parallel=args.sequence_parallel)
    print(result)
    return 0 if result.ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (argparse exits 2 itself on bad usage)."""
    parser = get_args_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from fxtp.explain.demo import run_demo

        run_demo(args.world_size)
        return 0
    from fxtp.core.errors import FxtpError
    from fxtp.explain.inspection import UsageError

    try:
        return _inspect(args)
    except UsageError as exc:
        args.subparser.error(str(exc))  # exits 2
    except FxtpError as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"fxtp: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
