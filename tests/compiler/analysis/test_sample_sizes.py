"""A spec is checked at the sizes its generated code runs at (issue 22).

Symbolic dims are checked at large primes (NOTE [Symbolic dims]), where a
32x32 kernel over ``[batch, 3, h, w]`` runs; the training script and the
generated tests run at the training sizes (16 for a dim ``train.dims``
leaves out), where it does not. The build now also runs the graph at those
sizes (NOTE [Sample sizes] in analysis/shapes.py) and refuses a spec that
fails there, at the input, naming the dims and the ``train.dims`` to set.
"""

from __future__ import annotations

import pytest

from helpers import build_to, mpgen, write_spec
from mpgen.compiler import driver as build
from mpgen.compiler.analysis import shapes
from run_generated import run_suite_on_virtual_devices, train_one_step


def conv_spec(kernel: str, dims: str = "", body: str = "") -> str:
    """A classifier over ``[batch, 3, h, w]`` whose first layer is a
    convolution with ``kernel``; ``dims``: its ``train.dims``."""
    return f"""
        mpgen: 1
        name: Kernel
        inputs:
          images: [batch, 3, h, w]
        layers:
          conv: {{op: Conv2d, args: [3, 8, {kernel}]{body}}}
          pool: {{op: AdaptiveAvgPool2d, args: [1]}}
          flat: {{op: torch.flatten, start_dim: 1}}
          logits: {{op: Linear, args: [8, 10]}}
        placement: {{conv: cuda:0, logits: cuda:1}}
        train:
          loss: CrossEntropyLoss
          optimizer: {{op: SGD, lr: 0.01}}
          batch_size: 2
          steps: 1
          {f"dims: {dims}" if dims else ""}
    """


def refusal(tmp_path, text: str) -> str:
    """What ``mpgen build`` says when it refuses ``text``; nothing is written."""
    spec = write_spec(tmp_path, text)
    ran = mpgen("build", str(spec), "-o", str(tmp_path / "out"))
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert "Traceback" not in ran.stderr
    assert not (tmp_path / "out").exists()
    [line] = ran.stderr.splitlines()
    return line.removeprefix(f"{spec}:")


BATCHNORM = """\
mpgen: 1
name: Piped
inputs:
  x: [batch, 8]
layers:
  fc: {op: Linear, args: [8, 8]}
  bn: {op: BatchNorm1d, args: [8]}
placement: {fc: cuda:0, bn: cuda:1}
"""
#: BATCHNORM over 3 micro-batches of 4 samples.
PIPED = BATCHNORM + "train: {loss: MSELoss, batch_size: 12}\npipeline: {microbatches: 3}\n"


def test_the_32x32_kernel_at_the_default_sizes_is_refused_at_its_input_naming_h_and_w(tmp_path):
    said = refusal(tmp_path, conv_spec("32"))
    assert said.startswith("4:3: input 'images': h and w too small at the training and "
                           "test sizes (batch=2, h=16, w=16): layer 'conv': Conv2d(3, 8, 32) fails on "
                           "images [2, 3, 16, 16]: ")
    assert "Kernel size can't be greater than actual input size" in said
    assert said.endswith(" (line 6); set train.dims: {h: 32, w: 32}")


def test_the_fix_names_only_the_dims_that_need_it_doubled_from_their_sizes(tmp_path):
    said = refusal(tmp_path, conv_spec("[1, 24]"))
    assert said.startswith("4:3: input 'images': w too small at ")
    assert said.endswith("; set train.dims: {w: 32}")
    # Sizes train.dims gives are doubled from there.
    said = refusal(tmp_path, conv_spec("32", dims="{h: 20, w: 24}"))
    assert said.startswith("4:3: input 'images': h and w too small at the training and "
                           "test sizes (batch=2, h=20, w=24): ")
    assert said.endswith("; set train.dims: {h: 40, w: 48}")


def test_a_failure_no_larger_size_cures_is_refused_at_its_layer(tmp_path):
    # BatchNorm1d in training needs two samples; the training batch has one.
    said = refusal(tmp_path, BATCHNORM + "train: {loss: MSELoss, batch_size: 1}\n")
    assert said.startswith("7:3: layer 'bn': BatchNorm1d(8) fails on fc [1, 8]: Expected more "
                           "than 1 value per channel when training")
    assert said.endswith(", at the training sizes (batch=1); the training script and the "
                         "generated tests run at these sizes: set them with train.batch_size "
                         "and train.dims")


def test_a_spec_that_runs_at_every_size_keeps_its_sizes(tmp_path):
    result = build_to(write_spec(tmp_path, conv_spec("3", body=", padding: 1")),
                      tmp_path / "out")
    assert dict(result.graph.dims) == {"batch": 2, "h": 16, "w": 16}
    assert shapes.sample_sizes(result.graph) == {
        "the training and test sizes": {"batch": 2, "h": 16, "w": 16}}
    assert "images = torch.randn((2, 3, 16, 16))" in result.files["test_kernel.py"]
    assert "def make_batch(batch_size: int, h: int = 16, w: int = 16)" \
        in result.files["train_kernel.py"]


def test_the_sizes_checked_are_those_of_a_micro_batch(tmp_path):
    graph = build.compile_spec(write_spec(tmp_path, PIPED))
    # The tests' batch is 2 per micro-batch, never 1: BatchNorm1d runs.
    assert graph.test_dims == {"batch": 6}
    assert shapes.sample_sizes(graph) == {"the training sizes": {"batch": 4},
                                          "the sizes of the generated tests": {"batch": 2}}
    # A training batch of 3 in 3 micro-batches gives BatchNorm1d one sample.
    said = refusal(tmp_path, PIPED.replace("batch_size: 12", "batch_size: 3"))
    assert said.startswith("7:3: layer 'bn': BatchNorm1d(8) fails on fc [1, 8]: ")
    assert ", at the training sizes (batch=1 per micro-batch); " in said


@pytest.mark.slow  # runs the generated tests and a training step
def test_at_the_sizes_the_refusal_names_the_spec_passes_its_tests_and_trains(tmp_path):
    spec = write_spec(tmp_path, conv_spec("32", dims="{h: 32, w: 32}"))
    result = build_to(spec, tmp_path / "out")
    assert "images = torch.randn((2, 3, 32, 32))" in result.files["test_kernel.py"]
    assert "h: int = 32, w: int = 32" in result.files["train_kernel.py"]
    assert len(run_suite_on_virtual_devices(tmp_path / "out" / "test_kernel.py")) == 6
    build_to(spec, tmp_path / "cpu", {"*": "cpu"})
    assert "step 1/1  loss" in train_one_step(tmp_path / "cpu" / "train_kernel.py")


@pytest.mark.slow  # runs the generated tests
def test_the_generated_tests_of_a_micro_batched_batchnorm_pass(tmp_path):
    # At a batch of 3 (the old max(2, microbatches)) each micro-batch held
    # one sample, and BatchNorm1d failed in the generated tests.
    result = build_to(write_spec(tmp_path, PIPED), tmp_path / "out")
    assert "x = torch.randn((6, 8))" in result.files["test_piped.py"]
    assert len(run_suite_on_virtual_devices(tmp_path / "out" / "test_piped.py")) == 6
