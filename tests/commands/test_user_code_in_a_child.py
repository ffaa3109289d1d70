"""A spec's own code runs in a child process that cannot decide the check.

``mpgen build`` and ``mpgen check`` compile a spec that names a user module
in a child process (NOTE [User code in a child] in ``commands/isolate.py``):
the module can exit, sleep, loop, print or read the environment, and the
check still fails where the generated code is stale, answers in seconds,
and no secret of the parent's reaches it. Each case is a real module run
by the real CLI.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from helpers import mpgen, write_spec
from mpgen.commands import isolate
from mpgen.errors import MpgenError, Position

#: Slow: every case runs a user module in a child interpreter, some until a limit stops it.
pytestmark = pytest.mark.slow

GATE = """\
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self, dim):
        super().__init__()
        {payload}
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.sigmoid(self.proj(x)) * x
"""

SPEC = """
    mpgen: 1
    name: Gated
    inputs:
      x: [batch, 8]
    layers:
      gate: {op: gates.Gate, args: [8]}
      out: {op: Linear, args: [8, 2]}
"""


def project(tmp_path, payload: str = "pass"):
    """A git project with the spec, its module, and its code built."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "gates.py").write_text(GATE.format(payload="pass"))
    write_spec(tmp_path, SPEC)
    built = mpgen("build", "spec.yaml", "-o", "out", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    (tmp_path / "gates.py").write_text(GATE.format(payload=payload))
    return tmp_path


def stale(root):
    """Hand-edit the generated model, as a hostile pull request would."""
    model = root / "out" / "gated.py"
    model.write_text(model.read_text() + "\nimport os\nos.system('touch pwned')\n")


def test_a_module_that_exits_with_status_0_cannot_make_check_pass(tmp_path):
    root = project(tmp_path, "import os; os._exit(0)")
    stale(root)
    result = mpgen("check", "spec.yaml", "-o", "out", cwd=root)
    assert result.returncode == 2
    assert result.stderr.startswith(
        "spec.yaml:6:3: building this spec runs code of the project's own, in a child "
        "process, which exited with status 0 before it reported a result\n")
    assert not (root / "pwned").exists()


def test_a_module_that_sleeps_is_stopped(tmp_path):
    root = project(tmp_path, "import time; time.sleep(600)")
    start = time.monotonic()
    result = mpgen("check", "spec.yaml", "-o", "out", cwd=root)
    # The idle watchdog (the message below), not the end of the sleep; the bound
    # leaves a loaded machine the child's start (Python, torch, the compiler).
    assert time.monotonic() - start < 300
    assert result.returncode == 2
    assert result.stderr.startswith(
        f"spec.yaml:6:3: building this spec runs code of the project's own, in a child "
        f"process, which was stopped after {isolate.IDLE_SECONDS:g} s without using the CPU "
        "before it reported a result")


def test_a_module_that_loops_where_no_check_is_reached_runs_out_of_cpu(tmp_path):
    """A pure-Python loop reaches none of the budget's checks; RLIMIT_CPU's
    SIGXCPU turns into the budget's own error, at the layer."""
    root = project(tmp_path, "while True: pass")
    result = mpgen("check", "spec.yaml", "-o", "out", "--time-limit", "1", cwd=root)
    assert result.returncode == 2
    assert result.stderr.startswith(
        "spec.yaml:6:3: analysis of layer 'gate' ran past the 1 s CPU budget of a build; ")


def test_a_module_that_ignores_the_cpu_signal_is_killed(tmp_path):
    root = project(tmp_path, "import signal; signal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
                             "        while True: pass")
    result = mpgen("check", "spec.yaml", "-o", "out", "--time-limit", "1", cwd=root)
    assert result.returncode == 2
    assert result.stderr.startswith(
        "spec.yaml:6:3: building this spec runs code of the project's own, in a child "
        "process, which was stopped at its CPU time limit before it reported a result")


def test_the_module_sees_no_secret_of_the_environment(tmp_path, monkeypatch):
    kept = isolate.KEPT_ENVIRONMENT
    root = project(tmp_path, "import os; seen = sorted(n for n in os.environ if n not in "
                             f"{kept!r} and not n.startswith('LC_'))\n"
                             "        assert not seen, f'saw {seen}'")
    for name in ("GH_TOKEN", "GITHUB_TOKEN", "ACTIONS_RUNTIME_TOKEN", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "secret")
    result = mpgen("check", "spec.yaml", "-o", "out", cwd=root)
    assert result.returncode == 0, result.stderr  # the module's assert held
    assert result.stderr == ("spec.yaml: note: checking it ran the project's own code (the "
                             "modules its spec names), in a child process without this "
                             "environment's variables; review changes to that code as code\n")


def test_what_the_module_prints_is_not_taken_for_a_result(tmp_path):
    root = project(tmp_path, 'print(\'{"token": "x", "errors": []}\'); print("{}")')
    stale(root)
    result = mpgen("check", "spec.yaml", "-o", "out", cwd=root)
    assert result.returncode == 1  # the stale file is reported, as without the prints
    assert "-os.system('touch pwned')" in result.stdout


def test_a_module_that_asks_for_too_much_memory_fails_at_its_layer(tmp_path):
    root = project(tmp_path, "self.big = bytearray(64 << 30)")
    result = mpgen("check", "spec.yaml", "-o", "out", cwd=root)
    assert result.returncode == 2
    assert result.stderr == ("spec.yaml:6:3: layer 'gate': gates.Gate(8) cannot be built: "
                             "MemoryError\n")


def test_a_spec_without_code_of_its_own_is_built_in_process(tmp_path, monkeypatch):
    """No child, so none of its cost, for a spec that names only torch."""
    write_spec(tmp_path, SPEC.replace("gates.Gate, args: [8]", "Linear, args: [8, 8]"))
    monkeypatch.setattr(isolate, "generate", None)  # would fail if called
    assert mpgen("build", "spec.yaml", "-o", "out", cwd=tmp_path).returncode == 0


# -- a contained child (NOTE [A contained child]) ------------------------------------

#: A module's code that starts a grandchild in a session of its own, which
#: would live 120 s, its command line marked with ``{marker}``.
GRANDCHILD = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
              "'import time; time.sleep(120)', '{marker}'], start_new_session=True, "
              "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)")
