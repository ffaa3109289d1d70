"""The memory plan (placement/memory.py) against real training steps measured
independently: each spec is built, its generated model and training script
run one steady-state step on real CPU tensors (and on virtual CUDA devices)
under mpgen.testing's MemoryTracker, and the plan's peak must be within 10%
of the measured one (NOTE [Memory plan]; docs/memory.md)."""

from __future__ import annotations

import argparse
import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mpgen.compiler.analysis.schedule import BACKWARD, FORWARD, stage_order
from mpgen.compiler.placement import memory
from mpgen.testing import virtual_devices
from mpgen.testing.memory import MemoryTracker, measure_training_step
from tests.helpers import build_to, import_generated, mpgen, write_spec

CNN = """\
mpgen: 1
name: {name}
inputs:
  images: [batch, 3, 16, 16]
layers:
  conv1: {{op: Conv2d, args: [3, 16, 3], padding: 1}}
  bn1: {{op: BatchNorm2d, args: [16]}}
  relu1: {{op: ReLU}}
  pool: {{op: MaxPool2d, args: [2]}}
  conv2: {{op: Conv2d, args: [16, 32, 3], padding: 1}}
  bn2: {{op: BatchNorm2d, args: [32]}}
  relu2: {{op: ReLU}}
  gap: {{op: AdaptiveAvgPool2d, args: [1]}}
  flat: {{op: torch.flatten, start_dim: 1}}
  fc: {{op: Linear, args: [32, 10]}}
placement:
  conv1: cuda:0
  conv2: cuda:1
train:
  loss: CrossEntropyLoss
  optimizer: {{op: SGD, lr: 0.1, momentum: 0.9}}
  batch_size: 16
"""

GPT = """\
mpgen: 1
name: {name}
inputs:
  idx: {{shape: [batch, seq], dtype: int64}}
blocks:
  Block:
    params: [dim, heads]
    layers:
      ln_1: {{op: LayerNorm, args: [$dim]}}
      attn: {{op: MultiheadAttention, args: [$dim, $heads], batch_first: true,
             in: [ln_1, ln_1, ln_1], output: 0}}
      res1: {{op: torch.add, in: [x, attn]}}
      ln_2: {{op: LayerNorm, args: [$dim]}}
      fc: {{op: Linear, args: [$dim, "=4 * $dim"]}}
      gelu: {{op: GELU}}
      proj: {{op: Linear, args: ["=4 * $dim", $dim]}}
      res2: {{op: torch.add, in: [res1, proj]}}
layers:
  wte: {{op: Embedding, args: [97, 48], in: idx}}
  h: {{op: Block, args: [48, 4], repeat: 3, checkpoint: {checkpoint}}}
  ln_f: {{op: LayerNorm, args: [48]}}
  lm_head: {{op: Linear, args: [48, 97], bias: false{tie}}}
placement:
  wte: cuda:0
  h.2: cuda:1
train:
  loss: {{op: CrossEntropyLoss, class_dim: -1}}
  optimizer: {{op: AdamW, lr: 1.0e-3, weight_decay: 0.1}}
  grad_clip: 1.0
  batch_size: 8
  dims: {{seq: 24}}
"""

TWO_HEADS = """\
mpgen: 1
name: {name}
inputs:
  x: [batch, 64]
layers:
  trunk: {{op: Linear, args: [64, 256]}}
  act: {{op: GELU}}
  cls: {{op: Linear, args: [256, 7], in: act}}
  reg_hidden: {{op: Linear, args: [256, 32], in: act}}
  reg: {{op: Linear, args: [32, 1]}}
outputs: [cls, reg]
placement:
  trunk: cuda:0
  cls: cuda:1
  reg_hidden: cuda:2
train:
  loss:
    cls: CrossEntropyLoss
    reg: MSELoss
  optimizer: {{op: Adam, lr: 1.0e-3}}
  batch_size: 32
"""

