"""``mpgen`` command line: thin over :mod:`mpgen.compiler.driver`."""

from __future__ import annotations

import argparse
import contextlib
import enum
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

from mpgen import __version__
from mpgen.errors import MpgenError, Position
from mpgen.files import reason
from mpgen.printed import escaped, log_line, log_text


class Exit(enum.IntEnum):
    OK = 0
    DIFF = 1  # ``check`` found stale generated code
    ERROR = 2  # a user error (bad spec, bad flag)


def _device_map(text: Optional[str], where: Optional[Position] = None) -> dict[str, str]:
    """``--device-map``, or ``device-map`` of ``[tool.mpgen]`` written at ``where``."""
    if not text:
        return {}
    from mpgen.spec_schema.device_map import parse_device_map  # no torch: check's fast path

    try:
        return parse_device_map(text)
    except ValueError as exc:
        if where is None:
            raise MpgenError(None, str(exc)) from None
        message = str(exc).removeprefix("--device-map: ")
        raise MpgenError(where, f"[tool.mpgen] device-map: {message}") from None


def _positive(text: str, most: float, what: str) -> float:
    """``text`` as a number above 0 and at most ``most``, else argparse's
    error saying it is not ``what``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= most):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def _seconds(text: str) -> float:
    """``--time-limit``: a number of CPU seconds above 0, at most
    ``config.MAX_TIME_LIMIT``: a limit can be raised, never removed."""
    from mpgen.config import MAX_TIME_LIMIT

    return _positive(text, MAX_TIME_LIMIT, "a number of CPU seconds above 0 and at most "
                     f"{MAX_TIME_LIMIT:g} (a limit can be raised, never removed)")


def _compile_options(command: argparse.ArgumentParser) -> None:
    """The options of every command that compiles specs."""
    command.add_argument("--root", metavar="DIR",
                         help="the project a spec's dotted ops may import from (default: the "
                              "spec's repository; see docs/spec.md, 'User modules')")
    command.add_argument("--time-limit", metavar="SECONDS", type=_seconds,
                         help="CPU seconds the analysis of each spec may take (default: the "
                              "budget in docs/spec.md, 'Limits'; at most 600; it can be "
                              "raised, never removed)")


def _project_commands(sub) -> None:
    """``init``, ``ci-summary`` and ``completion``: starting and running a project."""
    init = sub.add_parser("init", help="write a commented starter spec",
                          description="Write NAME.yaml (default model.yaml), a commented "
                                      "starter spec: the two-GPU model of PyTorch's "
                                      "model-parallel tutorial. An existing file is never "
                                      "replaced.")
    init.add_argument("name", nargs="?", default="model", metavar="NAME",
                      help="the spec's file name without .yaml; the class is named after it "
                           "(default: model, class Model)")
    init.set_defaults(device_map=None, root=None, time_limit=None)
    summary = sub.add_parser(
        "ci-summary", help="the layout changes of a pull request, in Markdown",
        description="Print, as Markdown, the layout changes of the specs that differ between "
                    "the merge base of REV and HEAD and the working tree: mpgen diff "
                    "BASE:path path for each (docs/ci.md). Without SPECs: the files of "
                    "[tool.mpgen] specs and the *.yaml/*.yml files with a top-level mpgen "
                    "key, on either side; a change of [tool.mpgen] (device-map) shows the "
                    "layers it moves. Exit 2 when a spec does not compile (it is shown with "
                    "its errors).")
    summary.add_argument("--base", required=True, metavar="REV",
                         help="what the pull request merges into, e.g. origin/main")
    summary.add_argument("-o", "--output", metavar="FILE",
                         help="write the Markdown to FILE instead of printing it (also when "
                              "a spec does not compile)")
    summary.add_argument("specs", nargs="*", metavar="SPEC", help="only these specs")
    _compile_options(summary)
    summary.set_defaults(device_map=None)
    completion = sub.add_parser("completion", help="print a shell completion script",
                                description="Print the completion script of bash or zsh "
                                            "(needs shtab: pip install 'mpgen[completion]'); "
                                            "e.g. mpgen completion bash > "
                                            "~/.local/share/bash-completion/completions/mpgen")
    completion.add_argument("shell", choices=("bash", "zsh"))


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors (which quote the arguments: file
    names a CI job may take from a pull request) are printed inert."""

    def error(self, message: str):
        super().error(log_line(message))


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mpgen",
        description="Compile a YAML model spec into standalone model-parallel PyTorch code.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"mpgen {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in (
        ("build", "generate the model, training script and tests"),
        ("check", "exit 1 with a diff when the generated code is not current"),
    ):
        cmd = sub.add_parser(name, help=help_text, description=help_text,
                             epilog="What the command line leaves out comes from [tool.mpgen] "
                                    "in pyproject.toml (docs/project.md).")
        cmd.add_argument("specs", nargs="*", metavar="SPEC",
                         help="spec files (default: specs of [tool.mpgen])")
        cmd.add_argument("-o", "--out", metavar="DIR",
                         help="output directory (default: out of [tool.mpgen], else generated)")
        cmd.add_argument("--device-map", metavar="MAP",
                         help="rewrite devices at build time: 'cuda:1=cuda:0,cuda:2=cuda:0', "
                              "or 'cpu' for everything on the CPU")
        if name == "build":
            cmd.add_argument("--force", action="store_true",
                             help="overwrite files in DIR that mpgen did not generate")
            cmd.add_argument("--prune", action="store_true",
                             help="also remove files in DIR generated from specs that no "
                                  "longer exist")
        _compile_options(cmd)
    show = sub.add_parser("show", help="print every layer's device, output shape and parameters",
                          description="print every layer's device, output shape and parameters")
    show.add_argument("spec", metavar="SPEC")
    show.add_argument("--format", choices=("table", "json"), default="table")
    show.add_argument("--device-map", metavar="MAP", help="as for build")
    _compile_options(show)
    place = sub.add_parser("place", help="print the layout in the explicit placement form",
                           description="Print the spec's layout (automatic or explicit) in the "
                                       "explicit placement form; --write puts it in the spec. "
                                       "--fit finds the largest batch whose memory plan fits "
                                       "every device's capacity instead.")
    place.add_argument("spec", metavar="SPEC")
    place.add_argument("--write", action="store_true",
                       help="rewrite the spec's placement block in place (other lines unchanged)")
    place.add_argument("--device-map", metavar="MAP", help="rename devices after choosing")
    place.add_argument("--fit", action="store_true",
                       help="find the largest train.batch_size (and pipeline micro-batch count) "
                            "whose memory plan fits every device's capacity; with --write, "
                            "write them into the spec")
    place.add_argument("--capacity", metavar="MAP",
                       help="with --fit: device capacities, such as cuda:0=24GiB,cuda:1=40GiB "
                            "(devices after --device-map; they replace the spec's)")
    _compile_options(place)
    diff = sub.add_parser("diff", help="compare the layouts of two specs",
                          description="Compare two layouts. Each side is a spec path or "
                                      "REV:path (read from git).")
    diff.add_argument("old", metavar="OLD")
    diff.add_argument("new", metavar="NEW")
    _compile_options(diff)
    diff.set_defaults(device_map=None)
    train_help = "build a spec into a temporary folder and run its training script"
    train = sub.add_parser(
        "train", help=train_help,
        usage="mpgen train SPEC [-o DIR] [--device-map MAP] [--force] [--root DIR] "
              "[--time-limit SECONDS] [-- SCRIPT ARGS...]",
        description="Build a spec into a temporary folder and run its training script "
                    "(train_<name>.py, in the working directory), passing it the arguments "
                    "after '--'. The exit status is the script's (128+N when signal N "
                    "stopped it); 2 for a bad spec, and then nothing runs.")
    train.add_argument("spec", metavar="SPEC")
    train.add_argument("-o", "--out", metavar="DIR",
                       help="build into DIR and keep it (default: a temporary folder, "
                            "removed afterwards)")
    train.add_argument("--device-map", metavar="MAP",
                       help="as for build; 'cpu' runs any spec on the CPU")
    train.add_argument("--force", action="store_true",
                       help="overwrite files in DIR that mpgen did not generate")
    _compile_options(train)
    schema = sub.add_parser(
        "schema", help="print the JSON Schema of the spec language",
        description="Print the JSON Schema of a spec (draft 2020-12; "
                    "docs/mpgen-spec.schema.json), which editors complete and check specs with, "
                    "or with --markdown the spec reference (docs/spec-reference.md); both are "
                    "generated from mpgen's models.")
    schema.add_argument("-o", "--out", metavar="FILE", help="write to FILE instead of printing")
    schema.add_argument("--markdown", action="store_true",
                        help="the reference of every key (docs/spec-reference.md) instead")
    _project_commands(sub)
    _profile_command(sub)
    _import_command(sub)
    _test_command(sub)
    return parser


def _profile_command(sub) -> None:
    """``mpgen profile``: measured unit times beside the spec (docs/cli.md)."""
    profile = sub.add_parser(
        "profile", help="time every unit's forward and backward on this machine's devices",
        description="Time every placement unit's forward and backward on this machine's "
                    "devices at the training sizes (a warm-up, then the median of repeats) "
                    "and write SPEC's <stem>.profile.yaml beside it, which "
                    "`placement: {auto: {balance: time}}` places by and the pipeline's "
                    "predicted times use (docs/partition.md).")
    profile.add_argument("spec", metavar="SPEC")
    profile.add_argument("--device", action="append", metavar="DEVICE", dest="devices",
                         help="a device to measure (repeatable; default: the CPU and every GPU)")
    profile.add_argument("--threads", type=lambda t: int(_positive(t, 1024, "a thread count")),
                         help="torch's CPU threads while timing (torchrun gives each rank 1)")
    profile.add_argument("--warmup", type=lambda t: int(_positive(t, 100, "a count")),
                         default=2, help="untimed runs first (default 2)")
    profile.add_argument("--repeats", type=lambda t: int(_positive(t, 1000, "a count")),
                         default=7, help="timed runs, of which the median (default 7)")
    profile.add_argument("--stdout", action="store_true",
                         help="print the profile instead of writing it")
    _compile_options(profile)
    profile.set_defaults(device_map=None)


def _test_command(sub) -> None:
    """``mpgen test``: the generated tests, run as the project cannot change
    (docs/ci.md, "The generated tests")."""
    test = sub.add_parser(
        "test", help="run the generated tests, in a way the project cannot change",
        usage="mpgen test [OUT ...] [--root DIR] [--timeout SECONDS] [-- PYTEST ARGS...]",
        description="Run the generated tests of each OUT (default: out of [tool.mpgen], else "
                    "generated) with pytest in a child interpreter: the project off the "
                    "path but for the modules its specs name (vetted as at build time, "
                    "imported from their sources), no configuration, conftest.py or plugin "
                    "of the project's, pytest and torch from this interpreter's packages. "
                    "Exit 0 only when every generated test ran and passed; 1 when one "
                    "failed or did not run (no tests, deselected, skipped); 2 when the "
                    "folder holds Python mpgen did not generate, or a module is refused. "
                    "Arguments after '--' go to pytest (docs/ci.md).")
    test.add_argument("outs", nargs="*", metavar="OUT",
                      help="output folders (default: out of [tool.mpgen], else generated)")
    test.add_argument("--root", metavar="DIR",
                      help="the project the specs' modules come from (default: root of "
                           "[tool.mpgen], else each spec's repository)")
    test.add_argument("--timeout", metavar="SECONDS", type=_wall_seconds,
                      help="stop an output folder's tests after SECONDS of wall time, "
                           "failing (default: 3600)")
    test.set_defaults(device_map=None, time_limit=None)


def _wall_seconds(text: str) -> float:
    """``mpgen test --timeout``: seconds above 0, at most a week."""
    from mpgen.commands.test import MAX_TIMEOUT

    return _positive(text, MAX_TIMEOUT,
                     f"a number of seconds above 0 and at most {MAX_TIMEOUT:g}")


def _test(args: argparse.Namespace) -> int:
    """``mpgen test``: the output folders and root from the command line,
    else from ``[tool.mpgen]``; pytest's exit, as :func:`mpgen.commands.test.run`."""
    from mpgen import config
    from mpgen.commands import test

    project = config.load()
    outs = args.outs or [(project and project.folder_path("out")) or "generated"]
    for out in outs:
        _check_out(out, project)
    root = args.root or (project and project.folder_path("root"))
    return test.run(outs, root, args.script_args, args.timeout or test.DEFAULT_TIMEOUT)


def _import_command(sub) -> None:
    """``mpgen import``: a spec from an existing nn.Module (docs/import.md)."""
    cmd = sub.add_parser(
        "import", help="write the spec of an existing nn.Module, traced",
        description="Build CLASS (or call FUNCTION) from MODULE (the working directory on "
                    "sys.path), trace it with torch.fx or TorchDynamo and print the "
                    "equivalent spec (docs/import.md).")
    cmd.add_argument("target", metavar="MODULE:CLASS", help="the model's class, or a "
                     "function returning the model (torchvision.models:resnet50)")
    cmd.add_argument("--args", metavar="JSON",
                     help="the constructor's (or function's) arguments: a JSON object "
                          "(keywords) or list")
    cmd.add_argument("--config", metavar="JSON",
                     help="a Hugging Face model class's configuration (its config_class's "
                          "keyword arguments), instead of --args")
    cmd.add_argument("--trace", choices=("fx", "dynamo"),
                     help="the tracer: torch.fx (default for your own classes of torch.nn "
                          "layers) or TorchDynamo, keeping the module hierarchy as blocks "
                          "(default for installed libraries' models and your classes that "
                          "hold them, and where torch.fx fails)")
    cmd.add_argument("--input", action="append", metavar="NAME=D0,D1,...",
                     help="a forward argument's shape, dims as sizes or names (batch), "
                          "optionally :DTYPE (idx=batch,seq:int64); once per argument "
                          "(default: what the library says a torchvision, Hugging Face or "
                          "timm model takes)")
    cmd.add_argument("-o", "--out", metavar="SPEC", help="write the spec to SPEC, not stdout")
    cmd.add_argument("--force", action="store_true", help="overwrite SPEC if it exists")
    cmd.add_argument("--devices", type=int, metavar="N",
                     help="an automatic placement over cuda:0 ... cuda:N-1")
    cmd.add_argument("--time-limit", metavar="SECONDS", type=_seconds,
                     help="CPU seconds the check that the spec builds may take (at most "
                          "600)")
    cmd.set_defaults(device_map=None, root=None)


#: The most GPUs ``mpgen import --devices`` spreads layers over (each a line of the spec).
MAX_IMPORT_DEVICES = 4096


def _import(args: argparse.Namespace) -> int:
    from mpgen.commands import importer

    inputs = [importer.parse_input(text) for text in args.input or ()]
    if args.devices is not None and not 1 <= args.devices <= MAX_IMPORT_DEVICES:
        raise MpgenError(None, f"--devices {args.devices}: expected a number of GPUs from 1 "
                               f"to {MAX_IMPORT_DEVICES}")
    root = importer.load_module(args.target, args.args, args.config)
    tracer = args.trace or importer.default_tracer(args.target, root)
    if not args.input:  # the library's word for what the model takes, recorded as given
        known = importer.known_inputs(args.target, root)
        if known is None:
            raise importer.no_inputs(args.target, root)
        _say(f"mpgen import: note: {known.note()}", sys.stderr)
        args.input = list(known.texts)
        inputs = [importer.parse_input(text) for text in args.input]
    command = ["mpgen", "import", args.target]
    if args.args is not None:
        command += ["--args", args.args]
    if args.config is not None:
        command += ["--config", args.config]
    if args.trace is not None:
        command += ["--trace", args.trace]
    for text in args.input:
        command += ["--input", text]
    if args.devices:
        command += ["--devices", str(args.devices)]
    imported = importer.import_module(root, inputs, shlex.join(command), args.devices,
                                      args.time_limit, tracer, fallback=args.trace is None)
    for note in imported.notes:
        _say(f"mpgen import: note: {note}", sys.stderr)
    if args.out is None:
        _say(imported.text.rstrip("\n"))
    else:
        importer.write_spec(imported.text, args.out, args.force)
        _say(f"wrote {args.out} ({imported.name}, {imported.layers} layers)", sys.stderr)
    return Exit.OK


def _split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``mpgen train SPEC ... -- ARGS``: the arguments before ``--``, and ARGS
    (passed to the training script unchanged, ``--`` included after the
    first; ``mpgen test``'s go to pytest). Only ``train`` and ``test`` have
    them; argparse alone mishandles ``--``."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in ("train", "test") or "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def _say(text: str, stream=None) -> None:
    """Print a line, inert (``printed.log_text``: no control character, no
    workflow command; NOTE [Printed text is inert]); a reader that went away
    (``mpgen show | head``) does not change the outcome: the rest of the
    output is dropped."""
    stream = stream or sys.stdout
    try:
        print(log_text(text), file=stream)
        stream.flush()
    except BrokenPipeError:
        with contextlib.suppress(OSError, ValueError):  # no more writes, also at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def _build(args: argparse.Namespace, device_map: dict[str, str]) -> int:
    from mpgen.commands import build

    built, changes = build.update(args.specs, args.out, device_map, force=args.force,
                                  root=args.root, time_limit=args.time_limit, prune=args.prune)
    for path in changes.written:
        _say(f"wrote {path}")
    for path in changes.removed:
        _say(f"removed {path}")
    if not changes.written and not changes.removed and not changes.kept:
        _say(f"{args.out}: up to date")
    for orphan in changes.kept:
        _say(f"{escaped(str(orphan.path))}: note: {orphan.why}; left in place (mpgen build "
             "--prune removes it)", sys.stderr)
    for stranger in changes.strangers:
        left = ("not built here: left in place" if stranger.spec is not None else
                "no spec built owns it: left in place (mpgen check reports it)")
        _say(f"{escaped(str(stranger.path))}: note: {stranger.why}; {left}", sys.stderr)
    for spec in built:
        _say(spec.line)
    for note in (note for spec in built for note in spec.notes):
        _say(note, sys.stderr)
    return Exit.OK


def _check(args: argparse.Namespace, device_map: dict[str, str]) -> int:
    from mpgen.commands import build

    checked, diffs = build.check_specs(args.specs, args.out, device_map, root=args.root,
                                       time_limit=args.time_limit)
    for spec in checked:
        if spec.ran_user_code:
            _say(f"{escaped(spec.spec_path)}: note: checking it ran the project's own code (the "
                 "modules its spec names), in a child process without this environment's "
                 "variables; review changes to that code as code", sys.stderr)
    if not diffs:
        _say(f"{args.out}: up to date")
        return Exit.OK
    _say("".join(diffs.texts).rstrip("\n"))
    typed = args.typed  # the fix repeats what was typed; the rest comes from [tool.mpgen] again
    options = []
    if typed.out:
        options += ["-o", typed.out]
    if typed.device_map:
        options += ["--device-map", typed.device_map]
    if typed.root:
        options += ["--root", typed.root]
    if typed.time_limit is not None and args.time_limit != _default_time_limit():
        options += ["--time-limit", f"{args.time_limit:g}"]
    command = ["mpgen", "build", *typed.specs, *options]
    if diffs.prune:
        command += ["--prune"]
    if diffs.build_fixes:
        _say(f"\nmpgen check: generated code in {args.out} is not current; "
             f"run: {shlex.join(command)}", sys.stderr)
    first = "" if diffs.build_fixes else "\n"
    if diffs.strangers > diffs.unchecked_files:
        files, them = _counted(diffs.strangers - diffs.unchecked_files)
        _say(f"{first}mpgen check: {args.out} holds {files} that no spec checked owns; "
             f"remove {them} (build leaves {them})", sys.stderr)
        first = ""
    if diffs.unchecked:  # another spec's files: compared when it is checked too
        specs = [os.path.relpath(spec) for spec in diffs.unchecked]
        together = ["mpgen", "check", *typed.specs, *specs, *options]
        fix = (f"check them with the others: {shlex.join(together)}" if typed.specs else
               f"list {'it' if len(specs) == 1 else 'them'} in [tool.mpgen] specs")
        _say(f"{first}mpgen check: {args.out} also holds {_counted(diffs.unchecked_files)[0]} of "
             f"{', '.join(map(escaped, specs))}, not checked here; {fix}", sys.stderr)
    return Exit.DIFF


def _counted(files: int) -> tuple[str, str]:
    """``1 file``, ``it`` or ``N files``, ``them``."""
    return ("1 file", "it") if files == 1 else (f"{files} files", "them")


def _train(args: argparse.Namespace, device_map: dict[str, str]) -> int:
    """Build one spec (into ``--out`` or a temporary folder) and run its
    training script; the script's exit status."""
    from mpgen.commands import build
    from mpgen.compiler.codegen.common import file_names

    with contextlib.ExitStack() as stack:
        out = args.out or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="mpgen-train-", ignore_cleanup_errors=True))
        results, changes = build.build([args.spec], out, device_map, force=args.force,
                                       root=args.root, time_limit=args.time_limit)
        for path in changes.removed:  # -o DIR: the spec's files of an earlier name
            _say(f"removed {path}", sys.stderr)
        script = Path(out) / file_names(results[0].graph)["train"]
        # User modules found next to the spec: what `build` would tell the user to set.
        roots = [str(root) for _, root in build.missing_roots(results[0], out)]
        env = dict(os.environ)
        if roots:
            env["PYTHONPATH"] = os.pathsep.join([*roots, *filter(None, [env.get("PYTHONPATH")])])
        path_note = f" with PYTHONPATH={shlex.quote(env['PYTHONPATH'])}" if roots else ""
        _say(f"mpgen: built {results[0].graph.name} into {out}; running "
             f"{shlex.join([script.name, *args.script_args])}{path_note}", sys.stderr)
        return _run_script([sys.executable, str(script), *args.script_args], env)


