"""IR -> ``test_<name>.py``: the generated tests.

The checks themselves live in ``mpgen.testing.ModelSuite``; the generated
file states the model's facts in a subclass of it.  :func:`model_facts` is
the one place that reads the IR: it turns a graph into plain Python values,
and the template only prints them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mpgen.compiler.codegen.common import (
    _tuple,
    environment,
    file_names,
    header,
    input_code,
    literal,
    optimizer_call,
)
from mpgen.compiler.codegen.format import fits, layout_header
from mpgen.compiler.ir import Graph, MemoryPlan, Transfer
from mpgen.compiler.analysis.schedule import BACKWARD_FACTOR
from mpgen.compiler.placement.stages import stages


@dataclass(frozen=True)
class ModelFacts:
    """What the generated tests state about one model, as plain values."""

    header: list[str]
    model: str  # the model class
    model_module: str  # the module it is generated into
    test_file: str
    spec_path: str
    devices: tuple[str, ...]
    placement: dict[str, str]  # state-dict prefix -> device
    total_params: int
    output_shapes: list[tuple[Optional[int], ...]]  # at the test sizes
    transfers: list[tuple[str, str, str, Optional[int]]]  # (value, from, to, bytes)
    input_lines: list[str]  # statements making the inputs
    input_vars: list[str]
    optimizer: str  # an expression of ``model``
    modules: tuple[str, ...]  # user modules of the optimizer (and losses) to import
    train_module: str  # train_<name>: the step the memory test measures
    memory_batch: int  # the batch of the memory plan the test checks (0: no plan)
    memory_plan: dict[str, tuple[int, dict[str, int]]]  # device -> (peak, part -> bytes)


def model_facts(graph: Graph) -> ModelFacts:
    """The facts of ``graph`` that the generated tests check."""
    from mpgen.compiler.frontend.namespace import GLOBALS, Namespace

    dims = graph.test_dims  # the training sizes the build checked, a small batch
    microbatches = graph.pipeline.microbatches if graph.pipeline else 1
    placement: dict[str, str] = {}
    for node in graph.nodes:
        if not node.op.has_module:
            continue
        if node.repeat is None:
            placement[node.name] = node.devices[0]
        else:
            for k, device in enumerate(node.devices):
                placement[f"{node.name}.{k}"] = device
    transfers = []
    micro = dims | ({"batch": dims["batch"] // microbatches} if "batch" in dims else {})
    for t in _transfers_in_order(graph):
        if (t.src or "cpu") == t.dst:
            continue  # a CPU input to a CPU layer: .to() returns it unchanged
        known = None not in t.type.concrete(micro)
        transfers.append(
            (str(t.value), t.src or "cpu", t.dst, t.type.nbytes(micro) if known else None)
        )
    memory_batch, memory_plan = memory_facts(graph)
    reserved = GLOBALS | {graph.name, "self", "ModelSuite", names_of_train(graph)}
    sizes = {name: str(size) for name, size in dims.items()}
    input_lines, input_vars = input_code(graph, Namespace(reserved), sizes)
    names = file_names(graph)
    return ModelFacts(
        header=header(graph),
        model=graph.name,
        model_module=names["model"][: -len(".py")],
        test_file=names["test"],
        spec_path=graph.spec_path,
        devices=tuple(graph.devices),
        placement=placement,
        total_params=graph.total_params,
        output_shapes=[graph.type_of(o).concrete(dims) for o in graph.outputs],
        transfers=transfers,
        input_lines=input_lines,
        input_vars=input_vars,
        optimizer=optimizer_call(graph.train, graph.train.lr),
        modules=tuple(m for m in graph.train.modules if m == graph.train.optimizer_module),
        train_module=names_of_train(graph),
        memory_batch=memory_batch,
        memory_plan=memory_plan,
    )


def names_of_train(graph: Graph) -> str:
    """The training script's module: the memory test imports its facts."""
    return file_names(graph)["train"][: -len(".py")]


#: The most FLOPs (forward and backward, by the cost model) of the step the
#: generated memory test measures on virtual devices, which run on the CPU:
#: a spec whose step at its batch needs more states no memory plan in its
#: tests (bench/memory_plan.py and ``--memory`` measure it; docs/testing.md).
MEMORY_TEST_FLOPS = 1e11


def step_flops(graph: Graph, batch: int) -> float:
    """A training step's FLOPs at ``batch`` samples (forward and backward)."""
    costs = graph.costs
    trained = dict(costs.dims).get("batch") if costs else None
    if not trained:
        return 0.0
    return sum(u.flops for u in costs.units) * (1 + BACKWARD_FACTOR) * batch / trained