MLP = """\
mpgen: 1
name: {name}
inputs:
  x: [batch, 64]
layers:
  fc1: {{op: Linear, args: [64, 512]}}
  act1: {{op: ReLU}}
  fc2: {{op: Linear, args: [512, 512]}}
  act2: {{op: ReLU}}
  fc3: {{op: Linear, args: [512, 10]}}
placement:
  fc1: cuda:0
  fc2: cuda:1
pipeline: {{microbatches: 4, schedule: {schedule}{checkpoint}}}
train:
  loss: CrossEntropyLoss
  optimizer: {{op: Adam, lr: 1.0e-3}}
  batch_size: 32
"""

ALL_ON_CPU = {f"cuda:{k}": "cpu" for k in range(4)}


def _built(tmp_path: Path, text: str, name: str, device_map=None):
    """(the placed graph, its generated training script's TRAINING)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = write_spec(tmp_path, text.format(name=name), f"{name.lower()}.yaml")
    out = tmp_path / "out"
    result = build_to(spec, out, device_map)
    train = next(out.glob("train_*.py"))
    return result.graph, import_generated(train).TRAINING


def _measured(training, devices: int = 0) -> dict[str, int]:
    """Each device's measured peak of a steady-state step of the training
    script's own functions (on ``devices`` virtual CUDA devices, or the CPU)."""
    def run():
        torch.manual_seed(0)
        model = training.model()
        defaults = dict(training.defaults)
        args = argparse.Namespace(
            lr=defaults.pop("lr", 0.01), settings=training.settings, **defaults
        )
        optimizer = training.optimizer(model, args)
        losses = training.losses(training.settings)

        def step():
            optimizer.zero_grad(set_to_none=True)
            inputs, targets = training.make_batch(defaults["batch_size"])
            loss = training.forward_loss(model, losses, inputs, targets)[0]
            loss.backward()
            if defaults.get("grad_clip"):
                nn.utils.clip_grad_norm_(model.parameters(), defaults["grad_clip"])
            optimizer.step()

        return {d: p.peak for d, p in measure_training_step(step, model, optimizer).items()}

    if not devices:
        return run()
    # virtual_devices resolves the optimizers' foreach default as a GPU does
    # (one temporary per parameter, all at once), as the plan does for CUDA.
    with virtual_devices(cuda=devices):
        return run()


def _close(planned: dict[str, int], measured: dict[str, int]) -> dict[str, float]:
    ratios = {d: planned[d] / measured[d] for d in planned}
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), (ratios, planned, measured)
    return ratios


def _peaks(graph, mode: str = "train") -> dict[str, int]:
    return {d.device: d.peak for d in getattr(graph.memory, mode)}


# -- one device: the CPU -------------------------------------------------------

def test_a_cnn_with_batchnorm_and_sgd_momentum_on_the_cpu(tmp_path):
    graph, training = _built(tmp_path, CNN, "PlanCnn", ALL_ON_CPU)
    _close(_peaks(graph), _measured(training))
    cpu = graph.memory.of("train")["cpu"]
    # SGD with momentum keeps one buffer per parameter (BatchNorm's buffers are not trained).
    params = sum(p.numel() * 4 for p in training.model().parameters())
    assert cpu.optimizer == params and cpu.gradients == params
    assert cpu.weights > params  # and the running statistics


@pytest.mark.parametrize("tie", [", tie: {{weight: wte.weight}}", ""], ids=["tied", "untied"])
def test_a_small_gpt_with_adamw_and_grad_clip_on_the_cpu(tmp_path, tie):
    graph, training = _built(tmp_path, GPT.replace("{tie}", tie).replace("{checkpoint}", "false"),
                             "PlanGpt", ALL_ON_CPU)
    _close(_peaks(graph), _measured(training))
    cpu = graph.memory.of("train")["cpu"]
    steps = 4 * len(list(training.model().parameters()))  # each parameter's step count
    assert cpu.optimizer == 2 * cpu.gradients + steps  # exp_avg, exp_avg_sq


def test_a_model_with_two_outputs_and_adam_on_the_cpu(tmp_path):
    graph, training = _built(tmp_path, TWO_HEADS, "PlanHeads", ALL_ON_CPU)
    _close(_peaks(graph), _measured(training))