def _run_script(command: list[str], env: dict[str, str]) -> int:
    """Run ``command`` in the foreground (stdin, stdout, stderr and the working
    directory are this process's) and return its exit status as a shell
    gives it: 128+N when signal N stopped it.

    A Ctrl-C at the terminal reaches the script itself (the same process
    group), which saves a checkpoint and exits: mpgen only waits for it,
    neither dying with a traceback nor cutting the save short. A SIGTERM
    sent to mpgen alone is passed on, so that nothing outlives it.
    """
    children: list[subprocess.Popen] = []
    terminated: list[int] = []

    def on_signal(signum: int, frame) -> None:
        if signum == signal.SIGTERM:
            terminated.append(signum)
            for child in children:
                child.send_signal(signum)

    held = {}
    if threading.current_thread() is threading.main_thread():  # only it can set handlers
        # A Python function, not SIG_IGN: exec puts the default back in the script.
        held = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        children.append(subprocess.Popen(command, env=env))
        if terminated:  # before the script existed
            children[0].send_signal(signal.SIGTERM)
        code = children[0].wait()
    finally:
        for sig, handler in held.items():
            if handler is not None:  # None: not set from Python, cannot be put back
                signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _project_options(args: argparse.Namespace) -> Optional[Position]:
    """``build``/``check``: what the command line leaves out, from
    ``[tool.mpgen]`` (``mpgen.config``); ``args.typed`` keeps what was typed.
    Returns where a device map that came from the file is written."""
    from mpgen import config

    args.typed = argparse.Namespace(**vars(args))
    project = config.load()
    settings = project.settings if project is not None else {}
    if not args.specs:
        args.specs = project.spec_paths() if project is not None else []
    if not args.specs:
        where = (f"no specs in [tool.mpgen] of {project.shown}" if project is not None
                 else "no [tool.mpgen] specs in a pyproject.toml here or above")
        raise MpgenError(None, f"mpgen {args.command}: no SPEC given and {where}; pass the "
                               'spec files, or set specs = ["examples/*.yaml"] under '
                               "[tool.mpgen] in pyproject.toml (docs/project.md)")
    args.out = args.out or (project and project.folder_path("out")) or "generated"
    args.root = args.root or (project and project.folder_path("root"))
    _check_out(args.out, project)
    if args.time_limit is None and "time-limit" in settings:
        args.time_limit = settings["time-limit"].value
        note = project.time_limit_note()
        if note:  # NOTE [A config a pull request can change]: a raise shows
            _say(note, sys.stderr)
    if args.device_map is None and "device-map" in settings:
        args.device_map = settings["device-map"].value
        return settings["device-map"].pos
    return None


