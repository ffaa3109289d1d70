"""The micro-batched forward (``pipeline: {microbatches: M}``): one method per
stage, run over M micro-batches in GPipe wavefront order.

Each model is built twice from one spec, plain and with ``pipeline:``, and
run on virtual devices (``mpgen.testing``): from the same weights and inputs,
outputs and every parameter's gradient agree for models without
batch-coupled layers; BatchNorm agrees in eval mode only.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import build_to, import_generated, write_spec
from mpgen.testing import virtual_devices

CHAIN = """
    inputs: {x: [batch, 8]}
    layers:
      fc1: {op: Linear, args: [8, 16]}
      act: {op: F.relu}
      fc2: {op: Linear, args: [16, 8]}
      res: {op: torch.add, in: [x, fc2]}
      fc3: {op: Linear, args: [8, 4]}
    outputs: [fc3, fc1]
    placement: {fc1: cuda:0, act: cuda:0, fc2: cuda:1, res: cuda:1, fc3: cuda:2}
"""
CONV = """
    inputs: {image: [batch, 3, 8, 8]}
    layers:
      conv: {op: Conv2d, args: [3, 4, 3], padding: 1}
      act: {op: ReLU}
      pool: {op: AdaptiveAvgPool2d, args: [2]}
      flat: {op: Flatten}
      head: {op: Linear, args: [16, 5]}
    placement: {conv: cuda:0, act: cuda:0, pool: cuda:1, flat: cuda:1, head: cuda:1}
"""
# Sequence first: the batch is dim 1 of the input, the output and the state.
ATTENTION = """
    inputs: {x: [seq, batch, 8]}
    layers:
      attn: {op: MultiheadAttention, args: [8, 2], in: [x, x, x], outputs: [att, _]}
      norm: {op: LayerNorm, args: [8], in: att}
      fc: {op: Linear, args: [8, 8]}
    outputs: [fc]
    placement: {attn: cuda:0, norm: cuda:1, fc: cuda:1}
"""
LSTM = """
    inputs: {x: [seq, batch, 6], h0: [1, batch, 8], c0: [1, batch, 8]}
    layers:
      lstm: {op: LSTM, args: [6, 8], in: [x, [h0, c0]], outputs: [out, [hn, cn]]}
      head: {op: Linear, args: [8, 3], in: out}
    outputs: [head, hn, cn]
    placement: {lstm: cuda:0, head: cuda:1}
"""
# An input without a batch dim goes whole to every micro-batch.
SHARED_INPUT = """
    inputs: {x: [batch, 8], shift: [8]}
    layers:
      fc1: {op: Linear, args: [8, 8]}
      moved: {op: torch.add, in: [fc1, shift]}
      fc2: {op: Linear, args: [8, 2]}
    placement: {fc1: cuda:0, moved: cuda:1, fc2: cuda:1}
"""
BATCHNORM = """
    inputs: {x: [batch, 8]}
    layers:
      fc: {op: Linear, args: [8, 8]}
      bn: {op: BatchNorm1d, args: [8]}
      head: {op: Linear, args: [8, 2]}
    placement: {fc: cuda:0, bn: cuda:1, head: cuda:1}
"""
REPEATED = """
    inputs: {x: [batch, 8]}
    layers:
      h: {op: Linear, args: [8, 8], repeat: 4}
    placement: {h.0-1: cuda:0, h.2-3: cuda:1}