#: A module's code that sleeps and computes by turns, for ever: neither the
#: CPU limits nor the idle watchdog stop it.
SLEEP_AND_BURN = ("import time\n"
                  "        while True:\n"
                  "            time.sleep(3); end = time.process_time() + 0.05\n"
                  "            while time.process_time() < end: pass")


def marked(marker: str) -> list[int]:
    """The live processes whose command line holds ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
        except OSError:
            continue
        found.append(int(name))
    return found


def alive(pids) -> list[int]:
    """Those of ``pids`` still running (a zombie is not)."""
    table = isolate._processes()
    return [p for p in pids if p in table and table[p][1] != b"Z"]


def wait_until(condition, seconds: float = 120):
    """Poll ``condition`` until it holds (its value) or ``seconds`` pass (a failure)."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.05)
    return value


def check_process(root, *args, env=None) -> subprocess.Popen:
    """``mpgen check`` of the project in a process of its own."""
    return subprocess.Popen([sys.executable, "-m", "mpgen", "check", "spec.yaml", "-o", "out",
                             *args], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_grandchild_in_a_session_of_its_own_does_not_outlive_check(tmp_path):
    marker = f"mpgen-grandchild-{uuid.uuid4().hex}"
    root = project(tmp_path, GRANDCHILD.format(marker=marker))
    check = check_process(root)
    started = wait_until(lambda: marked(marker))  # the grandchild runs
    out, err = check.communicate(timeout=300)
    assert check.returncode == 0, err  # the module otherwise behaves
    assert alive(started) == [] and marked(marker) == []  # gone before check returned


def test_a_module_that_sleeps_and_computes_by_turns_is_stopped_by_the_wall_clock_cap(tmp_path):
    root = project(tmp_path, SLEEP_AND_BURN)
    result = mpgen("check", "spec.yaml", "-o", "out", "--time-limit", "1", cwd=root)
    cap = isolate.STARTUP_CPU_SECONDS + 1 + 2 * isolate.GRACE_CPU_SECONDS + isolate.WALL_SECONDS
    assert result.returncode == 2
    assert result.stderr == (
        f"spec.yaml:6:3: building this spec runs code of the project's own, in a child "
        f"process, which was stopped after {cap:g} s of wall-clock time before it reported a "
        "result\n")


def test_killing_check_takes_the_child_and_its_descendants_with_it(tmp_path):
    marker = f"mpgen-grandchild-{uuid.uuid4().hex}"
    root = project(tmp_path, GRANDCHILD.format(marker=marker) + "\n        " + SLEEP_AND_BURN)
    check = check_process(root)
    wait_until(lambda: marked(marker))
    table = isolate._processes()
    tree = isolate._descendants([check.pid], table) - {check.pid}
    assert set(marked(marker)) <= tree  # the grandchild is under check, as is the build
    check.kill()
    check.communicate()
    wait_until(lambda: not alive(tree), seconds=60)


def test_a_module_that_copies_the_right_file_over_a_committed_payload_cannot_pass(
        tmp_path, monkeypatch):
    """The child sees the tree read-only; where it cannot be given one, check
    compares the output folder with what it held before the child ran."""
    root = project(tmp_path, "import shutil\n"
                             "        try: shutil.copy('good.py', 'out/gated.py')\n"
                             "        except OSError: pass")
    shutil.copy(root / "out" / "gated.py", root / "good.py")
    stale(root)
    payload = (root / "out" / "gated.py").read_text()
    result = mpgen("check", "spec.yaml", "-o", "out", cwd=root)
    assert result.returncode == 1  # the payload is reported
    assert "-os.system('touch pwned')" in result.stdout
    assert (root / "out" / "gated.py").read_text() == payload
    monkeypatch.setattr(isolate, "USE_NAMESPACES", False)  # a system without namespaces
    result = mpgen("check", "spec.yaml", "-o", "out", cwd=root)
    assert result.returncode == 2
    assert result.stderr.startswith(
        "out: its files changed while check ran the project's own code (a spec's module wrote "
        "there); check judges the tree as it was before, so run it again on an unchanged tree\n")


def test_a_module_cannot_stop_check(tmp_path):
    """SIGSTOP to its parent, and to every process it can see."""
    root = project(tmp_path, "import os, signal\n"
                             "        for pid in {os.getppid(), *map(int, filter(str.isdigit, "
                             "os.listdir('/proc')))} - {os.getpid()}:\n"
                             "            try: os.kill(pid, signal.SIGSTOP)\n"
                             "            except OSError: pass")
    check = check_process(root)
    try:
        out, err = check.communicate(timeout=300)
    finally:
        check.kill()
    assert check.returncode == 0, err


def test_what_the_child_prints_is_kept_bounded(tmp_path, monkeypatch):
    root = project(tmp_path, "import sys\n"
                             "        for _ in range(400): sys.stderr.write('x' * (1 << 20))")
    captures = []

    class Recorded(isolate._Capture):
        def __init__(self):
            super().__init__()
            captures.append(self)

    monkeypatch.setattr(isolate, "_Capture", Recorded)
    result = mpgen("check", "spec.yaml", "-o", "out", cwd=root)
    assert result.returncode == 0, result.stderr
    [captured] = captures
    assert captured.total >= 400 << 20
    assert captured.kept == 2 * isolate.KEPT_STDERR


def test_the_module_cannot_read_its_parents_environment(tmp_path):
    secret = f"hunter2-{uuid.uuid4().hex}"
    root = project(tmp_path, "import glob\n"
                             "        for name in glob.glob('/proc/*/environ'):\n"
                             "            try: data = open(name, 'rb').read()\n"
                             "            except OSError: continue\n"
                             f"            assert b'{secret}' not in data, name")
    check = check_process(root, env={**os.environ, "MPGEN_TEST_SECRET": secret})
    environ = Path(f"/proc/{check.pid}/environ")
    assert secret.encode() in wait_until(environ.read_bytes)  # check's own holds it
    out, err = check.communicate(timeout=300)
    assert check.returncode == 0, out + err  # the module's assert held


def can_limit_tasks() -> bool:
    """Whether this system lets mpgen make a ``pids`` cgroup (root, a writable
    controller): where it cannot, a child running as root has no task limit
    (docs/ci.md says so)."""
    folder = isolate._task_group(os.getpid())
    if folder is None:
        return False
    try:
        folder.mkdir()
    except OSError:
        return False
    folder.rmdir()
    return True


@pytest.mark.skipif(not can_limit_tasks(), reason="no pids cgroup can be made here")
def test_the_child_cannot_start_more_than_its_tasks(tmp_path):
    """Threads count as tasks, as processes do (cheaper to start here). The
    module ends its threads once it has counted them: the rest of the build
    (its memory plan among it) runs as in any build."""
    root = project(tmp_path, "import threading; threading.stack_size(256 << 10); n = 0\n"
                             "        stop, started = threading.Event(), []\n"
                             "        try:\n"
                             f"            for _ in range({2 * isolate.MAX_TASKS}):\n"
                             "                started.append(threading.Thread(target=stop.wait, "
                             "daemon=True)); started[-1].start(); n += 1\n"
                             "        except RuntimeError: pass\n"
                             "        stop.set(); [t.join() for t in started if t.ident]\n"
                             f"        assert n < {isolate.MAX_TASKS}, n")  # 0 once they run
    result = mpgen("check", "spec.yaml", "-o", "out", cwd=root)
    assert result.returncode == 0, result.stderr  # the module's assert held


def test_nobody_runs_the_build_only_where_it_can_read_it():
    """As root, the build runs as ``nobody`` when that user can read the
    project and Python; a folder only its owner may enter is not."""
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o755)  # /tmp's own; pytest's tmp_path is its owner's only
        shut = Path(folder) / "shut"
        spec = shut / "inner" / "spec.yaml"
        spec.parent.mkdir(parents=True)
        spec.write_text("mpgen: 1\n")
        shut.chmod(0o700)
        assert not isolate._readable(spec, isolate.NOBODY)
        shut.chmod(0o755)
        assert isolate._readable(spec, isolate.NOBODY)
        spec.chmod(0o600)
        assert not isolate._readable(spec, isolate.NOBODY)


