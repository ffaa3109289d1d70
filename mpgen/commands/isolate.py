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

NOTE [A contained child]
The child is contained, so that nothing it starts outlives ``check`` or
changes what ``check`` judges (``docs/ci.md`` says the same for users). The
parent starts a warden (:func:`main`, trusted code only), which makes new
PID, mount, network and IPC namespaces and starts the namespace's init
(:func:`_init`), which starts the build (:func:`_work`):

- time: besides the CPU limits and the idle watchdog, the parent stops a
  child :data:`WALL_SECONDS` of wall-clock time past its CPU cap (CPU
  limits are per process, and a module that sleeps and computes by turns
  reaches neither); every process under the child counts for the watchdogs;
- descendants: the build's processes are in the PID namespace (a
  grandchild that calls ``setsid`` too), which the kernel empties when its
  init ends; warden, init and build die with their parents
  (``PR_SET_PDEATHSIG``), so killing ``check`` kills them all. The parent
  returns only once the warden and every process under it are gone: it
  kills them and polls ``/proc`` until none is left (:func:`_stop`);
- what check judges: init remounts every mount read-only and gives the
  build a private ``tmpfs`` as ``HOME`` and ``TMPDIR``; ``check`` also
  records the output folder before any child runs and fails when it
  changed (``build._state``), and reads every spec before any child runs;
- the parent: the build sees a fresh ``/proc`` of its own namespace (the
  parent is not in it: nothing to signal, stop or read); it runs as
  :data:`NOBODY` when mpgen is root and that user can read what the build
  reads, else with every capability dropped for good (root without
  capabilities cannot remount, trace, signal init, or raise its limits);
  ``PR_SET_NO_NEW_PRIVS``; no network;
- output: the first and last :data:`KEPT_STDERR` bytes of its stderr are
  kept (:class:`_Capture`), the rest read and dropped;
- processes: a ``pids`` cgroup of :data:`MAX_TASKS` tasks where mpgen can
  make one (root, a writable ``pids`` controller), and ``RLIMIT_NPROC``
  (as many more tasks than its user has) where it is not root (that limit
  does not hold for root).

Not root: the namespaces are made inside a user namespace mapped to this
user, where the system allows one. Without namespaces (``unshare``
refused, or :data:`USE_NAMESPACES` False) nothing fails: the warden is a
subreaper (the build's orphans come to it, and it kills them when the
build ends), so is the parent while the child runs (for orphans of a
killed warden), and the parent is not dumpable meanwhile (its
``/proc/PID/environ`` needs ``CAP_SYS_PTRACE``); the tree is writable, so
only the output-folder record guards what check judges, and a build that
runs as this user can signal the parent. Without ``/proc`` and ``prctl``
(macOS), the session, the limits, the wall-clock cap, the bounded output
and the record are what hold. ``docs/ci.md`` lists these for users.

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
import ctypes
import functools
import io
import json
import os
import pickle
import re
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Optional

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
#: CPU seconds of one-time imports the budget does not count
#: (``WorkBudget.paused``), which ``RLIMIT_CPU`` allows for.
PAUSED_CPU_SECONDS = 3
#: CPU seconds the child may go on after ``SIGXCPU`` (one second past its
#: budget) before ``RLIMIT_CPU`` kills it; the parent kills it past its
#: start-up allowance, its budget and twice this.
GRACE_CPU_SECONDS = 3
#: Seconds the child may spend no CPU at all (sleeping, waiting on a
#: pipe) before the parent kills it. A child that computes, however slowly
#: on a loaded machine, is never idle this long.
IDLE_SECONDS = 5.0
#: Seconds of wall-clock time the child may run past its CPU cap (its
#: start-up allowance, its budget and twice the grace): a child that sleeps
#: and computes by turns, which neither the CPU limits nor the idle watchdog
#: stop, is stopped then; so ``check`` returns within its CPU limits and
#: this (NOTE [A contained child]).
WALL_SECONDS = 10.0
#: Seconds the parent waits for the child's processes to be gone once it
#: has killed them (``SIGKILL``: they go at once unless stuck in the kernel).
STOP_SECONDS = 10.0
#: Bytes of the child's stderr the parent keeps from its start, and as many
#: from its end (for the message); the rest is read and dropped.
KEPT_STDERR = 32 << 10
#: Tasks (processes and threads) the child may have: its ``pids`` cgroup's
#: limit, where mpgen may make one (root), and what its user may start
#: beyond those it has (``RLIMIT_NPROC``, which does not hold for root).
MAX_TASKS = 512
#: Bytes of the child's private ``HOME`` and ``TMPDIR`` (a ``tmpfs``).
PRIVATE_BYTES = 64 << 20
#: The user (and group) the child runs as when mpgen runs as root.
NOBODY = 65534
#: Whether the child is contained in namespaces where the system allows
#: them; without (False, or where it cannot make them) it is contained as
#: NOTE [A contained child] says.
USE_NAMESPACES = True
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
    stderr = _Capture()
    lines, code, why = _run(request, stderr)
    last_words = stderr.last(2000).decode("utf-8", "replace")
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


