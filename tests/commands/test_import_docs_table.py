"""docs/import.md's tables of library models ("What each model gives") are
the models the tests import and reproduce, no more and no fewer: each row a
model that test_import_libraries, test_import_library_forms or
test_import_casts imports directly, and test_import_wrapped_corpus through
a wrapper of the user's own. Reads the test modules' parametrizations; runs
nothing."""

from __future__ import annotations

import re

from helpers import ROOT
from test_import_casts import MODELS as CASTS
from test_import_libraries import HUGGING_FACE, TORCHVISION
from test_import_library_forms import CASES as FORMS
from test_import_wrapped_corpus import CASES as WRAPPED

#: A table row's first cell: `MODULE:NAME`, and its words after.
ROW = re.compile(r"^\| `([\w.]+:\w+)`", re.M)


def _documented() -> list[str]:
    text = (ROOT / "docs" / "import.md").read_text(encoding="utf-8")
    section = text.split("### What each model gives", 1)[1].split("\n## ", 1)[0]
    return ROW.findall(section)


def _reproduced() -> dict[str, str]:
    """target -> the test's case name, for every directly imported model."""
    cases = {**HUGGING_FACE, **TORCHVISION, **FORMS, **CASTS}
    return {case[0]: name for name, case in cases.items()}


def test_the_table_lists_each_reproduced_model_once():
    documented = _documented()
    assert len(documented) == len(set(documented)), documented
    assert sorted(documented) == sorted(_reproduced())


def test_each_listed_model_is_reproduced_through_a_wrapper_too():
    # The wrapped corpus makes each model as the user would (the class or the
    # function the target names, its tiny configuration the direct test's).
    made = {name: case[1] for name, case in WRAPPED.items()}
    for target, name in _reproduced().items():
        function = target.rpartition(":")[2]
        assert name in made and re.search(rf"\b{function}\(", made[name]), (
            f"{target} ({name}) is not imported through a wrapper in "
            "test_import_wrapped_corpus")
