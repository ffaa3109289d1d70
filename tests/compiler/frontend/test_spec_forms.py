"""The spec's forms for real models: expressions, tuple outputs,
factories, keyword inputs and call:, tie:, init:, and training-mode
functions. Each form is built, its generated code imported and run on the
CPU, and each mistake gets its exact FILE:LINE:COL message."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import build_to, import_generated, write_spec
from mpgen.compiler import driver
from mpgen.compiler.frontend import expressions
from mpgen.compiler.ir import BinOp, Neg, Param, Size
from mpgen.errors import MpgenError

HEAD = """
mpgen: 1
name: M
inputs:
  x: [batch, 8]
"""


def build_cpu(tmp_path, text: str):
    """Build ``text`` for the CPU; return the graph and the model class."""
    spec = write_spec(tmp_path, text)
    result = build_to(spec, tmp_path / "out", {"*": "cpu"})
    module = import_generated(tmp_path / "out" / f"{_stem(result.graph.name)}.py")
    return result.graph, getattr(module, result.graph.name), (tmp_path / "out" / f"{_stem(result.graph.name)}.py").read_text()


def _stem(name: str) -> str:
    from mpgen.compiler.codegen.common import module_name

    return module_name(name)


def error_of(tmp_path, text: str) -> str:
    with pytest.raises(MpgenError) as info:
        driver.compile_spec(write_spec(tmp_path, text))
    return str(info.value).replace(f"{tmp_path}/", "")


# -- expressions ---------------------------------------------------------------

@pytest.mark.parametrize("text, tree", [
    ("=3 * $dim", BinOp("*", 3, Param("dim"))),
    ("=$dim // $heads", BinOp("//", Param("dim"), Param("heads"))),
    ("=-$a ** 2", Neg(BinOp("**", Param("a"), 2))),
    ("=2 * 3 + 1", 7),
    ("=7 / 2", 3.5),
    ("=size(idx, -1) - 1", BinOp("-", Size("idx", -1), 1)),
])
def test_expressions_parse_with_pythons_precedence(text, tree):
    assert expressions.parse(text) == tree


@pytest.mark.parametrize("text, message", [
    ("=3 *", "expected a number, $param, size(...) or '(', got the end"),
    ("=dim * 2", "unknown name 'dim': an expression reads block params as $dim and "
                 "tensor sizes as size(dim, DIM)"),
    ("=size(x)", "expected ',', got ')'"),
    ("=1 / 0", "division by zero"),
    ("=2 ** 1000", "exponent 1000 is too large"),
    ("=3 ; 4", "unexpected ';'"),
    ("=", "empty expression after '='"),
    # Each of these was a Python exception (a traceback), or hours of folding.
    ("=0 ** -1", "0 cannot be raised to a negative power (-1)"),
    ("=0.0 ** -2.5", "0.0 cannot be raised to a negative power (-2.5)"),
    ("=1e300 ** 2", "1e+300 ** 2 is beyond the range of a float"),
    ("=((2**64)**15 * 2**63 + ((2**64)**15 * 2**63 - 1)) * 1.0",
     "179769313486... (309 digits) * 1.0 is beyond the range of a float"),
    ("=1e400", "1e400 is too large for a float"),
    ("=(-8) ** 0.5", "(-8) ** 0.5 is not a finite real number"),
    ("=((64**64)**64)**64", "394020061963... (116 digits) ** 64 is too large: more than "
                            "1024 bits"),
    ("=" + "*".join(["4294967296"] * 40),
     "418558049682... (299 digits) * 4294967296 is too large: more than 1024 bits"),
    ("=1" + "0" * 5000, "100000000000... (5001 characters) is too large: more than 1024 bits"),
    ("=size(x, 1" + "0" * 5000 + ")",
     "100000000000... (5001 characters) is too large: more than 1024 bits"),
    ("=" + "(" * 3000 + "1" + ")" * 3000, f"nested more than {expressions.MAX_DEPTH} levels "
     "deep (parentheses, signs, powers and operators over $params and size()); write it "
     "simpler"),
    ("=" + "-" * 3000 + "1", f"nested more than {expressions.MAX_DEPTH} levels deep "
     "(parentheses, signs, powers and operators over $params and size()); write it simpler"),
    ("=2" + " ** 1" * 3000, f"nested more than {expressions.MAX_DEPTH} levels deep "
     "(parentheses, signs, powers and operators over $params and size()); write it simpler"),
    ("=$d" + " + $d" * 3000, f"nested more than {expressions.MAX_DEPTH} levels deep "
     "(parentheses, signs, powers and operators over $params and size()); write it simpler"),
], ids=lambda v: str(v)[:40])
def test_bad_expressions_say_what_is_wrong(text, message):
    with pytest.raises(expressions.ExpressionError, match="^" + _re(message) + "$"):
        expressions.parse(text)


@pytest.mark.parametrize("text, value", [
    ("=(2**64)**15 * 2**63 + ((2**64)**15 * 2**63 - 1)", 2**1024 - 1),  # 1024 bits
    ("=(2 ** 32) ** 31 // 3", 2**992 // 3),
    ("=-(2 ** 64) * 2 ** 64", -(2**128)),
    ("=2.0 ** -64", 2.0**-64),
    ("=(-1) ** 64", 1),
    ("=" + "(" * 64 + "1" + ")" * 64, 1),
], ids=lambda v: str(v)[:40])
def test_expressions_up_to_the_limits_fold(text, value):
    assert expressions.parse(text) == value


def test_every_expression_mistake_is_an_error_at_its_value(tmp_path):
    """A spec with expressions that raised Python exceptions (or folded to
    gigabytes) is refused at each value, with no traceback and in moments."""
    message = error_of(tmp_path, HEAD + """