# An imported BERT's attention: dropout_p while training (SDPA then takes the
# math path, saving its probabilities and dropout mask, not the CPU flash
# kernel's output and log-sum-exp) and a bool mask broadcast over the batch.
ATTENTION = """\
mpgen: 1
name: {name}
inputs:
  x: [batch, 16, 32]
blocks:
  Attention:
    inputs: [h, mask]
    layers:
      q: {{op: Linear, args: [32, 32], in: h}}
      qh: {{op: torch.reshape, shape: [-1, 16, 4, 8]}}
      qt: {{op: torch.transpose, dim0: 1, dim1: 2}}
      k: {{op: Linear, args: [32, 32], in: h}}
      kh: {{op: torch.reshape, shape: [-1, 16, 4, 8]}}
      kt: {{op: torch.transpose, dim0: 1, dim1: 2}}
      v: {{op: Linear, args: [32, 32], in: h}}
      vh: {{op: torch.reshape, shape: [-1, 16, 4, 8]}}
      vt: {{op: torch.transpose, dim0: 1, dim1: 2}}
      att: {{op: F.scaled_dot_product_attention, in: [qt, kt, vt, {{attn_mask: mask}}],
            dropout_p: 0.1}}
      back: {{op: torch.transpose, dim0: 1, dim1: 2}}
      merged: {{op: torch.reshape, shape: [-1, 16, 32]}}
      out: {{op: Linear, args: [32, 32]}}
      res: {{op: torch.add, in: [h, out]}}
layers:
  positions: {{op: torch.arange, in: [], end: 16}}
  mask: {{op: torch.ge, args: [0]}}
  mask4: {{op: torch.reshape, shape: [1, 1, 1, 16]}}
  wide: {{op: torch.broadcast_to, size: ["=size(x, 0)", -1, 16, 16]}}
  layer: {{op: Attention, in: [x, wide], repeat: 2, checkpoint: {checkpoint}}}
  head: {{op: Linear, args: [32, 4]}}
train:
  loss: {{op: CrossEntropyLoss, class_dim: -1}}
  optimizer: {{op: SGD, lr: 0.1}}
  batch_size: 32
"""


@pytest.mark.slow  # 3 s: too long for the quick loop
@pytest.mark.parametrize("checkpoint", ["false", "true"])
def test_attention_with_dropout_is_planned_as_it_trains(tmp_path, checkpoint):
    # The plan runs the step in training: dropout_p is 0.1 there (it was
    # eval's 0.0, so the plan took the flash kernel and planned 0.6x), also
    # in a checkpointed block's recompute.
    graph, training = _built(tmp_path, ATTENTION.replace("{checkpoint}", checkpoint),
                             "PlanAttention", ALL_ON_CPU)
    _close(_peaks(graph), _measured(training))
    # and inference, in eval, without it: less than training's activations
    assert graph.memory.of("inference")["cpu"].peak < graph.memory.of("train")["cpu"].peak


@pytest.mark.slow  # 14 s: too long for the quick loop
def test_checkpointed_blocks_keep_less_and_still_match(tmp_path):
    plain, training = _built(tmp_path / "a", GPT.replace("{tie}", "").replace(
        "{checkpoint}", "false"), "PlanGptPlain", ALL_ON_CPU)
    graph, training = _built(tmp_path / "b", GPT.replace("{tie}", "").replace(
        "{checkpoint}", "true"), "PlanGptCkpt", ALL_ON_CPU)
    _close(_peaks(graph), _measured(training))
    assert graph.memory.of("train")["cpu"].activations < \
        plain.memory.of("train")["cpu"].activations


# -- several devices: virtual CUDA devices -----------------------------------------

@pytest.mark.slow  # 6 s: too long for the quick loop
@pytest.mark.parametrize("text, name, devices", [
    (CNN, "PlanCnnTwo", 2),
    (GPT.replace("{tie}", ", tie: {{weight: wte.weight}}").replace("{checkpoint}", "false"),
     "PlanGptTwo", 2),
])
def test_each_device_of_a_placed_model(tmp_path, text, name, devices):
    graph, training = _built(tmp_path, text, name)
    measured = _measured(training, devices)
    planned = _peaks(graph)
    assert sorted(planned) == [f"cuda:{k}" for k in range(devices)]
    _close(planned, {d: measured[d] for d in planned})


