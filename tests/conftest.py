"""Suite-wide fixtures: the tests run the CLI in-process, so each test gets the
interpreter state it started with back (cwd, ``sys.path``, user modules).
"""

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

#: Where modules may come from and stay imported: the interpreter, the venv
#: and mpgen itself. Anything else imported during a test (a spec folder's user
#: ops, a generated model imported by its training script) is the test's own.
_KEEP = tuple(str(Path(p).resolve()) + os.sep for p in
              {sys.prefix, sys.base_prefix, sys.exec_prefix, TESTS.parent / "mpgen"})


def _is_the_tests_own(module) -> bool:
    places = [getattr(module, "__file__", None), *(getattr(module, "__path__", None) or [])]
    places = [str(Path(p).resolve()) for p in places if isinstance(p, str)]
    return bool(places) and not all(p.startswith(_KEEP) for p in places)


@pytest.fixture(autouse=True, scope="session")
def _private_build_cache(tmp_path_factory):
    """Build manifests of output folders outside a git repository go to the
    user's cache (NOTE [Build manifest]): the tests' own, not the user's."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(autouse=True)
def _restore_process_state():
    """Undo a test's chdir, ``sys.path`` edits and the user modules it imported,
    so that no test sees another's (test order must not matter)."""
    cwd = os.getcwd()
    path = list(sys.path)
    modules = set(sys.modules)
    yield
    os.chdir(cwd)
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        if _is_the_tests_own(sys.modules[name]):
            del sys.modules[name]