def _check_out(out: str, project) -> None:
    """The output folder of build and check, in a project (the working
    directory's), must not lead out of it through a symbolic link nor be
    inside its git folder (``out`` of ``[tool.mpgen]`` must be inside it
    too: ``config``); a ``-o`` written outside the project is the user's
    own choice."""
    from mpgen import config

    folder = project.folder if project is not None else config.project_folder(Path.cwd())
    if folder is None:
        return
    problem = config.folder_problem(Path(out), config.boundary(folder), outside_ok=True)
    if problem:
        raise MpgenError(Position(out), f"the output folder (-o) {problem}; refusing to use it")


def _schema(args: argparse.Namespace) -> int:
    """``mpgen schema``: the JSON Schema of a spec, or the reference page."""
    from mpgen.spec_schema import json_schema, reference

    text = reference.reference_markdown() if args.markdown else json_schema.schema_text()
    if args.out is None:
        _say(text.rstrip("\n"))
        return Exit.OK
    Path(args.out).write_text(text, encoding="utf-8")
    _say(f"wrote {args.out}")
    return Exit.OK


def _init(args: argparse.Namespace) -> int:
    from mpgen.commands import init

    starter = init.starter(args.name)
    init.write(starter)
    _say(f"wrote {starter.path}: the {starter.class_name} starter spec; next:")
    for line in starter.next_steps():
        _say(line)
    return Exit.OK


