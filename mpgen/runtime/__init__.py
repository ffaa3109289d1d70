"""The training runtime of mpgen's generated scripts.

A build copies this package verbatim into its output folder as
``mpgen_runtime/``, once for every spec there: ``train_<name>.py`` and
``pp_<name>.py`` hold only their spec's facts (a :class:`Training`, a
:class:`Stages`) and hand them to :func:`train` or ``pipeline.train``, which
run one loop with one set of flags, one log and one checkpoint format. The
package imports only torch and the standard library, never mpgen.

# NOTE: [One runtime per output folder]
# The loop, the flags, the data pipeline, the log and the checkpoints are
# ordinary code here, linted and tested in process like the rest of mpgen
# (tests/runtime/); a generated script is what its spec says and nothing
# else, so a fix to the loop changes these files and no per-spec file.
"""

from .loop import hits, train
from .metrics import Metric
from .optim import lr_factor, param_groups
from .settings import keywords
from .spec import Stages, Training

__all__ = [
    "Metric",
    "Stages",
    "Training",
    "hits",
    "keywords",
    "lr_factor",
    "param_groups",
    "train",
]