def _run(request: dict, stderr: "_Capture") -> tuple[list[bytes], Optional[int], Optional[str]]:
    """Start the child, hand it ``request``, and collect its lines until it
    ends or is stopped: (lines, exit status, why it was stopped). Returns
    only once the child and every process it started are gone (NOTE [A
    contained child])."""
    limit = request["time_limit"]
    cpu_cap = None if limit is None else STARTUP_CPU_SECONDS + limit + 2 * GRACE_CPU_SECONDS
    wall_cap = None if cpu_cap is None else cpu_cap + WALL_SECONDS
    _sweep(Path(tempfile.gettempdir()))
    home = tempfile.mkdtemp(prefix=f"mpgen-child-{os.getpid()}-")
    env = {**child_environment(), "HOME": home, "TMPDIR": home, "TEMP": home, "TMP": home}
    request = {**request, "home": home, "namespaces": USE_NAMESPACES}
    why = None
    chunks: list[bytes] = []
    size = 0
    try:
        with _guarded() as before:
            child = subprocess.Popen(
                [sys.executable, "-c", "from mpgen.commands.isolate import main; main()",
                 str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                start_new_session=True)  # its own session and process group
            assert child.stdin is not None and child.stdout is not None
            assert child.stderr is not None
            streams = {child.stdout.fileno(): "out", child.stderr.fileno(): "err"}
            try:
                with contextlib.suppress(BrokenPipeError):
                    child.stdin.write(json.dumps(request).encode("utf-8"))
                    child.stdin.close()
                selector = selectors.DefaultSelector()
                for fd in streams:
                    os.set_blocking(fd, False)
                    selector.register(fd, selectors.EVENT_READ)

                def read(fd: int) -> bool:
                    """Take what ``fd`` holds; False at its end."""
                    nonlocal size, why
                    try:
                        chunk = os.read(fd, 1 << 16)
                    except BlockingIOError:
                        return True
                    if not chunk:
                        selector.unregister(fd)
                        return False
                    if streams[fd] == "err":
                        stderr.add(chunk)
                    elif why is None:
                        size += len(chunk)
                        if size > MAX_RESULT_BYTES:
                            why = f"wrote more than {MAX_RESULT_BYTES:,} bytes of result"
                        else:
                            chunks.append(chunk)
                    return True

                started = time.monotonic()
                last_cpu, last_change, next_look = None, started, started
                while why is None:
                    for key, _ in selector.select(timeout=0.25):
                        read(key.fd)
                    now = time.monotonic()
                    if now < next_look:
                        continue
                    next_look = now + 0.25
                    if child.poll() is not None:  # it, and so the build, has ended
                        break
                    if wall_cap is not None and now - started > wall_cap:
                        why = f"was stopped after {wall_cap:g} s of wall-clock time"
                        break
                    tree = tree_cpu(child.pid)
                    if not tree:  # no /proc: the wall-clock cap stands alone
                        continue
                    top = max(tree.values())
                    if cpu_cap is not None and top > cpu_cap:
                        why = f"was stopped after {top:.0f} s of CPU time"
                        break
                    cpu = sum(tree.values())
                    if cpu != last_cpu:
                        last_cpu, last_change = cpu, now
                    elif now - last_change > IDLE_SECONDS:
                        why = f"was stopped after {IDLE_SECONDS:g} s without using the CPU"
            finally:
                gone = _stop(child, before)
                # Every writer is gone: what the pipes still hold, then their end.
                drained = time.monotonic() + 1
                while selector.get_map() and time.monotonic() < drained:
                    for key, _ in selector.select(timeout=0.05):
                        read(key.fd)
                for stream in (child.stdout, child.stderr):
                    stream.close()
            if not gone:
                why = why or "left processes that could not be stopped"
            group = _task_group(child.pid)
            if gone and group is not None:
                with contextlib.suppress(OSError):
                    group.rmdir()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    code = child.returncode
    if why is None and code is not None and code < 0:
        sig = -code
        why = ("was stopped at its CPU time limit" if sig in (signal.SIGXCPU, signal.SIGKILL)
               else f"was killed by signal {sig}")
    return b"".join(chunks).splitlines(), code if gone else None, why


class _Capture:
    """The child's stderr, bounded: its first and last :data:`KEPT_STDERR`
    bytes; what lies between is read and dropped (a child cannot fill the
    parent's memory by printing)."""

    def __init__(self) -> None:
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0  # bytes it wrote in all

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = KEPT_STDERR - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            del self.tail[:-KEPT_STDERR]

    @property
    def kept(self) -> int:
        return len(self.head) + len(self.tail)

    def last(self, count: int) -> bytes:
        """Its last ``count`` bytes kept."""
        return bytes(self.head + self.tail)[-count:]


def _processes() -> Optional[dict[int, tuple[int, bytes, float]]]:
    """Every process: pid -> (parent pid, state, CPU seconds used, user and
    system); None where ``/proc`` cannot be read (not Linux)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            found[int(name)] = (int(fields[1]), fields[0], (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return found


def _descendants(roots: Iterable[int], table: Mapping[int, tuple[int, bytes, float]]) -> set[int]:
    """``roots`` (those alive) and every process under them in ``table``."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of process ``pid`` and of each process under it; empty
    where that cannot be read."""
    table = _processes() or {}
    return {p: table[p][2] for p in _descendants([pid], table)}


@contextlib.contextmanager
def _guarded() -> Iterator[set[int]]:
    """While a child runs: this process adopts whatever the child's processes
    leave orphaned (``PR_SET_CHILD_SUBREAPER``, so that :func:`_stop` finds
    them where no PID namespace holds them), and its memory and
    environment cannot be read by a process of its own user
    (``PR_SET_DUMPABLE`` 0: ``/proc/PID/environ`` needs ``CAP_SYS_PTRACE``).
    Yields the children this process had before (they are not the child's);
    both settings are restored after."""
    table = _processes() or {}
    before = {pid for pid, (ppid, _, _) in table.items() if ppid == os.getpid()}
    reaper, dumpable = ctypes.c_int(0), _prctl(_PR_GET_DUMPABLE)
    adopted = _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.addressof(reaper)) == 0
    adopted = adopted and _prctl(_PR_SET_CHILD_SUBREAPER, 1) == 0 and not reaper.value
    hidden = dumpable == 1 and _prctl(_PR_SET_DUMPABLE, 0) == 0
    try:
        yield before
    finally:
        if adopted:
            _prctl(_PR_SET_CHILD_SUBREAPER, 0)
        if hidden:
            _prctl(_PR_SET_DUMPABLE, 1)


def _stop(child: subprocess.Popen, before: set[int]) -> bool:
    """Kill ``child`` (if it still runs) and every process under it, and those
    this process adopted meanwhile (not in ``before``), and wait until all
    are gone: reaped, or no longer in ``/proc``. False if some are still
    there after :data:`STOP_SECONDS` (a process stuck in the kernel)."""
    deadline = time.monotonic() + STOP_SECONDS
    me = os.getpid()
    while True:
        ended = child.poll() is not None
        table = _processes()
        if table is None:  # not Linux: its process group is what can be reached
            with contextlib.suppress(OSError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return True
        adopted = [p for p, (ppid, _, _) in table.items()
                   if ppid == me and p not in before and p != child.pid]
        left = _descendants([child.pid, *adopted], table) - {me}
        if ended:
            left.discard(child.pid)
        if not left:
            return True
        for pid in left:
            if table[pid][1] != b"Z":
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if pid != child.pid and table[pid][0] == me:  # adopted: reap it
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)  # until /proc shows them gone


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
    # <name>.py, train_, test_, pp_, predict_, the report; and a decoder's generate_
    expected = 6 + any(file_name.startswith("generate_") for file_name in files)
    if len(files) != expected:
        raise refuse(f"{len(files)} files where a build writes {expected}")
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
    """The child's warden (NOTE [A contained child]): it dies with the
    parent, reads the request, makes the namespaces, and waits on the
    process that builds (:func:`_init`); it exits as that process did."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if len(sys.argv) > 1 and os.getppid() != int(sys.argv[1]):
        os._exit(1)  # the parent died before this one could follow it
    request = json.loads(sys.stdin.read())
    sys.stdin.close()
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _prctl(_PR_SET_DUMPABLE, 0)
    uid = _user(request)
    tasks = _tasks_of(uid) + MAX_TASKS
    _join_task_group(_task_group(os.getpid()))
    namespaced = bool(request.get("namespaces")) and _unshare()
    if not namespaced:  # what the build's processes leave orphaned comes here
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    said, told = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(said)
            _init(request, namespaced, uid, tasks, told)
        finally:
            os._exit(70)
    os.close(told)
    status = _reap_until(pid)
    with os.fdopen(said, "rb") as f:
        reported = f.read()
    if reported.strip().isdigit():
        status = int(reported)
    if not namespaced:
        _kill_under(os.getpid())
    _exit_as(status)


def _init(request: dict, namespaced: bool, uid: int, tasks: int, told: int) -> None:
    """The first process of the child's PID namespace (its init: orphans
    come to it, and the kernel kills every process in the namespace when it
    ends): it makes the file system read-only, mounts a fresh ``/proc`` and
    a private ``HOME``, starts the build (:func:`_work`), and reports how
    the build ended on ``told``."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(_PR_SET_DUMPABLE, 0)
    home = request["home"]
    if namespaced:
        _mount(home, uid)
    elif uid != os.getuid():
        with contextlib.suppress(OSError):
            os.chown(home, uid, uid)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(told)
            _work(request, uid, tasks)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - reported as the build's failure
            import traceback

            traceback.print_exc()
            code = 1
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)
    status = _reap_until(pid)
    os.write(told, str(status).encode("ascii"))
    os._exit(0)


def _work(request: dict, uid: int, tasks: int) -> None:
    """The process that runs the spec's code: it dies with its init, has no
    privilege (another user, or no capability), a process-count limit, and
    builds."""
    import resource

    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if uid != os.getuid():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    elif uid == 0 or _capabilities():
        _drop_capabilities()
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    if _capabilities():
        raise OSError("the build's process could not drop its privileges")
    if uid != 0:  # RLIMIT_NPROC does not hold for root
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NPROC, (tasks, tasks))
    _build(request)


def _reap_until(pid: int) -> int:
    """Reap every child until ``pid`` ends; its wait status."""
    while True:
        try:
            found, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        if found == pid:
            return status


def _kill_under(pid: int) -> None:
    """Kill every process under ``pid`` and reap those that come to it, until
    none is left (this process is their subreaper)."""
    while True:
        table = _processes() or {}
        left = _descendants([pid], table) - {pid}
        for other in left:
            with contextlib.suppress(OSError):
                os.kill(other, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            if not left:
                return
        if not left:
            return
        time.sleep(0.01)


def _exit_as(status: int) -> None:
    """End this process as wait status ``status`` says its build ended."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


# -- the operating system's parts -----------------------------------------------

_PR_SET_PDEATHSIG = 1
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_PR_SET_SECUREBITS = 28
_PR_GET_CHILD_SUBREAPER = 37
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
#: Root's privileges do not come back on exec or setuid, and cannot be re-enabled.
_SECUREBITS_LOCKED = 0x2F
_CLONE_NEWNS = 0x00020000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
#: The flags of a mount that a read-only remount keeps (it must, in a user namespace).
_MOUNT_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC,
                "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}


@functools.lru_cache(maxsize=None)
def _libc() -> Optional[ctypes.CDLL]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _call(name: str, *args: Any) -> int:
    """libc's ``name``: its result, or -1 where there is no such call."""
    libc = _libc()
    function = getattr(libc, name, None) if libc is not None else None
    if function is None:
        return -1
    return function(*args)


def _prctl(option: int, *args: int) -> int:
    return _call("prctl", option, *[ctypes.c_ulong(a) for a in args],
                 *[ctypes.c_ulong(0)] * (4 - len(args)))


def _unshare() -> bool:
    """Put this process into new mount, network and IPC namespaces, and its
    children into a new PID namespace: as root directly, as another user
    inside a new user namespace (mapped to this user) where the system
    allows one. False where neither works: the child is then contained
    without namespaces."""
    flags = _CLONE_NEWPID | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC
    if os.geteuid() != 0:
        uid, gid = os.getuid(), os.getgid()
        if _call("unshare", _CLONE_NEWUSER) != 0:
            return False
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                               ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError:
            return False
    return _call("unshare", flags) == 0


def _mount(home: str, uid: int) -> None:
    """In the child's own mount namespace: every mount read-only (the
    project, the output folder, /tmp: the child cannot change what check
    judges, nor write anywhere), a fresh ``/proc`` of its PID namespace
    (this process's parent and the rest of the system are not in it), and
    a private, bounded ``tmpfs`` as its ``HOME`` and ``TMPDIR``. A mount
    that cannot be changed is left (the parent's snapshot still holds)."""
    mount = _call
    mount("mount", None, b"/", None, ctypes.c_ulong(_MS_REC | _MS_PRIVATE), None)
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if len(fields) < 6:
            continue
        point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])
        kept = sum(_MOUNT_FLAGS.get(o.decode("ascii", "replace"), 0)
                   for o in fields[5].split(b","))
        mount("mount", None, point, None,
              ctypes.c_ulong(_MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept), None)
    mount("mount", b"proc", b"/proc", b"proc", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV | _MS_NOEXEC),
          None)
    options = f"size={PRIVATE_BYTES},mode=0700,uid={uid},gid={uid}".encode("ascii")
    mount("mount", b"tmpfs", os.fsencode(home), b"tmpfs",
          ctypes.c_ulong(_MS_NOSUID | _MS_NODEV), options)