def _ci_summary(args: argparse.Namespace) -> int:
    from mpgen import config
    from mpgen.commands import ci_summary

    for name in ci_summary.tokens(os.environ):  # NOTE [A summary without a token]
        _say(f"mpgen ci-summary: warning: {name} is set: the pull request's specs are compiled, "
             "and the code they name runs, with it in the environment; compute the summary "
             "in a job without tokens (docs/ci.md)", sys.stderr)
    # [tool.mpgen] root, as build reads it, and its time-limit raise said as
    # build says it (ci_summary reads specs, device-map and time-limit itself,
    # from each side's pyproject.toml)
    project = config.load()
    if args.root is None and project is not None:
        args.root = project.folder_path("root")
    note = project.time_limit_note() if project is not None else None
    if note and args.time_limit is None:  # NOTE [A config a pull request can change]
        _say(note, sys.stderr)
    result = ci_summary.summarize(args.base, args.specs or None, args.root, args.time_limit)
    if args.output is None:
        _say(result.markdown.rstrip("\n"))
    else:
        Path(args.output).write_text(log_text(result.markdown), encoding="utf-8")
    if result.failed:
        _say(f"mpgen ci-summary: does not compile: {', '.join(map(escaped, result.failed))}",
             sys.stderr)
        return Exit.ERROR
    return Exit.OK


