"""Build a spec that names code of its own in a child process.

NOTE [User code in a child]
A spec that names a user module, loss or optimizer class (or lists
``imports:``) is compiled by importing and running that code: ``mpgen
check`` in CI on a pull request runs the pull request's code. That code
must not be able to decide the outcome of the check: a module calling
``os._exit(0)`` in ``__init__`` once ended ``check`` with status 0 while
the generated code was stale. So ``mpgen build`` and ``mpgen check``
compile such a spec in a child process (:func:`generate`), and the parent
takes only what it verifies:

- the child reports its result as one JSON line on a pipe, with a token the
  parent made for this run; a child that exits, is killed, or ends without
  that line fails the build, with a message at the layer it was working on
  (it reports each layer and file as it starts them);
- the result must name files of this spec only (plain file names of the
  kinds a build writes), each with the header of this spec's digest, which
  the parent computes itself from the spec's text (no user code runs for
  that); a result for another text of the spec is refused;
- the child's environment holds only what Python and the build need
  (:data:`KEPT_ENVIRONMENT`): no CI token, cloud credential or other
  secret of the parent's reaches the spec's code;
- the child's work is bounded by CPU time, as the build's budget is (NOTE
  [A budget of CPU time]): ``RLIMIT_CPU`` raises ``SIGXCPU`` in the child
  once it has spent its budget (turned into the budget's own positioned
  error, even inside a pure-Python loop no check reaches), then kills it
  (``RLIMIT_CPU``'s hard limit); the parent also kills a child that spends
  more CPU than that (root may raise its own limits), or that spends none
  for :data:`IDLE_SECONDS` (a module that sleeps or waits); ``RLIMIT_AS``
  bounds its memory (:data:`~mpgen.compiler.frontend.limits.MAX_BUILD_MEMORY`).

What this cannot do: code that runs can lie. A module written to forge the
child's result, knowing this protocol, could report the files it likes for
a spec whose text it does not change. ``check`` therefore names, on
stderr, every spec whose check ran the project's own code, and
``docs/ci.md`` says to review changes to those modules as code (CODEOWNERS)
and never to give the job that runs ``check`` a secret.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import os
import pickle
import re
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

import mpgen
from mpgen.errors import ErrorList, MpgenError, Position, shown

if TYPE_CHECKING:
    from mpgen.compiler.ir import Graph

#: Environment variables the child keeps (with ``LC_*``): what Python, its
#: packages and the build need. Anything else (``GITHUB_TOKEN``,
#: ``GH_TOKEN``, ``AWS_*``, ...) does not reach the spec's code.
KEPT_ENVIRONMENT = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "TZ", "TMPDIR", "TEMP", "TMP",
                    "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONSAFEPATH",
                    "VIRTUAL_ENV", "SYSTEMROOT", "CUDA_VISIBLE_DEVICES")
#: CPU seconds the child may spend before its budget starts: starting
#: Python and importing torch and the compiler (about 3 s on a 2-core
#: machine).
STARTUP_CPU_SECONDS = 20
#: CPU seconds the child may go on after ``SIGXCPU`` (one second past its
#: budget) before ``RLIMIT_CPU`` kills it; the parent kills it past its
#: start-up allowance, its budget and twice this.
GRACE_CPU_SECONDS = 3
#: Seconds the child may spend no CPU at all (sleeping, waiting on a
#: pipe) before the parent kills it. A child that computes, however slowly
#: on a loaded machine, is never idle this long.
IDLE_SECONDS = 5.0
#: Bytes of the child's result the parent reads at most (the files of one
#: spec are far smaller: a spec is at most 1 MiB).
MAX_RESULT_BYTES = 256 << 20
#: The names of the files one build of a spec writes.
_FILE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.py|\.placement\.md)")


@dataclass(frozen=True)
class Isolated:
    """What a child reported for one spec, verified."""

    name: str  # the model's name
    pos: Position  # where it is written
    files: dict[str, str]
    entry: dict[str, Any]  # the manifest entry's fields (``manifest.Entry``)
    notes: tuple[str, ...]  # ``build.path_notes`` of the result, as the child found them


def child_environment() -> dict[str, str]:
    """The parent's environment less everything the build does not need,
    and mpgen's own folder on ``PYTHONPATH`` (the child imports it)."""
    env = {k: v for k, v in os.environ.items() if k in KEPT_ENVIRONMENT or k.startswith("LC_")}
    own = str(Path(mpgen.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([own, *filter(None, [env.get("PYTHONPATH")])])
    return env


def generate(path: str | Path, device_map: Optional[Mapping[str, str]],
             root: str | Path | None, time_limit: Optional[float], out_dir: str | Path,
             digest: str, name_pos: Position, text: Optional[str] = None) -> Isolated:
    """Compile the spec at ``path`` in a child process (NOTE [User code in a
    child]); ``digest``: the spec's digest as the parent computed it from
    the text, which every file must carry; ``name_pos``: where the model's
    name is written (the fallback position of a failure); ``text``: the
    spec's text as the parent read it (the manifest records its hash only if
    the child built the same text). Raises MpgenError for the spec's
    mistakes, and for a child that fails, is killed, or reports what this
    spec cannot have given."""
    request = _request("generate", path, device_map, root, time_limit,
                       out_dir=str(out_dir), text=text)
    result, where = _ask(request, name_pos)
    return _verified(result, str(path), digest, where)


def compile_spec(path: str | Path, device_map: Optional[Mapping[str, str]] = None,
                 root: str | Path | None = None,
                 time_limit: Optional[float] = None) -> "Graph":
    """``driver.compile_spec``, in a child process when the spec names code
    of its own (``mpgen diff`` and ``ci-summary``, which CI runs on a pull
    request's specs). The graph comes back without the classes and
    functions its ops resolved to (``Op.target`` is None): what the layout
    commands read is plain data, and unpickling it here imports nothing
    (:class:`_GraphUnpickler`)."""
    from mpgen.commands import build
    from mpgen.compiler import driver

    facts = build.child_facts(path, build.spec_text(path))
    if facts is None:
        return driver.compile_spec(path, device_map, root, time_limit)
    digest, name_pos = facts
    request = _request("graph", path, device_map, root, time_limit)
    result, where = _ask(request, name_pos)
    _raise_errors(result, where)
    from mpgen.compiler.ir import Graph  # the classes the unpickler may load

    try:
        data = base64.b64decode(result["graph"], validate=True)
        graph = _GraphUnpickler(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - whatever the bytes are, they are refused
        graph = None
    if not isinstance(graph, Graph) or graph.spec_hash != digest:
        raise _refused(where, "a graph this spec cannot have given")
    return graph


def _request(mode: str, path: str | Path, device_map: Optional[Mapping[str, str]],
             root: str | Path | None, time_limit: Optional[float], **more: Any) -> dict:
    """What the child is asked to do, as JSON data."""
    return {"mode": mode, "path": str(path), "device_map": dict(device_map or {}),
            "root": None if root is None else str(root), "time_limit": time_limit, **more}


def _ask(request: dict, name_pos: Position) -> tuple[dict, Position]:
    """Run a child with ``request``; its verified-to-be-its-own result line
    and the last position it reported (``name_pos`` if none)."""
    token = secrets.token_hex(16)
    # The same Python: it imports from where this one would.
    request = {**request, "token": token, "sys_path": list(sys.path)}
    with tempfile.TemporaryFile() as stderr:
        outcome = _run(request, stderr)
        stderr.seek(0)
        last_words = stderr.read()[-2000:].decode("utf-8", "replace")
    lines, code, why = outcome
    where, result = name_pos, None
    for line in lines:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if not isinstance(message, dict):
            continue
        if "at" in message:
            where = _position(message.get("at")) or where
        elif message.get("token") == token:
            result = message
    if result is None or code != 0:
        tail = [s for s in last_words.strip().splitlines() if s.strip()][-1:]
        said = f"; it printed {shown(tail[0], 200)}" if tail else ""
        raise MpgenError(where, f"building this spec runs code of the project's own, in a child "
                         f"process, which {why or f'exited with status {code}'} before it "
                         f"reported a result{said}")
    return result, where


def _run(request: dict, stderr) -> tuple[list[bytes], Optional[int], Optional[str]]:
    """Start the child, hand it ``request``, and collect its lines until it
    ends or is killed: (lines, exit status, why it was killed)."""
    limit = request["time_limit"]
    cpu_cap = None if limit is None else STARTUP_CPU_SECONDS + limit + 2 * GRACE_CPU_SECONDS
    child = subprocess.Popen(
        [sys.executable, "-c", "from mpgen.commands.isolate import main; main()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=child_environment(),
        start_new_session=True)  # its own process group: killed whole
    why = None
    chunks: list[bytes] = []
    size = 0
    try:
        assert child.stdin is not None and child.stdout is not None
        with contextlib.suppress(BrokenPipeError):
            child.stdin.write(json.dumps(request).encode("utf-8"))
            child.stdin.close()
        selector = selectors.DefaultSelector()
        selector.register(child.stdout, selectors.EVENT_READ)
        started = time.monotonic()
        last_cpu, last_change = _cpu(child.pid), started
        while True:
            if selector.select(timeout=0.25):
                chunk = os.read(child.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_RESULT_BYTES:
                    why = f"wrote more than {MAX_RESULT_BYTES:,} bytes of result"
                    break
                chunks.append(chunk)
            cpu = _cpu(child.pid)
            if cpu is None:  # no /proc: wall-clock time stands in, generously
                if cpu_cap is not None and time.monotonic() - started > 4 * cpu_cap:
                    why = f"was stopped after {4 * cpu_cap:g} s"
                    break
                continue
            if cpu_cap is not None and cpu > cpu_cap:
                why = f"was stopped after {cpu:.0f} s of CPU time"
                break
            if cpu != last_cpu:
                last_cpu, last_change = cpu, time.monotonic()
            elif time.monotonic() - last_change > IDLE_SECONDS:
                why = f"was stopped after {IDLE_SECONDS:g} s without using the CPU"
                break
    finally:
        if why is None:  # its output ended: it is exiting (torch takes a moment to)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=IDLE_SECONDS)
        if child.poll() is None:
            why = why or "did not exit once its output ended"
            with contextlib.suppress(OSError):
                os.killpg(child.pid, signal.SIGKILL)
        code = child.wait()
        with contextlib.suppress(OSError):  # whatever it left running
            os.killpg(child.pid, signal.SIGKILL)
    if why is None and code is not None and code < 0:
        sig = -code
        why = ("was stopped at its CPU time limit" if sig in (signal.SIGXCPU, signal.SIGKILL)
               else f"was killed by signal {sig}")
    return b"".join(chunks).splitlines(), code, why


def _cpu(pid: int) -> Optional[float]:
    """CPU seconds (user and system) process ``pid`` has used; None where
    that cannot be read (not Linux, or it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _position(value: Any) -> Optional[Position]:
    if (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value[1:])):
        return Position(*value)
    return None


def _verified(result: dict, path: str, digest: str, where: Position) -> Isolated:
    """The child's ``result``, if it is one this spec can have given."""
    def refuse(problem: str) -> MpgenError:
        return _refused(where, problem)

    _raise_errors(result, where)
    files, entry = result.get("files"), result.get("entry")
    name, pos, notes = result.get("name"), _position(result.get("pos")), result.get("notes")
    if not (isinstance(files, dict) and isinstance(entry, dict) and isinstance(name, str)
            and pos is not None and isinstance(notes, list)
            and all(isinstance(n, str) for n in notes)):
        raise refuse("a malformed result")
    if pos.file != path:
        raise refuse(f"a result for another spec, {shown(pos.file)}")
    if entry.get("digest") != digest:
        raise refuse("a result for another text of the spec (its digest differs)")
    for file_name, text in files.items():
        if not (isinstance(text, str) and _FILE_NAME.fullmatch(file_name)):
            raise refuse(f"a file it cannot write, {shown(file_name)}")
        if f"spec digest: {digest}" not in "\n".join(text.splitlines()[:4]):
            raise refuse(f"{file_name} without this spec's digest in its header")
    if len(files) != 5:
        raise refuse(f"{len(files)} files where a build writes 5")
    return Isolated(name, pos, files, entry, tuple(notes))


def _refused(where: Position, problem: str) -> MpgenError:
    return MpgenError(where, f"the child process that built this spec reported {problem}; "
                      "the spec's own code may be interfering with the build")


def _raise_errors(result: dict, where: Position) -> None:
    """Raise the spec's errors the child reported, if it reported errors."""
    if "errors" not in result:
        return
    errors = result["errors"]
    if not isinstance(errors, list) or not errors:
        raise _refused(where, "a malformed error")
    found = []
    for item in errors:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], str)):
            raise _refused(where, "a malformed error")
        found.append(MpgenError(_position(item[0]) or where, item[1]))
    raise found[0] if len(found) == 1 else ErrorList(found)


def _stripped() -> None:
    """What a class or function in a graph sent from the child becomes."""
    return None


class _GraphPickler(pickle.Pickler):
    """Pickles a graph with every class, function and module that is not
    the IR's own replaced by :func:`_stripped`'s None (``Op.target``: the
    user's class, or torch's)."""

    def reducer_override(self, obj: Any) -> Any:
        if obj is _stripped or not isinstance(obj, _CODE):
            return NotImplemented
        if isinstance(obj, type) and obj.__module__ in _IR_MODULES:
            return NotImplemented
        return _stripped, ()


class _GraphUnpickler(pickle.Unpickler):
    """Loads only the IR's own classes and :func:`_stripped`: the bytes come
    from a process that ran the spec's code, and a pickle that could name
    any function could run any code here."""

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_stripped":
            return _stripped
        if module in _IR_MODULES:
            found = getattr(sys.modules[module], name, None)
            if isinstance(found, type) and found.__module__ == module:
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed")


_CODE = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
         types.ModuleType, functools.partial)
#: The modules whose classes a graph is made of.
_IR_MODULES = ("mpgen.compiler.ir", "mpgen.errors")


# -- the child ------------------------------------------------------------------

def main() -> None:
    """The child: read the request from stdin, build, write the result."""
    request = json.loads(sys.stdin.read())
    sys.stdin.close()
    sys.path[:] = request["sys_path"]
    # The result goes to a copy of stdout; what the spec's code prints goes
    # to stderr, so it cannot be mistaken for a result line.
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(message: dict) -> None:
        channel.write(json.dumps(message, ensure_ascii=True) + "\n")
        channel.flush()

    from mpgen.commands import build
    from mpgen.compiler import driver
    from mpgen.compiler.frontend import limits

    limit = request["time_limit"]
    _limit_resources(limit)

    def started(pos: Optional[Position], what: str) -> None:
        if pos is not None:
            say({"at": _at(pos), "what": what})

    limits.WorkBudget.observer = started
    device_map = request["device_map"] or None
    try:
        if request["mode"] == "graph":
            graph = driver.compile_spec(request["path"], device_map, request["root"], limit)
            data = io.BytesIO()
            _GraphPickler(data, protocol=pickle.HIGHEST_PROTOCOL).dump(graph)
            say({"token": request["token"],
                 "graph": base64.b64encode(data.getvalue()).decode("ascii")})
            return
        result = driver.generate(request["path"], device_map, request["root"], limit)
        built = build.compiled(result, device_map, request["text"], request["out_dir"])
    except MpgenError as exc:
        errors = exc.errors if isinstance(exc, ErrorList) else [exc]
        say({"token": request["token"], "errors": [
            [None if e.pos is None else _at(e.pos), e.message] for e in errors]})
        return
    graph = result.graph
    say({"token": request["token"], "name": graph.name, "pos": _at(graph.pos),
         "files": result.files, "entry": _fields(built.entry), "notes": list(built.notes)})


def _at(pos: Position) -> list:
    """A position as the child reports it (:func:`_position` reads it back)."""
    return [pos.file, pos.line, pos.col]


def _fields(entry) -> dict:
    import dataclasses

    fields = dataclasses.asdict(entry)
    fields["files"] = dict(fields["files"])
    return fields


def _limit_resources(time_limit: Optional[float]) -> None:
    """``RLIMIT_CPU`` from now on: the build's budget and a grace; at its
    soft limit ``SIGXCPU`` becomes the budget's own error (NOTE [User code
    in a child]); ``RLIMIT_AS``: the build's memory limit."""
    import math
    import resource

    from mpgen.compiler.frontend import limits

    memory = limits.MAX_BUILD_MEMORY
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    if time_limit is None:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + time_limit + 1)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + GRACE_CPU_SECONDS))
    signal.signal(signal.SIGXCPU, _out_of_cpu)


def _out_of_cpu(signum, frame) -> None:
    """``SIGXCPU``: the budget is spent where no check was reached (a loop
    in the spec's own code); raise the budget's error for what is under way."""
    from mpgen.compiler.frontend import limits

    budget = limits.active_budget()
    if budget is not None and budget.tasks:
        budget.deadline = float("-inf")
        budget.check()
    raise limits.OutOfBudget(None, "the build ran past its CPU budget (--time-limit SECONDS "
                             "raises it)")