def _capabilities() -> bool:
    """Whether this process holds any capability (``/proc/self/status``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("CapEff:", "CapPrm:")) and int(line.split()[1], 16):
                    return True
    except (OSError, ValueError):
        return False
    return False


def _drop_capabilities() -> None:
    """Give up every capability for good: root without them cannot remount,
    trace or signal another user's process, nor raise its limits."""
    for cap in range(64):
        _prctl(_PR_CAPBSET_DROP, cap)
    _prctl(_PR_SET_SECUREBITS, _SECUREBITS_LOCKED)
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    _call("capset", header, data)


def _user(request: dict) -> int:
    """The user the build runs as: ``nobody`` when this is root and that user
    can read everything the build reads (the spec, the project, Python and
    its packages); else this one (root then gives up its capabilities)."""
    uid = os.getuid()
    if uid != 0:
        return uid
    needed = [os.getcwd(), request["path"], request.get("root"), sys.executable,
              *request["sys_path"]]
    readable = all(_readable(Path(p), NOBODY) for p in needed if p and os.path.exists(p))
    return NOBODY if readable else 0


def _readable(path: Path, uid: int) -> bool:
    """Whether user ``uid`` (in its group of the same number) can read
    ``path``, by permission bits (ACLs aside)."""
    for candidate in {path.absolute(), path.resolve()}:
        for place in [*reversed(candidate.parents), candidate]:
            try:
                st = os.stat(place)
            except OSError:
                return False
            bits = 6 if st.st_uid == uid else 3 if st.st_gid == uid else 0
            mode = (st.st_mode >> bits) & 7
            need = 1 if place != candidate else 4 | (1 if stat.S_ISDIR(st.st_mode) else 0)
            if mode & need != need:
                return False
    return True