def _completion(args: argparse.Namespace) -> int:
    """A completion script from the parser itself (shtab, an optional extra)."""
    try:
        import shtab
    except ImportError:
        raise MpgenError(None, "mpgen completion needs shtab: pip install shtab "
                               "(or mpgen[completion])") from None
    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in commands.choices.values():
        for action in command._actions:
            if action.dest in ("spec", "specs", "old", "new"):
                action.complete = shtab.FILE
            elif action.dest in ("out", "outs", "root"):
                action.complete = shtab.DIRECTORY
    _say(shtab.complete(parser, shell=args.shell).rstrip("\n"))
    return Exit.OK


def _default_time_limit() -> float:
    from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT

    return DEFAULT_TIME_LIMIT


def _run(args: argparse.Namespace) -> int:
    if args.command == "completion":  # no spec, no torch
        return _completion(args)
    if args.command == "test":
        return _test(args)
    where = _project_options(args) if args.command in ("build", "check") else None
    device_map = _device_map(args.device_map, where)
    # Unset: the default budget (0 is refused: _seconds). build and check take ``...`` for
    # the default: a check of current specs imports no compiler (and no torch).
    default = (... if args.command in ("build", "check")
               else None if args.command == "ci-summary"  # [tool.mpgen]'s, else the budget
               else _default_time_limit())
    args.time_limit = default if args.time_limit is None else args.time_limit
    if args.command == "build":
        return _build(args, device_map)
    if args.command == "check":
        return _check(args, device_map)
    if args.command == "train":
        return _train(args, device_map)
    if args.command == "init":
        return _init(args)
    if args.command == "ci-summary":
        return _ci_summary(args)
    if args.command == "import":
        return _import(args)
    if args.command == "show":
        from mpgen.commands import isolate
        from mpgen.commands import show as summary

        graph = isolate.compile_spec(args.spec, device_map, args.root, args.time_limit)
        _say(summary.to_json(graph) if args.format == "json" else summary.to_table(graph))
        return Exit.OK
    if args.command == "profile":
        from mpgen.commands import profile as measure

        target, text = measure.profile(args.spec, args.devices, args.root, args.warmup,
                                       args.repeats, args.threads, args.time_limit)
        if args.stdout:
            _say(text.rstrip("\n"))
        else:
            measure.write_profile(target, text)
            _say(f"wrote {escaped(str(target))}")
        return Exit.OK
    if args.command == "place" and (args.fit or args.capacity):
        return _fit(args, device_map)
    if args.command == "place":
        from mpgen.commands import place as spec_edit

        placed = spec_edit.place(args.spec, device_map, args.root, args.time_limit)
        if args.write:
            changed = spec_edit.write_placement(args.spec, placed)
            _say(f"{'rewrote' if changed else 'unchanged'}: {escaped(args.spec)} ({placed.how})")
        else:
            _say(f"# {escaped(args.spec)}: {placed.how}")
            _say(placed.block())
        return Exit.OK
    if args.command == "diff":
        from mpgen.commands import diff as layout_diff

        old = layout_diff.load_side(args.old, None, args.root, args.time_limit)
        new = layout_diff.load_side(args.new, None, args.root, args.time_limit)
        _say(layout_diff.format_diff(layout_diff.diff(old, new)).rstrip("\n"))
        return Exit.OK
    raise AssertionError(args.command)


