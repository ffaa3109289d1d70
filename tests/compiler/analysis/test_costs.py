"""compiler.costs: the per-unit numbers automatic placement balances, by hand."""

from __future__ import annotations

import pytest

from helpers import write_spec
from mpgen.compiler.driver import compile_spec
from mpgen.compiler.analysis.costs import human_bytes, optimizer_state

MLP = """
    mpgen: 1
    name: Small
    inputs:
      x: [batch, 10]
    layers:
      fc1: {op: Linear, args: [10, 20]}
      act: {op: ReLU}
      fc2: {op: Linear, args: [20, 5]}
    train:
      optimizer: {op: SGD, lr: 0.1, momentum: 0.9}
      batch_size: 4
"""


def costs_of(tmp_path, text):
    graph = compile_spec(write_spec(tmp_path, text))
    return graph, graph.costs


@pytest.mark.parametrize("name, kwargs, expected", [
    ("SGD", {}, 0),
    ("SGD", {"momentum": 0.9}, 1),
    ("Adam", {}, 2),
    ("AdamW", {"amsgrad": True}, 3),
    ("RMSprop", {}, 1),
    ("RMSprop", {"momentum": 0.5, "centered": True}, 3),
    ("Adagrad", {}, 1),
    ("Adadelta", {}, 2),
    ("SomethingNew", {}, 2),
])
def test_optimizer_state_table(name, kwargs, expected):
    assert optimizer_state(name, kwargs) == expected


def test_mlp_costs_by_hand(tmp_path):
    _, costs = costs_of(tmp_path, MLP)
    fc1, act, fc2 = costs.units
    assert [u.name for u in costs.units] == ["fc1", "act", "fc2"]
    # Linear(10, 20): 10*20 + 20 parameters, float32.
    assert fc1.params == 220
    assert (fc1.weight_bytes, fc1.grad_bytes) == (880, 880)
    assert fc1.optimizer_bytes == 880  # SGD with momentum: one buffer
    # addmm saves its input x [4, 10] for the weight gradient.
    assert fc1.activation_bytes == 4 * 10 * 4
    assert fc1.flops == 2 * 4 * 10 * 20
    assert fc1.out_bytes == 4 * 20 * 4
    # ReLU saves its output [4, 20]; no parameters, no FLOPs counted.
    assert (act.params, act.activation_bytes, act.flops) == (0, 320, 0)
    # fc2 saves its input, already counted by ReLU; its output is a model
    # output, kept until the loss reads it.
    assert fc2.activation_bytes == 4 * 5 * 4
    assert fc2.flops == 2 * 4 * 20 * 5
    assert fc1.memory == 880 * 3 + 160
    assert costs.cuts == (320, 320)
    assert costs.dims == (("batch", 4),)


def test_adam_keeps_two_states(tmp_path):
    _, costs = costs_of(tmp_path, MLP.replace("{op: SGD, lr: 0.1, momentum: 0.9}",
                                              "{op: Adam, lr: 0.001}"))
    fc1 = costs.units[0]
    assert fc1.optimizer_bytes == 2 * 880
    assert costs.state_factor == 2


def test_skip_connections_count_on_every_boundary_they_span(tmp_path):
    _, costs = costs_of(tmp_path, """
        mpgen: 1
        name: Skip
        inputs:
          x: [batch, 8]
        layers:
          a: {op: Linear, args: [8, 8]}
          b: {op: Linear, args: [8, 8]}
          c: {op: Linear, args: [8, 8]}
          d: {op: torch.add, in: [a, c]}
        train: {batch_size: 4}
    """)
    value = 4 * 8 * 4
    # a|b: a;  b|c: a and b;  c|d: a and c.
    assert costs.cuts == (value, 2 * value, 2 * value)


def test_repeated_layer_gives_one_unit_per_instance(tmp_path):
    _, costs = costs_of(tmp_path, """
        mpgen: 1
        name: Rep
        inputs:
          x: [batch, 8]
        layers:
          h: {op: Linear, args: [8, 8], repeat: 3}
        train: {batch_size: 2}
    """)
    assert [u.name for u in costs.units] == ["h.0", "h.1", "h.2"]
    assert all(u.params == 72 and u.flops == 2 * 2 * 8 * 8 for u in costs.units)
    assert costs.cuts == (64, 64)


def test_a_block_instance_is_one_unit(tmp_path):
    graph, costs = costs_of(tmp_path, """
        mpgen: 1
        name: Blocks
        inputs:
          x: [batch, 16]
        blocks:
          MLP:
            params: [dim]
            layers:
              fc1: {op: Linear, args: [$dim, 32]}
              act: {op: GELU}
              fc2: {op: Linear, args: [32, $dim]}
              res: {op: torch.add, in: [fc2, x]}
        layers:
          mlp: {op: MLP, args: [16], repeat: 2}
        train: {batch_size: 2}
    """)
    assert [u.name for u in costs.units] == ["mlp.0", "mlp.1"]
    per_block = (16 * 32 + 32) + (32 * 16 + 16)
    assert [u.params for u in costs.units] == [per_block, per_block]
    assert costs.units[0].flops == 2 * 2 * (16 * 32 + 32 * 16)
    assert graph.total_params == 2 * per_block


def test_symbolic_dims_use_the_training_sizes(tmp_path):
    _, costs = costs_of(tmp_path, """
        mpgen: 1
        name: Seq
        inputs:
          x: [batch, seq, 8]
        layers:
          fc: {op: Linear, args: [8, 4]}
        train:
          batch_size: 3
          dims: {seq: 5}
    """)
    assert dict(costs.dims) == {"batch": 3, "seq": 5}
    assert costs.units[0].out_bytes == 3 * 5 * 4 * 4
    assert costs.units[0].flops == 2 * 3 * 5 * 8 * 4


def test_human_bytes():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1024) == "1.0 KiB"
    assert human_bytes(1.2 * 2**30) == "1.2 GiB"