@pytest.mark.slow
def test_each_of_three_devices_of_a_model_with_two_heads(tmp_path):
    graph, training = _built(tmp_path, TWO_HEADS, "PlanHeadsThree")
    measured = _measured(training, 3)
    planned = _peaks(graph)
    _close(planned, {d: measured[d] for d in planned})


# -- the pipeline program ------------------------------------------------------

def _pipeline_measured(graph, schedule: str, checkpoint: bool) -> dict[str, int]:
    """Each stage's peak over a steady-state step of ``schedule``, replayed on
    real CPU tensors with plain torch (nn.Linear stages of MLP, as
    pp_<name>.py splits it): each micro-batch's graph held from its F to its
    B, PipelineStage's receive buffers (one per micro-batch for activations
    in, one for gradients of activations out), the last stage's outputs kept
    until the step ends."""
    torch.manual_seed(0)
    layers = [[nn.Linear(64, 512), nn.ReLU()], [nn.Linear(512, 512), nn.ReLU(),
                                                nn.Linear(512, 10)]]
    m, batch, peaks = 4, 32, {}
    for k, device in enumerate(("cuda:0", "cuda:1")):
        stage = nn.Sequential(*layers[k])
        optimizer = torch.optim.Adam(stage.parameters(), lr=1e-3, foreach=True)  # as on a GPU
        mb = batch // m
        x = torch.randn(batch, 64)
        y = torch.randint(0, 10, (batch,))

        def forward(i):
            if k == 0:
                inputs = x[i * mb:(i + 1) * mb]
            else:
                inputs = received[i].detach().requires_grad_(True)
            run = (lambda t: torch.utils.checkpoint.checkpoint(stage, t, use_reentrant=False)) \
                if checkpoint else stage
            return inputs, run(inputs)

        def step():
            optimizer.zero_grad(set_to_none=True)
            held, kept = {}, []
            for kind, i in stage_order(schedule, k, 2, m):
                if kind == FORWARD:
                    held[i] = forward(i)
                    if k == 1:
                        kept.append(held[i][1])
                elif kind == BACKWARD:
                    inputs, out = held.pop(i)
                    if k == 1:
                        nn.functional.cross_entropy(out, y[i * mb:(i + 1) * mb]).backward()
                    else:
                        out.backward(grads[i])
            optimizer.step()

        received = [torch.empty(mb, 512) for _ in range(m)] if k == 1 else []
        grads = [torch.empty(mb, 512) for _ in range(m)] if k == 0 else []
        step()
        optimizer.zero_grad(set_to_none=True)
        tracker = MemoryTracker()
        tracker.track(stage, optimizer, *received, *grads)
        with tracker:
            step()
        peaks[device] = tracker.peaks["cpu"].peak
    return peaks


@pytest.mark.parametrize("schedule, checkpoint", [
    ("gpipe", False), ("1f1b", False), ("gpipe", True), ("1f1b", True)])
def test_each_stage_of_the_pipeline_program(tmp_path, schedule, checkpoint):
    extra = ", checkpoint: [cuda:0, cuda:1]" if checkpoint else ""
    text = MLP.replace("{schedule}", schedule).replace("{checkpoint}", extra)
    spec = write_spec(tmp_path, text.format(name="PlanPipe"), "pipe.yaml")
    graph = build_to(spec, tmp_path / "out").graph
    assert (graph.memory.schedule, graph.memory.microbatches) == (schedule, 4)
    _close(_peaks(graph, "pipeline"), _pipeline_measured(graph, schedule, checkpoint))


