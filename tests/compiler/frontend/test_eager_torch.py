"""A build does not import ``torch._dynamo`` (NOTE [No dynamo at build time]
in ``mpgen/compiler/frontend/eager_torch.py``), and what needs the real one
still gets it. Each case runs in a fresh interpreter: the test process may
have imported dynamo already, and then the stand-in steps aside."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from helpers import EXAMPLES, ROOT

#: Slow: each case is a fresh interpreter that imports torch.
pytestmark = pytest.mark.slow


def _run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_analysing_a_spec_with_training_settings_does_not_import_dynamo():
    # seed.yaml has an optimizer (built and stepped) and linear layers on meta
    # (whose Python meta kernels are wrapped by torch._disable_dynamo). The
    # memory plan after placement runs on FakeTensorMode, which reads
    # torch._dynamo.config and needs the real package: its in-place foreach
    # ops take another, copying path without it (BERT's AdamW step planned
    # twice its temporaries), so placement imports dynamo; the analysis
    # before it does not.
    got = _run(f"""
        import json, sys
        from mpgen.compiler.analysis import costs, shapes, targets
        from mpgen.compiler.frontend import lower
        from mpgen.compiler.frontend.eager_torch import eager_torch
        from mpgen.spec_schema.load import load_file
        from mpgen.spec_schema.validate import validate
        loaded = load_file({str(EXAMPLES / "seed.yaml")!r})
        with eager_torch():
            graph = lower(validate(loaded), loaded, None)
            graph = costs.measure_graph(targets.infer_targets(shapes.infer(graph)))
        print(json.dumps({{"dynamo": "torch._dynamo" in sys.modules,
                          "fsdp": "torch.distributed.fsdp" in sys.modules,
                          "params": sum(n.params for n in graph.nodes)}}))
    """)
    assert got == {"dynamo": False, "fsdp": False, "params": 430}


def test_what_needs_the_real_dynamo_gets_it_and_the_stand_in_leaves_no_trace():
    got = _run("""
        import json, sys, torch
        from mpgen.compiler.frontend.eager_torch import eager_torch
        with eager_torch():
            stand_in = sys.modules["torch._dynamo"]
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
            wrapped = list(stand_in.wrapped)  # what torch._disable_dynamo handed it
            before = "torch._dynamo.config" in sys.modules
            import torch._dynamo.config  # a submodule: the real package is put back
            real = sys.modules["torch._dynamo"]
        cached = [fn.__name__ for fn in wrapped if getattr(fn, "__dynamo_disable", None) is fn]
        print(json.dumps({"stand_in": type(stand_in).__name__, "wrapped": len(wrapped) > 0,
                          "before": before,
                          "real": real is not stand_in and hasattr(real, "optimize"),
                          "after": sys.modules["torch._dynamo"] is real,
                          "cached_wrapper_of_the_stand_in": cached}))
    """)
    assert got == {"stand_in": "_StandIn", "wrapped": True, "before": False, "real": True,
                   "after": True, "cached_wrapper_of_the_stand_in": []}


def test_the_stand_in_is_removed_on_exit():
    got = _run("""
        import json, sys, torch
        from torch import nn
        from mpgen.compiler.frontend.eager_torch import eager_torch
        with eager_torch():
            with torch.device("meta"):
                out = nn.Linear(4, 5)(torch.empty(3, 4, device="meta"))
            out.sum().backward()
        print(json.dumps({"shape": list(out.shape),
                          "dynamo": "torch._dynamo" in sys.modules,
                          "attribute": "_dynamo" in vars(torch)}))
    """)
    assert got == {"shape": [3, 5], "dynamo": False, "attribute": False}


def test_a_build_leaves_the_environment_as_it_found_it():
    # Importing dynamo sets TORCHINDUCTOR_CACHE_DIR in os.environ; a spec's own
    # module built by the memory plan after that saw a variable the user never
    # set (in `mpgen check`'s child, whose environment is a fixed list, a
    # module that asserted so made the plan fall back to the estimate and the
    # committed code look stale).
    got = _run(f"""
        import json, os, sys
        from mpgen.compiler import driver
        before = dict(os.environ)
        graph = driver.compile_spec({str(EXAMPLES / "seed.yaml")!r})
        print(json.dumps({{"dynamo": "torch._dynamo" in sys.modules,
                          "phase": graph.memory.train[0].phase,
                          "added": sorted(set(os.environ) - set(before)),
                          "changed": sorted(k for k in before if os.environ.get(k) != before[k])}}))
    """)
    assert got == {"dynamo": True, "phase": "backward", "added": [], "changed": []}
