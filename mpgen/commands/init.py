"""``mpgen init [NAME]``: a commented starter spec to begin a project from.

The starter (``templates/starter.yaml.jinja``) is the two-GPU model of
PyTorch's model-parallel tutorial with its placement and training settings
explained; ``tests/commands/test_init.py`` builds it and runs a training step.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from mpgen.compiler.codegen.common import environment
from mpgen.compiler.frontend.namespace import identifier_problem, model_name_problem, module_stems
from mpgen.errors import MpgenError, Position

DEFAULT_NAME = "model"


@dataclass(frozen=True)
class Starter:
    """The spec ``init`` writes: where, and the model it names."""

    path: Path
    class_name: str

    def text(self) -> str:
        stem = module_stems(self.class_name)[0]
        return environment().get_template("starter.yaml.jinja").render(
            spec_file=self.path.name, class_name=self.class_name, stem=stem)

    def next_steps(self, out: str = "generated") -> list[str]:
        """The commands to run next, each with what it does."""
        spec = shlex.quote(str(self.path))
        train_script = shlex.quote(f"{out}/{module_stems(self.class_name)[1]}.py")
        rows = [
            (f"mpgen build {spec} --device-map cpu",
             f"the model, training script, tests into {out}/ (on 2 GPUs: no --device-map)"),
            (f"python {train_script} --steps 10", "train it on synthetic data"),
            (f"python -m pytest -q {out}", "run its generated tests"),
            (f"mpgen check {spec} --device-map cpu", f"in CI: exit 1 when {out}/ is stale"),
        ]
        width = max(len(command) for command, _ in rows)
        return [f"  {command.ljust(width)}  # {what}" for command, what in rows]


def starter(name: str = DEFAULT_NAME) -> Starter:
    """The starter for ``NAME``: the file ``NAME.yaml`` (``NAME`` as given when it
    ends in ``.yaml`` or ``.yml``) and a class named from its stem
    (``my_model`` -> ``MyModel``); an :class:`MpgenError` when no valid model
    name can be made of it."""
    path = Path(name if re.search(r"\.ya?ml$", name) else f"{name}.yaml")
    words = re.split(r"[\W_]+", path.name[: -len(path.suffix)], flags=re.ASCII)
    class_name = "".join(w[:1].upper() + w[1:] for w in words)
    problem = identifier_problem(class_name) or model_name_problem(class_name)
    if problem:
        raise MpgenError(None, f"mpgen init {name}: cannot name a model after "
                               f"{path.name!r}: {problem}")
    return Starter(path, class_name)


def write(spec: Starter) -> None:
    """Create the starter's file; an existing file (or link) is never replaced."""
    text = spec.text()
    try:
        f = open(spec.path, "x", encoding="utf-8", newline="\n")
    except FileExistsError:
        raise MpgenError(Position(str(spec.path)), "already exists; refusing to overwrite "
                         "it (move it away, or name another file: mpgen init NAME)") from None
    try:
        with f:
            f.write(text)
    except BaseException:  # a full disk, Ctrl-C: no half-written starter left behind
        spec.path.unlink(missing_ok=True)
        raise