def test_gpipe_holds_more_micro_batches_than_1f1b_on_the_first_stage(tmp_path):
    spec = write_spec(tmp_path, MLP.replace("{schedule}", "gpipe").replace(
        "{checkpoint}", "").format(name="PlanPipe"), "pipe.yaml")
    graph = build_to(spec, tmp_path / "out").graph
    gpipe = memory.plan(graph, schedule="gpipe", microbatches=8)
    one_f_one_b = memory.plan(graph, schedule="1f1b", microbatches=8)
    assert gpipe.of("pipeline")["cuda:0"].activations > \
        one_f_one_b.of("pipeline")["cuda:0"].activations


@pytest.mark.slow  # 6 s: too long for the quick loop
def test_the_plan_is_the_same_on_every_call(tmp_path):
    # A storage dies when reference counting frees it, never when a garbage
    # collection happens to run: the first call used to differ from later ones.
    graph, _ = _built(tmp_path, CNN, "PlanCnnAgain")
    plans = []
    for _ in range(3):
        plans.append(memory.plan(graph, batch=16, schedule="gpipe", microbatches=4))
        gc.collect()
    assert plans[0] == plans[1] == plans[2]


@pytest.mark.slow  # 3 s: too long for the quick loop
def test_a_cpu_build_plans_each_rank_by_its_spec_device_with_the_cpus_optimizer(tmp_path):
    cpu, _ = _built(tmp_path / "cpu", TWO_HEADS, "PlanHeadsRanks", ALL_ON_CPU)
    split, _ = _built(tmp_path / "split", TWO_HEADS, "PlanHeadsRanks")
    on_cpu = memory.plan(cpu, batch=16, schedule="1f1b", microbatches=4).of("pipeline")
    on_cuda = memory.plan(split, batch=16, schedule="1f1b", microbatches=4).of("pipeline")
    assert list(on_cpu) == list(on_cuda) == ["cuda:0", "cuda:1", "cuda:2"]  # pp --memory's
    # Adam's step on the trunk's rank (one dominant weight): the CPU's
    # single-tensor loop holds two temporaries of it (sqrt, then the
    # division), CUDA's foreach one of every parameter, so the CPU's is higher.
    assert on_cpu["cuda:0"].phase == "optimizer step"
    assert on_cpu["cuda:0"].peak > on_cuda["cuda:0"].peak


PIPELINE_RANK = re.compile(r"memory rank \d+: (\S+) \(on cpu\), step \d+: measured [\d.]+ MiB "
                           r"\((\d+) bytes\)")


@pytest.mark.slow
@pytest.mark.parametrize("text, name, ranks", [(CNN, "MemCnn", 2), (TWO_HEADS, "MemHeads", 3)],
                         ids=["cnn-batchnorm-sgd-momentum", "two-outputs-adam"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_rank_of_a_cpu_built_pipeline_program_measured(tmp_path, text, name, ranks,
                                                            schedule):
    """``pp_<name>.py --memory`` under torchrun on the CPU, each rank's peak
    against the plan of that build at the schedule it runs."""
    graph, _ = _built(tmp_path, text, name, ALL_ON_CPU)
    planned = memory.plan(graph, batch=16, schedule=schedule, microbatches=4).of("pipeline")
    script = next((tmp_path / "out").glob("pp_*.py"))
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), script.name, "--steps", "2", "--memory", "--schedule", schedule,
         "--microbatches", "4", "--batch-size", "16", "--log-dir", str(tmp_path / "runs")],
        cwd=script.parent, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    measured = {d: int(n) for d, n in PIPELINE_RANK.findall(run.stdout + run.stderr)}
    assert set(measured) == set(planned), run.stdout[-3000:] + run.stderr[-3000:]
    _close({d: p.peak for d, p in planned.items()}, measured)


# -- the plan's interface ------------------------------------------------------

def test_a_larger_batch_needs_more_and_inference_needs_less(tmp_path):
    graph, _ = _built(tmp_path, CNN, "PlanCnnSizes", ALL_ON_CPU)
    small, large = memory.plan(graph, batch=4), memory.plan(graph, batch=64)
    assert large.of("train")["cpu"].peak > small.of("train")["cpu"].peak
    assert (small.batch, large.batch) == (4, 64)
    for plan in (small, large):
        assert plan.of("inference")["cpu"].peak < plan.of("train")["cpu"].peak
        assert plan.of("inference")["cpu"].gradients == 0


