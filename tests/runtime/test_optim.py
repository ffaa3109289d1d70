"""Parameter groups and learning-rate schedules (mpgen/runtime/optim.py)."""

from __future__ import annotations

import math

import pytest
from torch import nn

from mpgen.runtime import lr_factor, param_groups


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 5)
        self.head.weight = self.emb.weight  # tied: in one group, once


def test_no_decay_exempts_what_it_names_and_counts_a_tied_parameter_once():
    net = Net()
    decay, exempt = param_groups(net, 0.1, ("biases", "norms"))
    assert (decay["weight_decay"], exempt["weight_decay"]) == (0.1, 0.0)
    assert {id(p) for p in decay["params"]} == {id(net.emb.weight)}
    assert {id(p) for p in exempt["params"]} == {id(net.norm.weight), id(net.norm.bias),
                                                 id(net.head.bias)}
    decay, exempt = param_groups(net, 0.1, ("embeddings",))
    assert id(net.emb.weight) in {id(p) for p in exempt["params"]}


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_a_schedule_warms_up_linearly_then_decays_to_its_floor(decay):
    assert [lr_factor(s, 10, 2, 0.1, decay) for s in (0, 1)] == [1 / 3, 2 / 3]
    assert lr_factor(2, 10, 2, 0.1, decay) == 1.0
    end = 1.0 if decay == "constant" else 0.1
    assert lr_factor(10, 10, 2, 0.1, decay) == pytest.approx(end)
    assert lr_factor(50, 10, 2, 0.1, decay) == pytest.approx(end)  # past its steps


def test_cosine_is_half_way_at_the_middle_and_linear_falls_evenly():
    assert lr_factor(6, 10, 2, 0.0, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_factor(6, 10, 2, 0.0, "linear") == pytest.approx(0.5)