blocks:
  B:
    params: [d]
    layers:
      fc: {op: Linear, args: [8, "=$d""" + " + $d" * 100 + """"]}
layers:
  b: {op: B, args: [1]}
  zero: {op: Linear, args: [8, "=0 ** -1"], in: x}
  tower: {op: Linear, args: [8, "=((64**64)**64)**64"], in: x}
  deep: {op: Linear, args: [8, "=""" + "(" * 2000 + "1" + ")" * 2000 + """"], in: x}
  inf: {op: Linear, args: [8, "=1e300 ** 2"], in: x}
""")
    lines = message.splitlines()
    assert [line.split(": expression")[0] for line in lines] == [
        "spec.yaml:10:34: layer 'fc' of block 'B'", "spec.yaml:13:32: layer 'zero'",
        "spec.yaml:14:33: layer 'tower'", "spec.yaml:15:32: layer 'deep'",
        "spec.yaml:16:31: layer 'inf'"]
    assert all(len(line) < 300 for line in lines)  # a long expression is cut
    assert lines[1].endswith("'=0 ** -1': 0 cannot be raised to a negative power (-1)")
    assert lines[2].endswith(" ** 64 is too large: more than 1024 bits")
    assert lines[4].endswith("'=1e300 ** 2': 1e+300 ** 2 is beyond the range of a float")


def test_a_block_param_too_large_for_its_expression(tmp_path):
    """Folding with a block's arguments (in analysis) is bounded the same way."""
    message = error_of(tmp_path, HEAD + """
blocks:
  B:
    params: [d]
    layers:
      fc: {op: Linear, args: [8, "=$d ** 64"]}
layers:
  b: {op: B, args: [65536]}
""")
    assert "65536 ** 64 is too large: more than 1024 bits" in message, message


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_block_expressions_and_params_in_forward(tmp_path):
    graph, Model, code = build_cpu(tmp_path, HEAD + """
blocks:
  Heads:
    params: [dim, heads]
    layers:
      qkv: {op: Linear, args: [$dim, "=3 * $dim"]}
      split: {op: torch.split, args: [$dim], dim: -1, outputs: [q, k, v]}
      qh: {op: torch.unflatten, in: q, dim: -1, sizes: [$heads, "=$dim // $heads"]}
layers:
  heads: {op: Heads, args: [8, 2]}
""")
    assert "self.qkv = nn.Linear(dim, 3 * dim)" in code
    # A param read in forward is kept on the block (it was an undefined name).
    assert "self.dim = dim" in code
    assert "sizes=[self.heads, self.dim // self.heads]" in code
    # The elements of a returned tuple get their shapes in the comment.
    assert ("# q [batch, 8], k [batch, 8], v [batch, 8]\n"
            "        q, k, v = torch.split(qkv, self.dim, dim=-1)\n") in code
    assert str(graph.node("heads").out) == "[batch, 2, 4]"
    assert Model()(torch.randn(3, 8)).shape == (3, 2, 4)


def test_size_reads_a_tensor_in_forward_only(tmp_path):
    message = error_of(tmp_path, HEAD + """
layers:
  fc: {op: Linear, args: [8, "=size(x, 1)"]}
""")
    assert message == ("spec.yaml:7:30: layer 'fc': expression '=size(x, 1)': size() is read "
                       "in forward, so it can only be used in the arguments of a torch.*/F.* "
                       "layer or in call:, not in a module's constructor arguments")


def test_size_of_a_name_not_in_scope(tmp_path):
    message = error_of(tmp_path, HEAD + """
layers:
  pos: {op: torch.arange, in: [], args: ["=size(y, 0)"]}
""")
    assert message == ("spec.yaml:7:42: layer 'pos': expression '=size(y, 0)': size() of 'y', "
                       "which is not in scope here")


def test_an_expression_that_does_not_parse_is_a_spec_error(tmp_path):
    message = error_of(tmp_path, HEAD + """
layers:
  fc: {op: Linear, args: [8, "=8 *"]}
""")
    assert message == ("spec.yaml:7:30: layer 'fc': expression '=8 *': expected a number, "
                       "$param, size(...) or '(', got the end")


def test_a_param_outside_a_block_in_an_expression(tmp_path):
    message = error_of(tmp_path, HEAD + """
layers:
  fc: {op: Linear, args: [8, "=2 * $dim"]}
""")
    assert message == ("spec.yaml:7:30: layer 'fc': '$dim' is a block parameter, but this "
                       "layer is not inside a block")


# -- tuple outputs, factories, keyword inputs, call: ----------------------------

def test_factories_are_made_on_their_device_with_run_time_sizes(tmp_path):
    graph, Model, code = build_cpu(tmp_path, """
mpgen: 1
name: Pos
inputs:
  idx: {shape: [batch, seq], dtype: int64}
layers:
  pos: {op: torch.arange, in: [], args: ["=size(idx, 1)"]}
  wpe: {op: Embedding, args: [16, 4], in: pos}
placement: {pos: cuda:1}
train: {dims: {seq: 16}}
""")
    assert 'pos = torch.arange(idx.size(1), device="cpu")' in code
    assert str(graph.node("pos").out) == "[seq]"
    assert [t.value.name for t in graph.plan.transfers] == []  # nothing moves: a factory
    assert Model()(torch.zeros(2, 5, dtype=torch.long)).shape == (5, 4)


def test_a_factory_needs_in_empty_and_in_empty_needs_a_factory(tmp_path):
    assert error_of(tmp_path, HEAD + """
layers:
  z: {op: torch.zeros, args: [3]}
""") == ("spec.yaml:7:11: layer 'z': torch.zeros makes a new tensor: mark the layer as a "
         "factory with 'in: []' (it is then created on its layer's device)")
    assert error_of(tmp_path, HEAD + """
layers:
  fc: {op: Linear, args: [8, 8], in: []}
""") == ("spec.yaml:7:38: layer 'fc': 'in: []' marks a factory such as torch.arange or "
         "torch.zeros; Linear is a module and reads a tensor")


def test_keyword_tensors_call_arguments_and_a_causal_mask(tmp_path):
    graph, Model, code = build_cpu(tmp_path, """
mpgen: 1
name: Causal
inputs:
  x: [batch, seq, 8]
layers:
  mask: {op: torch.ones, in: [], args: ["=size(x, 1)", "=size(x, 1)"], dtype: bool}
  causal: {op: torch.triu, diagonal: 1}
  h: {op: TransformerEncoderLayer, d_model: 8, nhead: 2, dim_feedforward: 16, dropout: 0.0,
      batch_first: true, in: [x, {src_mask: causal}], call: {is_causal: true}, repeat: 2}
""")
    assert "h = layer(h, src_mask=causal, is_causal=True)" in code
    model = Model().eval()
    x = torch.randn(2, 5, 8)
    changed = x.clone()
    changed[:, 3:] = torch.randn(2, 2, 8)
    with torch.no_grad():
        a, b = model(x), model(changed)
    # Positions before the change never see it: the model is causal.
    torch.testing.assert_close(a[:, :3], b[:, :3])
    assert not torch.allclose(a[:, 3:], b[:, 3:])


def test_tuple_outputs_nested_and_recurrent_state(tmp_path):
    graph, Model, code = build_cpu(tmp_path, """
mpgen: 1
name: Rnn
inputs:
  x: [seq, batch, 4]
  h0: [1, batch, 6]
  c0: [1, batch, 6]
layers:
  lstm: {op: LSTM, args: [4, 6], in: [x, [h0, c0]], outputs: [out, [hn, cn]]}
  head: {op: Linear, args: [6, 3], in: out}
outputs: [head, hn, cn]
""")
    assert "out, (hn, cn) = self.lstm(x, (h0, c0))" in code
    assert str(graph.type_of("hn")) == "[1, batch, 6]"
    from mpgen.commands import show

    assert "out [seq, batch, 6], hn [1, batch, 6], cn [1, batch, 6]" in (
        show.to_table(graph))
    model = Model()
    reference = nn.LSTM(4, 6)
    reference.load_state_dict(model.lstm.state_dict())
    x, h0, c0 = torch.randn(5, 2, 4), torch.randn(1, 2, 6), torch.randn(1, 2, 6)
    head, hn, cn = model(x, h0, c0)
    out, (rh, rc) = reference(x, (h0, c0))
    torch.testing.assert_close(head, model.head(out))
    torch.testing.assert_close((hn, cn), (rh, rc))


@pytest.mark.parametrize("layers, message", [
    ("  split: {op: torch.split, args: [4], dim: 1, outputs: [a, b, c]}\n",
     "spec.yaml:6:3: layer 'split': torch.split returns 2 values, but outputs: names 3"),
    ("  split: {op: torch.split, args: [4], dim: 1, outputs: [a, b]}\n"
     "  next: {op: F.relu}\n",
     "spec.yaml:7:3: layer 'next': the layer before it, 'split', returns a tuple named by its "
     "outputs (a, b); say which to read with 'in:'"),
    ("  split: {op: torch.split, args: [4], dim: 1, outputs: [a, b]}\n"
     "  next: {op: F.relu, in: split}\n",
     "spec.yaml:7:26: layer 'next' reads 'split', which returns a tuple named by its outputs; "
     "read its elements (a, b)"),
    ("  split: {op: torch.split, args: [4], dim: 1, outputs: [x, b]}\n",
     "spec.yaml:6:57: layer 'split': outputs: 'x' is already the name of an input, a layer or "
     "a value"),
    ("  fc: {op: Linear, args: [8, 8], outputs: [a]}\n",
     "spec.yaml:6:3: layer 'fc': Linear returns a tensor, but outputs: names 1 elements there"),
])
def test_tuple_output_mistakes(tmp_path, layers, message):
    assert error_of(tmp_path, HEAD + "layers:\n" + layers) == message


# -- tie: ----------------------------------------------------------------------------

TIED = """
mpgen: 1
name: Tied
inputs:
  idx: {shape: [batch, seq], dtype: int64}
layers:
  wte: {op: Embedding, args: [11, 4], in: idx}
  ln: {op: LayerNorm, args: [4]}
  lm_head: {op: Linear, args: [4, 11], bias: false, tie: {weight: wte.weight}}
placement:
  wte: cuda:0
  ln: cuda:1
"""


def test_a_tie_across_devices_moves_a_copy_and_shares_one_parameter(tmp_path):
    graph = driver.compile_spec(write_spec(tmp_path, TIED))
    assert graph.total_params == 11 * 4 + 8  # the head's weight is counted once
    moved = [(str(t.value), t.src, t.dst) for t in graph.plan.transfers if t.src]
    assert ("wte.weight", "cuda:0", "cuda:1") in moved
    result = build_to(write_spec(tmp_path, TIED), tmp_path / "gpu")
    code = result.files["tied.py"]
    assert "self.lm_head.weight = self.wte.weight" in code
    assert 'wte_weight = self.wte.weight.to("cuda:1")' in code
    assert ("torch.func.functional_call(self.lm_head,{\"weight\":wte_weight},(ln,))"
            in "".join(code.split()))
    report = result.files["tied.placement.md"]
    assert "Tied: `lm_head.weight` is `wte.weight`, one parameter owned by `wte` on `cuda:0`" in report


def test_a_tie_runs_on_virtual_devices_and_gradients_reach_the_one_parameter(tmp_path):
    from mpgen.testing import virtual_devices

    build_to(write_spec(tmp_path, TIED), tmp_path / "gpu")
    module = import_generated(tmp_path / "gpu" / "tied.py")
    with virtual_devices(cuda=2):
        model = module.Tied()
        assert model.lm_head.weight is model.wte.weight
        assert sum(p.numel() for p in model.parameters()) == 11 * 4 + 8
        out = model(torch.randint(0, 11, (2, 3)))
        assert str(out.device) == "cuda:1"
        out.sum().backward()
        grad = model.wte.weight.grad
        assert grad is not None and str(grad.device) == "cuda:0"
    # One parameter, present under both state-dict keys.
    assert set(model.state_dict()) == {"wte.weight", "ln.weight", "ln.bias", "lm_head.weight"}


def test_tied_weights_equal_a_hand_tied_model_on_one_device(tmp_path):
    graph, Model, _ = build_cpu(tmp_path, TIED)
    model = Model()
    idx = torch.randint(0, 11, (2, 3))
    out = model(idx)
    expected = model.ln(model.wte(idx)) @ model.wte.weight.T
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    wte, ln = nn.Embedding(11, 4), nn.LayerNorm(4)
    wte.load_state_dict(model.wte.state_dict())
    ln.load_state_dict(model.ln.state_dict())
    (ln(wte(idx)) @ wte.weight.T).sum().backward()
    torch.testing.assert_close(model.wte.weight.grad, wte.weight.grad)


@pytest.mark.parametrize("tie, message", [
    ("{weight: wte.weigth}", "spec.yaml:8:67: layer 'lm_head': tie: weight: 'wte' has no "
                             "parameter 'weigth' (did you mean 'weight'?)"),
    ("{weight: wtf.weight}", "spec.yaml:8:67: layer 'lm_head': tie: weight: 'wtf' is not an "
                             "earlier layer with parameters (did you mean 'wte'?)"),
    ("{weight: wte}", "spec.yaml:8:67: layer 'lm_head': tie: weight: expected LAYER.PARAM, "
                      "like 'wte.weight', got 'wte'"),
])
def test_tie_mistakes(tmp_path, tie, message):
    text = TIED.replace("{weight: wte.weight}", tie)
    assert error_of(tmp_path, text) == message


def test_a_tie_between_different_shapes(tmp_path):
    text = TIED.replace("args: [4, 11], bias: false", "args: [4, 12], bias: false")
    assert error_of(tmp_path, text) == (
        "spec.yaml:8:67: layer 'lm_head': tie: weight: (12, 4) cannot be wte.weight, which is "
        "(11, 4)")


# -- init: ----------------------------------------------------------------------------

def test_init_applies_in_module_order_and_per_layer(tmp_path):
    graph, Model, code = build_cpu(tmp_path, HEAD + """
layers:
  fc: {op: Linear, args: [8, 8]}
  out: {op: Linear, args: [8, 2], bias: false, init: {weight: {constant: 0.5}}}
init:
  Linear: {weight: {normal: {std: 0.02}}, bias: zeros}
""")
    assert "nn.init.normal_(module.weight, std=0.02)" in code
    assert "nn.init.constant_(self.out.weight, val=0.5)" in code
    torch.manual_seed(0)
    model = Model()
    assert torch.all(model.fc.bias == 0) and model.fc.weight.std() < 0.05
    assert torch.all(model.out.weight == 0.5)


@pytest.mark.parametrize("init, message", [
    ("{Linear: {weight: {normall: {std: 0.02}}}}",
     "spec.yaml:7:25: init: Linear: weight: unknown initializer 'normall' (did you mean "
     "'normal'?)"),
    ("{Linaer: {weight: zeros}}",
     "spec.yaml:7:8: init: unknown torch.nn module 'Linaer' (did you mean 'Linear'?)"),
    ("{Linear: {weight: {normal: {sd: 0.02}}}}",
     "spec.yaml:7:25: init: Linear: weight: unknown argument 'sd' for normal (did you mean "
     "'std'?)"),
])
def test_init_mistakes(tmp_path, init, message):
    text = HEAD + "layers:\n  fc: {op: Linear, args: [8, 8]}\ninit: " + init + "\n"
    assert error_of(tmp_path, text) == message


def test_a_plain_init_value_is_still_the_constructors_argument(tmp_path):
    _, Model, code = build_cpu(tmp_path, HEAD + """
layers:
  act: {op: PReLU, init: 0.25}
""")
    assert "nn.PReLU(init=0.25)" in code
    assert Model().act.weight.item() == 0.25


# -- training mode ----------------------------------------------------------------------

def test_dropout_in_function_layers_follows_train_and_eval(tmp_path):
    _, Model, code = build_cpu(tmp_path, HEAD + """
layers:
  d: {op: F.dropout, p: 0.5}
""")
    assert "F.dropout(x, p=0.5, training=self.training)" in code
    model = Model().eval()
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), x)  # eval: no dropout, two calls agree
    model.train()
    assert (model(x) == 0).any()


def test_attention_dropout_only_while_training(tmp_path):
    _, _, code = build_cpu(tmp_path, """
mpgen: 1
name: Att
inputs:
  q: [batch, 2, 5, 4]
layers:
  att: {op: F.scaled_dot_product_attention, in: [q, q, q], dropout_p: 0.1}
""")
    assert "dropout_p=0.1 if self.training else 0.0" in code


@pytest.mark.parametrize("args, message", [
    ('["=size(idx, 5)"]', "layer 'pos': torch.arange(size(idx, 5)) fails: size(idx, 5): idx "
                          "has 2 dims"),
    ('["=size(idx, 1) / 0"]', "layer 'pos': torch.arange(size(idx, 1) / 0) fails: division by "
                              "zero"),
])
def test_run_time_sizes_that_fail_at_build_time_are_shown_as_written(tmp_path, args, message):
    text = """
mpgen: 1
name: P
inputs:
  idx: {shape: [batch, seq], dtype: int64}
layers:
  pos: {op: torch.arange, in: [], args: ARGS}
""".replace("ARGS", args)
    assert error_of(tmp_path, text) == "spec.yaml:6:3: " + message