"""


def spec_text(body: str, pipeline: str = "", batch: int = 12) -> str:
    return (f"mpgen: 1\nname: Net\n{textwrap.dedent(body).strip()}\n"
            f"train: {{batch_size: {batch}}}\n" + (f"pipeline: {pipeline}\n" if pipeline else ""))


_BUILT: dict[tuple[str, str], type] = {}


def build_pair(tmp_path, body: str, pipeline: str = "{microbatches: 3}"):
    """The plain and the micro-batched model classes of one spec (built once
    per module)."""
    classes = []
    for name, extra in (("plain", ""), ("micro", pipeline)):
        if (body, extra) not in _BUILT:
            spec = write_spec(tmp_path, spec_text(body, extra), f"{name}.yaml")
            build_to(spec, tmp_path / name)
            _BUILT[body, extra] = import_generated(tmp_path / name / "net.py").Net
        classes.append(_BUILT[body, extra])
    return classes


def inputs_for(body: str, batch: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    shapes = {CHAIN: [(batch, 8)], CONV: [(batch, 3, 8, 8)], ATTENTION: [(5, batch, 8)],
              LSTM: [(4, batch, 6), (1, batch, 8), (1, batch, 8)],
              SHARED_INPUT: [(batch, 8), (8,)], BATCHNORM: [(batch, 8)],
              REPEATED: [(batch, 8)]}[body]
    return tuple(torch.randn(*s) for s in shapes)


def run(model: torch.nn.Module, inputs) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Outputs and every parameter's gradient (of the sum of the outputs), on the CPU."""
    model.zero_grad()
    outputs = model(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    sum(out.sum().to("cuda:0") for out in outputs).backward()
    grads = {name: p.grad.cpu() for name, p in model.named_parameters()}
    return [out.detach().cpu() for out in outputs], grads


def compare(plain_cls, micro_cls, inputs, train: bool = True):
    with virtual_devices(cuda=3):
        torch.manual_seed(0)
        plain = plain_cls().train(train)
        micro = micro_cls().train(train)
        assert list(micro.state_dict()) == list(plain.state_dict())
        micro.load_state_dict(plain.state_dict())
        return run(plain, inputs), run(micro, inputs)


@pytest.mark.parametrize("body", [CHAIN, CONV, ATTENTION, LSTM, SHARED_INPUT, REPEATED],
                         ids=["chain-residual-multi-output", "conv", "attention-seq-first",
                              "lstm-with-state", "input-without-batch-dim", "repeated"])
@pytest.mark.parametrize("batch", [12, 7], ids=["divisible", "not-divisible"])
def test_outputs_and_gradients_equal_the_plain_forward(tmp_path, body, batch):
    plain_cls, micro_cls = build_pair(tmp_path, body)
    (out_a, grad_a), (out_b, grad_b) = compare(plain_cls, micro_cls, inputs_for(body, batch))
    assert len(out_a) == len(out_b)
    for a, b in zip(out_a, out_b):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert grad_a.keys() == grad_b.keys() and grad_a
    # A gradient is a sum over the batch: micro-batching adds its terms in
    # another order (M partial sums, then their sum), so float32 rounding
    # differs by a few ulps of the sum's terms (seen: 1.6e-6 on a value of 0.017).
    for name in grad_a:
        torch.testing.assert_close(grad_b[name], grad_a[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


def test_batchnorm_sees_micro_batches_in_training_and_agrees_in_eval(tmp_path):
    plain_cls, micro_cls = build_pair(tmp_path, BATCHNORM)
    inputs = inputs_for(BATCHNORM, 12)
    (train_a, _), (train_b, _) = compare(plain_cls, micro_cls, inputs, train=True)
    # Statistics of 4 samples, not of 12: the numbers change.
    assert not torch.allclose(train_a[0], train_b[0], atol=1e-3)
    (eval_a, _), (eval_b, _) = compare(plain_cls, micro_cls, inputs, train=False)
    torch.testing.assert_close(eval_b[0], eval_a[0], rtol=1e-5, atol=1e-6)


def test_stages_run_in_the_gpipe_wavefront(tmp_path):
    _, micro_cls = build_pair(tmp_path, CHAIN, "{microbatches: 4}")
    calls: list[tuple[int, int]] = []
    with virtual_devices(cuda=3):
        model = micro_cls()
        for k in range(3):
            method = getattr(model, f"stage_{k}")

            def record(*args, k=k, method=method):
                calls.append((k, sum(1 for s, _ in calls if s == k)))
                return method(*args)

            setattr(model, f"stage_{k}", record)
        model(torch.randn(8, 8))
    # (stage, micro-batch): at tick t stage k runs micro-batch t - k, later stages first.
    assert calls == [(0, 0),
                     (1, 0), (0, 1),
                     (2, 0), (1, 1), (0, 2),
                     (2, 1), (1, 2), (0, 3),
                     (2, 2), (1, 3),
                     (2, 3)]


def test_each_stage_is_a_method_with_its_transfers_and_forward_splits_and_concatenates(
        tmp_path):
    spec = write_spec(tmp_path, spec_text(LSTM, "{microbatches: 2}"))
    build_to(spec, tmp_path / "out")
    text = (tmp_path / "out" / "net.py").read_text()
    assert ("def stage_0(\n        self, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor\n"
            "    ) -> tuple[torch.Tensor, ...]:") in text
    assert '"""Stage 1, on cuda:1."""' in text
    assert 'out = out.to("cuda:1")' in text
    assert "microbatches = 2" in text
    assert "x.tensor_split(n, dim=1)" in text
    assert "hn = torch.cat([outs[1] for outs in batches], dim=1)" in text
    assert "for tick in range(n + len(stages) - 1):" in text


def test_names_of_the_stages_and_locals_do_not_clash_with_the_spec(tmp_path):
    body = """
        inputs: {n: [batch, 4], batches: [batch, 4]}
        layers:
          stage_0: {op: Linear, args: [4, 4], in: n}
          microbatches: {op: Linear, args: [4, 4], in: batches}
          stages: {op: torch.add, in: [stage_0, microbatches]}
        placement: {stage_0: cuda:0, microbatches: cuda:1, stages: cuda:1}
    """
    spec = write_spec(tmp_path, spec_text(body, "{microbatches: 2}"))
    build_to(spec, tmp_path / "out")
    model_cls = import_generated(tmp_path / "out" / "net.py").Net
    with virtual_devices(cuda=2):
        torch.manual_seed(0)
        model = model_cls()
        out = model(torch.randn(4, 4), torch.randn(4, 4))
    assert isinstance(model.stage_0, torch.nn.Linear)
    assert tuple(out.shape) == (4, 4)


def test_one_device_is_one_stage_and_runs_on_the_cpu(tmp_path):
    spec = write_spec(tmp_path, spec_text(CHAIN, "{microbatches: 3}"))
    build_to(spec, tmp_path / "out", {"*": "cpu"})
    model = import_generated(tmp_path / "out" / "net.py").Net()
    assert not hasattr(model, "stage_1")
    fc3, fc1 = model(torch.randn(5, 8))
    assert fc3.shape == (5, 4) and fc1.shape == (5, 16)


# Slow: runs the generated tests in a subprocess
@pytest.mark.slow
def test_the_generated_tests_expect_each_transfer_once_per_micro_batch(tmp_path):
    spec = write_spec(tmp_path, spec_text(SHARED_INPUT, "{microbatches: 3}"))
    build_to(spec, tmp_path / "out")
    text = (tmp_path / "out" / "test_net.py").read_text()
    # 3 micro-batches of TEST_BATCH (2) samples each
    assert text.count('("x", "cpu", "cuda:0", 64)') == 3
    assert text.count('("shift", "cpu", "cuda:1", 32)') == 3  # whole, each time
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "test_net.py"], cwd=tmp_path / "out", capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "6 passed" in ran.stdout