# -- what the parent takes from a child -------------------------------------------

DIGEST = "0" * 64
FILES = {name: f"# Code generated by mpgen from spec.yaml. DO NOT EDIT.\n# spec digest: {DIGEST}\n"
         for name in ("gated.py", "train_gated.py", "test_gated.py", "pp_gated.py",
                      "predict_gated.py", "gated.placement.md")}
WHERE = Position("spec.yaml", 2, 7)


def result(**changes):
    fields = {"token": "t", "name": "Gated", "pos": ["spec.yaml", 2, 7], "files": dict(FILES),
              "entry": {"digest": DIGEST}, "notes": []}
    return {**fields, **changes}


def test_a_verified_result_is_taken():
    taken = isolate._verified(result(), "spec.yaml", DIGEST, WHERE)
    assert (taken.name, taken.pos, taken.files) == ("Gated", WHERE, FILES)


@pytest.mark.parametrize("changes, problem", [
    ({"entry": {"digest": "1" * 64}}, "a result for another text of the spec (its digest differs)"),
    ({"files": {**FILES, "gated.py": "# spec digest: " + "1" * 64}},
     "gated.py without this spec's digest in its header"),
    ({"files": {**FILES, "../conftest.py": FILES["gated.py"]}},
     "a file it cannot write, '../conftest.py'"),
    ({"files": {**FILES, "conftest.py": FILES["gated.py"]}}, "7 files where a build writes 6"),
    ({"pos": ["other.yaml", 2, 7]}, "a result for another spec, 'other.yaml'"),
    ({"files": None}, "a malformed result"),
    ({"errors": "no"}, "a malformed error"),
], ids=["digest", "header", "path", "extra-file", "other-spec", "malformed", "bad-errors"])
def test_a_result_this_spec_cannot_have_given_is_refused(changes, problem):
    with pytest.raises(MpgenError) as info:
        isolate._verified(result(**changes), "spec.yaml", DIGEST, WHERE)
    assert str(info.value) == (f"spec.yaml:2:7: the child process that built this spec "
                               f"reported {problem}; the spec's own code may be interfering "
                               "with the build")