def _step_simulated(graph: Graph) -> bool:
    """Whether the plan ran the spec's optimizer step: a torch.optim class
    other than LBFGS, whose history grows step by step up to its
    ``history_size`` (a steady state no two-step measurement reaches). For
    the others the plan counts the optimizer's state from a table (NOTE
    [Memory plan])."""
    import torch.optim

    name = graph.train.optimizer if graph.train else None
    return name is None or (name != "LBFGS" and isinstance(getattr(torch.optim, name, None), type))


def memory_facts(graph: Graph) -> tuple[int, dict[str, tuple[int, dict[str, int]]]]:
    """The memory plan's training peaks the test checks, and their batch
    (the spec's); 0 and none without a plan, with no parameters to train,
    where the plan is the additive estimate rather than a simulated step
    (phase ``estimate``: recurrent layers, very long specs; NOTE [Memory
    plan]), or where the step needs more than :data:`MEMORY_TEST_FLOPS`."""
    memory: Optional[MemoryPlan] = graph.memory
    if memory is None or not memory.train or not graph.trainable_params:
        return 0, {}
    if any(d.phase == "estimate" for d in memory.train) or not _step_simulated(graph):
        return 0, {}
    if step_flops(graph, memory.batch) > MEMORY_TEST_FLOPS:
        return 0, {}
    return memory.batch, {d.device: (d.peak, {p: b for p, b in d.at_peak if b})
                          for d in memory.train}


def _transfers_in_order(graph: Graph) -> list[Transfer]:
    """The transfers forward makes, in order: the plan's; micro-batched, each
    stage's once per micro-batch, in the order of the wavefront (at tick t,
    stage k runs micro-batch t - k, later stages first)."""
    if graph.pipeline is None:
        return list(graph.plan.transfers)
    sections = [s.section for s in stages(graph)]
    m, k = graph.pipeline.microbatches, len(sections)
    return [t for tick in range(m + k - 1) for stage in reversed(range(k))
            if 0 <= tick - stage < m for t in sections[stage].transfers]


def value_code(value: object) -> str:
    """A fact (tuples, lists, dicts of strings, ints and None) as Python
    source in black's spelling, on one line."""
    if isinstance(value, tuple):
        return "(" + _tuple(_items_code(value)) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(_items_code(value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(_items_code(value)) + "}"
    return literal(value)


def collection_code(name: str, value: tuple | list | dict, indent: int) -> str:
    """The value of ``name = value`` at ``indent`` columns: on one line where
    the statement fits, else one item a line with a trailing comma, which is
    how black splits a collection literal that does not fit (an item too long
    for its own line is left to ``{% filter layout %}``, that is to black)."""
    one = value_code(value)
    if not value or not one.isascii() or fits(f"{name} = {one}", indent):
        return one  # black measures other characters by their display width
    return _split(value, indent)


def _split(value: tuple | list | dict, indent: int) -> str:
    """``value`` one item a line at ``indent + 4`` columns; an item that is a
    collection too long for its line split the same way, one level deeper,
    as black splits it (the memory plan's per-device entries)."""
    one = value_code(value)
    pad = " " * indent
    if isinstance(value, dict):
        entries = [(f"{value_code(k)}: ", v) for k, v in value.items()]
    else:
        entries = [("", v) for v in value]
    body = ""
    for prefix, item in entries:
        code = prefix + value_code(item)
        if (isinstance(item, (tuple, list, dict)) and item and code.isascii()
                and not fits(code + ",", indent + 4)):
            code = prefix + _split(item, indent + 4)
        body += f"{pad}    {code},\n"
    return one[0] + "\n" + body + pad + one[-1]


def _items_code(value: tuple | list | dict) -> list[str]:
    """A collection's items (a dict's as ``key: value``), each as :func:`value_code`."""
    if isinstance(value, dict):
        return [f"{value_code(k)}: {value_code(v)}" for k, v in value.items()]
    return [value_code(v) for v in value]


def render_test(graph: Graph) -> str:
    """``test_<name>.py`` in black's layout (NOTE [Written in black's layout])."""
    facts = model_facts(graph)
    # Class attributes, at 4 columns.
    literals = {
        name: collection_code(name, getattr(facts, name), 4)
        for name in ("devices", "placement", "output_shapes", "transfers", "memory_plan")
    }
    literals["total_params"] = f"{facts.total_params:_}"
    return (
        environment()
        .get_template("test.py.jinja")
        .render(facts=facts, literal=literals, input_tuple=_tuple(facts.input_vars),
                class_header=layout_header(f"class Test{facts.model}(ModelSuite)"))
    )
