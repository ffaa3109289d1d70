"""``mpgen`` command line: thin over :mod:`mpgen.compiler.pipeline`."""

from __future__ import annotations

import argparse
import enum
import sys
from typing import Optional, Sequence

from mpgen import __version__
from mpgen.errors import MpgenError


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
    show = sub.add_parser("show", help="print every layer's device, output shape and parameters",
                          description="print every layer's device, output shape and parameters")
    show.add_argument("spec", metavar="SPEC")
    show.add_argument("--format", choices=("table", "json"), default="table")
    show.add_argument("--device-map", metavar="MAP", help="as for build")
    place = sub.add_parser("place", help="print the layout in the explicit placement form",
                           description="Print the spec's layout (automatic or explicit) in the "
                                       "explicit placement form; --write puts it in the spec.")
    place.add_argument("spec", metavar="SPEC")
    place.add_argument("--write", action="store_true",
                       help="rewrite the spec's placement block in place (other lines unchanged)")
    place.add_argument("--device-map", metavar="MAP", help="rename devices after choosing")
    diff = sub.add_parser("diff", help="compare the layouts of two specs",
                          description="Compare two layouts. Each side is a spec path or "
                                      "REV:path (read with git show).")
    diff.add_argument("old", metavar="OLD")
    diff.add_argument("new", metavar="NEW")
    diff.set_defaults(device_map=None)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from mpgen.commands import build
    from mpgen.compiler import pipeline

    try:
        device_map = _device_map(args.device_map)
        if args.command == "build":
            results, written = build.build(args.specs, args.out, device_map)
            for path in written:
                print(f"wrote {path}")
            if not written:
                print(f"{args.out}: up to date")
            for result in results:
                print(build.summary_line(result))
            for note in build.path_notes(results, args.out):
                print(note, file=sys.stderr)
            return Exit.OK
        if args.command == "show":
            from mpgen.commands import show as summary

            graph = pipeline.compile_spec(args.spec, device_map)
            print(summary.to_json(graph) if args.format == "json" else summary.to_table(graph))
            return Exit.OK
        if args.command == "check":
            diffs = build.check(args.specs, args.out, device_map)
            if diffs:
                sys.stdout.write("".join(diffs))
                specs = " ".join(args.specs)
                print(f"\nmpgen check: generated code in {args.out} is not current; "
                      f"run: mpgen build {specs} -o {args.out}"
                      + (f" --device-map {args.device_map}" if args.device_map else ""),
                      file=sys.stderr)
                return Exit.DIFF
            print(f"{args.out}: up to date")
            return Exit.OK
        if args.command == "place":
            from mpgen.commands import place as spec_edit

            placed = spec_edit.place(args.spec, device_map)
            if args.write:
                changed = spec_edit.write_placement(args.spec, placed)
                print(f"{'rewrote' if changed else 'unchanged'}: {args.spec} ({placed.how})")
            else:
                print(f"# {args.spec}: {placed.how}")
                print(placed.block())
            return Exit.OK
        if args.command == "diff":
            from mpgen.commands import diff as layout_diff

            old = layout_diff.load_side(args.old)
            new = layout_diff.load_side(args.new)
            sys.stdout.write(layout_diff.format_diff(layout_diff.diff(old, new)))
            return Exit.OK
    except MpgenError as exc:
        print(str(exc), file=sys.stderr)
        return Exit.ERROR
    except KeyboardInterrupt:
        return Exit.ERROR
    raise AssertionError(args.command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