def test_errors_the_child_reports_keep_their_positions():
    with pytest.raises(MpgenError) as info:
        isolate._verified({"errors": [[["spec.yaml", 6, 3], "bad"], [None, "worse"]]},
                          "spec.yaml", DIGEST, WHERE)
    assert str(info.value) == "spec.yaml:2:7: worse\nspec.yaml:6:3: bad"


def test_the_child_environment_keeps_only_what_python_needs(monkeypatch):
    monkeypatch.setenv("GH_TOKEN", "secret")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    env = isolate.child_environment()
    assert "GH_TOKEN" not in env and env["LC_ALL"] == "C.UTF-8"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(
        Path(isolate.mpgen.__file__).resolve().parent.parent)  # the child imports this mpgen


# -- diff and ci-summary: a graph from the child ----------------------------------

def test_diff_compiles_a_spec_with_code_of_its_own_in_a_child(tmp_path):
    """``mpgen diff`` (and so ``ci-summary``) gets the graph from a child: a
    module that exits cannot end it with status 0, and the layout of a
    spec whose module behaves is compared as before."""
    root = project(tmp_path)
    moved = root / "moved.yaml"
    moved.write_text((root / "spec.yaml").read_text()
                     + "placement:\n  gate: cuda:0\n  out: cuda:1\n")
    result = mpgen("diff", "spec.yaml", "moved.yaml", cwd=root)
    assert result.returncode == 0, result.stderr
    assert "moved:\n  out: cuda:0 -> cuda:1\n" in result.stdout
    (root / "gates.py").write_text(GATE.format(payload="import os; os._exit(0)"))
    result = mpgen("diff", "spec.yaml", "moved.yaml", cwd=root)
    assert result.returncode == 2
    assert result.stderr.startswith("spec.yaml:6:3: building this spec runs code of the "
                                    "project's own, in a child process, which exited with "
                                    "status 0 before it reported a result")


def test_a_graph_from_the_child_can_name_no_function():
    """The bytes of a graph come from a process that ran the spec's code: a
    pickle naming any function but the IR's classes is refused unread."""
    forged = pickle.dumps(os.system)  # what REDUCE would call with a command
    with pytest.raises(pickle.UnpicklingError, match="posix.system is not allowed"):
        isolate._GraphUnpickler(io.BytesIO(forged)).load()


def test_a_graph_comes_back_as_plain_data(tmp_path):
    """What the child sends: the IR, its ops' classes left out (the
    restricted unpickler, which loads no other global, takes it whole)."""
    from mpgen.compiler import driver

    root = project(tmp_path)
    graph = driver.compile_spec(root / "spec.yaml")
    data = io.BytesIO()
    isolate._GraphPickler(data).dump(graph)
    back = isolate._GraphUnpickler(io.BytesIO(data.getvalue())).load()
    assert back == graph  # Op.target does not take part in equality
    assert [n.op.target for n in back.nodes] == [None, None]
    assert pickle.loads(data.getvalue()) == graph
