"""``mpgen`` command line: thin over :mod:`mpgen.compiler.pipeline`."""

from __future__ import annotations

import argparse
import contextlib
import enum
import math
import os
import shlex
import sys
from typing import Optional, Sequence

from mpgen import __version__
from mpgen.errors import MpgenError
from mpgen.files import reason


class Exit(enum.IntEnum):
    OK = 0
    DIFF = 1  # ``check`` found stale generated code
    ERROR = 2  # a user error (bad spec, bad flag)


def _device_map(text: Optional[str]) -> dict[str, str]:
    from mpgen.compiler.frontend.device_map import parse_device_map

    if not text:
        return {}
    try:
        return parse_device_map(text)
    except ValueError as exc:
        raise MpgenError(None, str(exc)) from None


def _seconds(text: str) -> float:
    """``--time-limit``: a number of seconds, 0 for no limit."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0: no limit)")
    return value


def _compile_options(command: argparse.ArgumentParser) -> None:
    """The options of every command that compiles specs."""
    command.add_argument("--root", metavar="DIR",
                         help="the project a spec's dotted ops may import from (default: the "
                              "spec's repository; see docs/spec.md, 'User modules')")
    command.add_argument("--time-limit", metavar="SECONDS", type=_seconds,
                         help="seconds the analysis of each spec may take (default: the "
                              "budget in docs/spec.md, 'Limits'; 0: no limit)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpgen",
        description="Compile a YAML model spec into standalone model-parallel PyTorch code.",
    )
    parser.add_argument("--version", action="version", version=f"mpgen {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in (
        ("build", "generate the model, training script and tests"),
        ("check", "exit 1 with a diff when the generated code is not current"),
    ):
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.add_argument("specs", nargs="+", metavar="SPEC")
        cmd.add_argument("-o", "--out", default="generated", metavar="DIR",
                         help="output directory (default: generated)")
        cmd.add_argument("--device-map", metavar="MAP",
                         help="rewrite devices at build time: 'cuda:1=cuda:0,cuda:2=cuda:0', "
                              "or 'cpu' for everything on the CPU")
        if name == "build":
            cmd.add_argument("--force", action="store_true",
                             help="overwrite files in DIR that mpgen did not generate")
        _compile_options(cmd)
    show = sub.add_parser("show", help="print every layer's device, output shape and parameters",
                          description="print every layer's device, output shape and parameters")
    show.add_argument("spec", metavar="SPEC")
    show.add_argument("--format", choices=("table", "json"), default="table")
    show.add_argument("--device-map", metavar="MAP", help="as for build")
    _compile_options(show)
    place = sub.add_parser("place", help="print the layout in the explicit placement form",
                           description="Print the spec's layout (automatic or explicit) in the "
                                       "explicit placement form; --write puts it in the spec.")
    place.add_argument("spec", metavar="SPEC")
    place.add_argument("--write", action="store_true",
                       help="rewrite the spec's placement block in place (other lines unchanged)")
    place.add_argument("--device-map", metavar="MAP", help="rename devices after choosing")
    _compile_options(place)
    diff = sub.add_parser("diff", help="compare the layouts of two specs",
                          description="Compare two layouts. Each side is a spec path or "
                                      "REV:path (read from git).")
    diff.add_argument("old", metavar="OLD")
    diff.add_argument("new", metavar="NEW")
    _compile_options(diff)
    diff.set_defaults(device_map=None)
    return parser


def _say(text: str, stream=None) -> None:
    """Print a line; a reader that went away (``mpgen show | head``) does not
    change the outcome: the rest of the output is dropped."""
    stream = stream or sys.stdout
    try:
        print(text, file=stream)
        stream.flush()
    except BrokenPipeError:
        with contextlib.suppress(OSError, ValueError):  # no more writes, also at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def _build(args: argparse.Namespace, device_map: dict[str, str]) -> int:
    from mpgen.commands import build

    results, changes = build.build(args.specs, args.out, device_map, force=args.force,
                                   root=args.root, time_limit=args.time_limit)
    for path in changes.written:
        _say(f"wrote {path}")
    for path in changes.removed:
        _say(f"removed {path}")
    if not changes.written and not changes.removed:
        _say(f"{args.out}: up to date")
    for result in results:
        _say(build.summary_line(result))
    for note in build.path_notes(results, args.out):
        _say(note, sys.stderr)
    return Exit.OK


def _check(args: argparse.Namespace, device_map: dict[str, str]) -> int:
    from mpgen.commands import build
    from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT

    diffs = build.check(args.specs, args.out, device_map, root=args.root,
                        time_limit=args.time_limit)
    if not diffs:
        _say(f"{args.out}: up to date")
        return Exit.OK
    _say("".join(diffs).rstrip("\n"))
    command = ["mpgen", "build", *args.specs, "-o", args.out]
    if args.device_map:
        command += ["--device-map", args.device_map]
    if args.root:
        command += ["--root", args.root]
    if args.time_limit != DEFAULT_TIME_LIMIT:
        command += ["--time-limit", f"{args.time_limit or 0:g}"]
    _say(f"\nmpgen check: generated code in {args.out} is not current; "
         f"run: {shlex.join(command)}", sys.stderr)
    return Exit.DIFF


def _run(args: argparse.Namespace) -> int:
    from mpgen.compiler import pipeline
    from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT

    device_map = _device_map(args.device_map)
    # Unset: the default budget; 0: no limit.
    args.time_limit = DEFAULT_TIME_LIMIT if args.time_limit is None else args.time_limit or None
    if args.command == "build":
        return _build(args, device_map)
    if args.command == "check":
        return _check(args, device_map)
    if args.command == "show":
        from mpgen.commands import show as summary

        graph = pipeline.compile_spec(args.spec, device_map, args.root, args.time_limit)
        _say(summary.to_json(graph) if args.format == "json" else summary.to_table(graph))
        return Exit.OK
    if args.command == "place":
        from mpgen.commands import place as spec_edit

        placed = spec_edit.place(args.spec, device_map, args.root, args.time_limit)
        if args.write:
            changed = spec_edit.write_placement(args.spec, placed)
            _say(f"{'rewrote' if changed else 'unchanged'}: {args.spec} ({placed.how})")
        else:
            _say(f"# {args.spec}: {placed.how}")
            _say(placed.block())
        return Exit.OK
    if args.command == "diff":
        from mpgen.commands import diff as layout_diff

        old = layout_diff.load_side(args.old, None, args.root, args.time_limit)
        new = layout_diff.load_side(args.new, None, args.root, args.time_limit)
        _say(layout_diff.format_diff(layout_diff.diff(old, new)).rstrip("\n"))
        return Exit.OK
    raise AssertionError(args.command)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command; the exit status is an :class:`Exit`: 0, 1 or 2, and
    nothing else (argparse's usage errors are 2 too)."""
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except MpgenError as exc:
        _say(str(exc), sys.stderr)
    except OSError as exc:  # the environment (a deleted working folder...), not the spec
        where = f": {exc.filename}" if exc.filename else ""
        _say(f"mpgen: {reason(exc)}{where}", sys.stderr)
    except KeyboardInterrupt:
        _say("mpgen: interrupted", sys.stderr)
    except SystemExit as exc:  # code a spec made mpgen run; never a 0 that checked nothing
        _say(f"mpgen: code run at build time called sys.exit({exc.code!r}); stopped", sys.stderr)
    return Exit.ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
