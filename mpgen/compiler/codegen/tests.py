"""IR -> ``test_<name>.py``: the generated tests."""

from __future__ import annotations

from dataclasses import dataclass

from mpgen.compiler.codegen.common import (
    _tuple,
    environment,
    file_names,
    header,
    input_code,
    optimizer_call,
)
from mpgen.compiler.ir import Graph, TensorType


@dataclass
class TestContext:
    header: list[str]
    model: str
    model_module: str
    spec_path: str
    devices: str
    devices_text: str
    placement: str
    output_shapes: str
    input_lines: list[str]
    input_vars: str
    total_params: int
    cuda_count: int
    transfers: str
    optimizer: str


#: Sizes of symbolic dims in the generated tests (small: they run on CPUs).
TEST_BATCH = 2


def test_dims(graph: Graph) -> dict[str, int]:
    dims = dict(graph.train.dims)
    if "batch" in dims:
        dims["batch"] = TEST_BATCH
    return dims


def placement_map(graph: Graph) -> dict[str, str]:
    """State-dict prefix -> device, for every layer that owns a module."""
    result: dict[str, str] = {}
    for node in graph.nodes:
        if not node.op.has_module:
            continue
        if node.repeat is None:
            result[node.name] = node.devices[0]
        else:
            for k, device in enumerate(node.devices):
                result[f"{node.name}.{k}"] = device
    return result


def _concrete(t: TensorType, dims: dict[str, int]) -> tuple:
    out = []
    for d in t.shape:
        if isinstance(d, int):
            out.append(d)
        elif all(f.isdigit() or f in dims for f in d.split("*")):
            out.append(TensorType((d,)).numel(dims))
        else:
            out.append(None)
    return tuple(out)


def test_context(graph: Graph) -> TestContext:
    from mpgen.compiler.frontend.namespace import GLOBALS, Namespace

    dims = test_dims(graph)
    sizes = {name: str(size) for name, size in dims.items()}
    lines, inputs = input_code(graph, Namespace(GLOBALS | {graph.name}), sizes)
    devices = graph.devices
    cuda = [int(d.split(":")[1]) for d in devices if d.startswith("cuda:")]
    transfers = []
    for t in graph.plan.transfers:
        if (t.src or "cpu") == t.dst:
            continue  # a CPU input to a CPU layer: .to() returns it unchanged
        known = None not in _concrete(t.type, dims)
        transfers.append((t.value.split("#")[0], t.src or "cpu", t.dst,
                          t.type.nbytes(dims) if known else None))
    optimizer = optimizer_call(graph.train, graph.train.lr)
    return TestContext(
        header=header(graph), model=graph.name, model_module=file_names(graph)["model"][:-3],
        spec_path=graph.spec_path, devices=repr(devices), devices_text=", ".join(devices),
        placement=repr(placement_map(graph)),
        output_shapes=repr([_concrete(graph.node(o).out, dims) for o in graph.outputs]),
        input_lines=lines, input_vars=_tuple(inputs), total_params=graph.total_params,
        cuda_count=max(cuda) + 1 if cuda else 0, transfers=repr(transfers),
        optimizer=optimizer,
    )


def render_test(graph: Graph) -> str:
    return environment().get_template("test.py.jinja").render(ctx=test_context(graph))