def test_where_the_simulation_cannot_run_the_additive_estimate_stands_in(tmp_path):
    graph, _ = _built(tmp_path, TWO_HEADS, "PlanEstimate", ALL_ON_CPU)

    def fails():
        raise NotImplementedError("an operator without a fake kernel")

    unsimulated = []
    (estimate,) = memory._or_estimate(graph, 32, fails, "train", None, None, unsimulated)
    assert unsimulated == [("train", "NotImplementedError: an operator without a fake kernel",
                            None)]
    unit_sum = sum(u.weight_bytes + u.grad_bytes + u.optimizer_bytes + u.activation_bytes
                   for u in graph.costs.units)
    assert (estimate.device, estimate.phase, estimate.peak) == ("cpu", "estimate", unit_sum)
    assert estimate.weights == graph.memory.of("train")["cpu"].weights


NUMPY_LAYER = """\
import numpy as np
import torch
from torch import nn


class Rank(nn.Module):
    \"\"\"Each row's values by rank: numpy on real data, a shaped empty on meta.\"\"\"

    def forward(self, x):
        if x.is_meta:
            return torch.empty_like(x)
        return torch.from_numpy(np.argsort(x.detach().cpu().numpy(), axis=-1).astype("float32"))
"""


def test_a_step_the_plan_cannot_simulate_is_a_note_at_its_layer(tmp_path):
    """A layer whose forward needs real data (numpy) runs on the meta device
    but not on fake tensors: the plan's training step is the additive
    estimate, and the build says so at that layer, never silently."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "ranks.py").write_text(NUMPY_LAYER)
    spec = write_spec(tmp_path, """\
        mpgen: 1
        name: Ranked
        inputs:
          x: [batch, 8]
        layers:
          fc: {op: Linear, args: [8, 8]}
          rank: {op: ranks.Rank}
          head: {op: Linear, args: [8, 2]}
        train:
          loss: CrossEntropyLoss
          optimizer: {op: SGD, lr: 0.1}
          batch_size: 4
    """)
    ran = mpgen("build", str(spec), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    notes = [line for line in ran.stderr.splitlines() if "memory plan" in line]
    assert notes == [
        f"{spec}:7:3: note: the memory plan could not simulate the training step, a forward "
        "without gradients or the pipeline program's step (RuntimeError: .numpy() is not "
        "supported for tensor subclasses.), so their peaks are the additive estimate "
        "(\"estimate\" in the placement report)"]
    report = (tmp_path / "out" / "ranked.placement.md").read_text()
    assert "`estimate`" in report


def test_a_capacity_with_room_builds(tmp_path):
    text = TWO_HEADS + "capacity: {{cuda:0: 1GiB, cuda:1: 1GiB, cuda:2: 1GiB}}\n"
    spec = write_spec(tmp_path, text.format(name="Roomy"), "roomy.yaml")
    assert mpgen("show", str(spec)).returncode == 0
    assert memory.check_capacity(build_to(spec, tmp_path / "out").graph) == []


def test_a_capacity_follows_the_device_map(tmp_path):
    text = TWO_HEADS + "capacity: {{cuda:0: 1KiB, cpu: {cpu}}}\n"
    tight = write_spec(tmp_path, text.format(name="Mapped", cpu="1KiB"), "tight.yaml")
    roomy = write_spec(tmp_path, text.format(name="Mapped", cpu="1GiB"), "roomy.yaml")
    # On its own devices only cuda:0's capacity applies, and it is too small.
    ran = mpgen("show", str(roomy))
    assert ran.returncode == 2 and "cuda:0 needs" in ran.stderr
    # --device-map cpu merges the three: cuda:0's no longer applies; the CPU's does.
    assert mpgen("show", str(roomy), "--device-map", "cpu").returncode == 0
    ran = mpgen("show", str(tight), "--device-map", "cpu")
    assert ran.returncode == 2 and "cpu needs" in ran.stderr and "capacity is 1.0 KiB" in ran.stderr