def _fit(args: argparse.Namespace, device_map: dict[str, str]) -> int:
    """``mpgen place --fit``: the largest batch that fits, printed or written."""
    from mpgen.commands import place as spec_edit

    if not args.fit:
        raise MpgenError(None, "mpgen place: --capacity is for --fit (mpgen place SPEC --fit "
                               "--capacity ...)")
    capacity = spec_edit.parse_capacity(args.capacity) if args.capacity else None
    found = spec_edit.fit(args.spec, device_map, capacity, args.root, args.time_limit)
    for line in spec_edit.fit_lines(found):
        _say(escaped(line))
    if args.write:
        changed = spec_edit.write_fit(args.spec, found)
        _say(f"{'rewrote' if changed else 'unchanged'}: {escaped(args.spec)}")
    return Exit.OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command; the exit status is an :class:`Exit`: 0, 1 or 2, and
    nothing else (argparse's usage errors are 2 too), except for ``train``
    once its script runs: then the script's status."""
    argv, script_args = _split_script_args(list(sys.argv[1:] if argv is None else argv))
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        hint = (f" (the training script's arguments go after '--': mpgen train "
                f"{shlex.quote(args.spec)} -- {shlex.join(unknown)})"
                if args.command == "train" else
                f" (pytest's arguments go after '--': mpgen test -- {shlex.join(unknown)})"
                if args.command == "test" else "")
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    args.script_args = script_args
    try:
        # schema: no spec, no options of a build, and no torch to import
        return _schema(args) if args.command == "schema" else _run(args)
    except MpgenError as exc:
        _say(str(exc), sys.stderr)
    except OSError as exc:  # the environment (a deleted working folder...), not the spec
        where = f": {escaped(str(exc.filename))}" if exc.filename else ""
        _say(f"mpgen: {reason(exc)}{where}", sys.stderr)
    except KeyboardInterrupt:
        _say("mpgen: interrupted", sys.stderr)
    except SystemExit as exc:  # code a spec made mpgen run; never a 0 that checked nothing
        _say(f"mpgen: code run at build time called sys.exit({exc.code!r}); stopped", sys.stderr)
    return Exit.ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