def _task_group(pid: int) -> Optional[Path]:
    """The ``pids`` cgroup folder the warden ``pid`` makes for itself and
    every process under it (beside this process's own cgroup); None where
    there is no ``pids`` controller to use."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "pids" in controllers.split(","):
            base = Path("/sys/fs/cgroup/pids") / path.lstrip("/")
        elif number == "0" and not controllers:
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            try:
                if "pids" not in (base / "cgroup.subtree_control").read_text().split():
                    continue
            except OSError:
                continue
        else:
            continue
        return base / f"mpgen-child-{pid}"
    return None


def _join_task_group(folder: Optional[Path]) -> None:
    """Put this process, and so all it starts, in ``folder``'s cgroup with at
    most :data:`MAX_TASKS` tasks, where this process may make one (root,
    with a writable ``pids`` controller); the parent removes it."""
    if folder is None:
        return
    _sweep(folder.parent)
    try:
        folder.mkdir()
    except OSError:
        return
    try:
        (folder / "pids.max").write_text(str(MAX_TASKS))
        (folder / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _sweep(folder: Path) -> None:
    """Remove what the children of an mpgen that was killed left in
    ``folder``: the cgroups and private folders named ``mpgen-child-PID``
    (``-...``) of a process that is gone, and that this user owns."""
    if not os.path.isdir("/proc/self"):  # no way to tell a live process
        return
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            found = re.fullmatch(r"mpgen-child-([0-9]+)(-.*)?", entry.name)
            if not (found and entry.is_dir(follow_symlinks=False)) or \
                    os.path.exists(f"/proc/{found[1]}") or \
                    entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            if found[2]:
                shutil.rmtree(entry.path, ignore_errors=True)
            else:  # a cgroup: removed as a folder, and only when empty
                with contextlib.suppress(OSError):
                    os.rmdir(entry.path)


def _tasks_of(uid: int) -> int:
    """Tasks (processes and threads) user ``uid`` has now: ``RLIMIT_NPROC``
    counts them all, system-wide."""
    count = 0
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{name}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{name}/task"))
    return count


def _build(request: dict) -> None:
    """The build itself, contained (:func:`_work`): build, write the result."""
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
    # the budget, a second, and the one-time imports it does not count
    # (WorkBudget.paused: torch's dynamo for the memory plan, about 1 s)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + time_limit + 1 + PAUSED_CPU_SECONDS)
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
