"""A user's own loss and optimizer classes in ``train:`` (issue 11): named by
their dotted path like a user layer, imported under the same policy
(docs/spec.md, "User modules"), checked at build time on a sample, and
imported by the training script and the generated tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import mpgen, write_spec

pytestmark = pytest.mark.slow  # runs generated scripts (subprocesses, torchrun) or builds many specs

TRAINING = """\
import torch
from torch import nn


class FocalLoss(nn.Module):
    \"\"\"Cross-entropy weighting hard examples up (Lin et al., 2017).\"\"\"

    def __init__(self, gamma=2.0):
        super().__init__()
        self.gamma = gamma

    def forward(self, logits, target):
        logp = torch.log_softmax(logits, dim=1)
        picked = logp.gather(1, target.unsqueeze(1)).squeeze(1)
        return (-(1 - picked.exp()) ** self.gamma * picked).mean()


class SignSGD(torch.optim.Optimizer):
    \"\"\"Steps by the gradient's sign.\"\"\"

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class NotAnOptimizer:
    pass
"""

SPEC = """
    mpgen: 1
    name: Focal
    inputs:
      x: [batch, 8]
    layers:
      fc: {{op: Linear, args: [8, 3]}}
    train:
      loss: {loss}
      optimizer: {optimizer}
      batch_size: 4
      steps: 2
"""


def project(tmp_path, loss="{op: mytraining.losses.FocalLoss, gamma: 1.5, class_dim: 1}",
            optimizer="{op: mytraining.losses.SignSGD, lr: 0.001}"):
    (tmp_path / ".git").mkdir()
    package = tmp_path / "mytraining"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "losses.py").write_text(TRAINING)
    return write_spec(tmp_path, SPEC.format(loss=loss, optimizer=optimizer), "focal.yaml")


def run(args, cwd, pythonpath):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_users_loss_and_optimizer_train_and_the_generated_tests_pass(tmp_path):
    project(tmp_path)
    built = mpgen("build", "focal.yaml", "-o", "out", "--device-map", "cpu", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    script = (tmp_path / "out" / "train_focal.py").read_text()
    assert "import mytraining.losses\n" in script
    assert "mytraining.losses.FocalLoss(**mpgen_runtime.keywords(loss, \"class_dim\"))" in script
    settings = script[script.index("    settings={"):]
    assert '"op": "mytraining.losses.FocalLoss"' in settings and '"gamma": 1.5' in settings
    assert "mytraining.losses.SignSGD(model.parameters(), lr=args.lr, **kwargs)" in script
    ran = run(["train_focal.py", "--steps", "3"], tmp_path / "out", str(tmp_path))
    assert ran.returncode == 0, ran.stderr
    assert "step 3/3  loss " in ran.stdout
    tests = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_focal.py"],
                tmp_path / "out", str(tmp_path))
    assert tests.returncode == 0, tests.stdout + tests.stderr


def test_a_users_loss_without_class_dim_takes_values_shaped_like_the_output(tmp_path):
    project(tmp_path, loss="mytraining.losses.FocalLoss", optimizer="SGD")
    built = mpgen("build", "focal.yaml", "-o", "out", "--device-map", "cpu", cwd=tmp_path)
    # FocalLoss gathers class indices: values shaped like the output fail, indices work.
    assert built.returncode == 0, built.stderr
    assert "torch.randint(0, 3, (batch_size,))" in (tmp_path / "out" / "train_focal.py").read_text()


def test_a_class_that_is_not_an_optimizer_is_refused_at_the_op(tmp_path):
    spec = project(tmp_path, optimizer="mytraining.losses.NotAnOptimizer")
    ran = mpgen("build", "focal.yaml", "-o", "out", cwd=tmp_path)
    assert ran.returncode == 2
    assert ran.stderr == (f"{spec.name}:9:14: train.optimizer: 'mytraining.losses.NotAnOptimizer' "
                       "is not a torch.optim.Optimizer class\n")
    assert not (tmp_path / "out").exists()


def test_a_loss_class_outside_the_project_is_refused_by_the_import_policy(tmp_path):
    project(tmp_path, loss="{op: os.path.join}")
    ran = mpgen("build", "focal.yaml", "-o", "out", cwd=tmp_path)
    assert ran.returncode == 2
    assert "train.loss: 'os.path.join' is in the standard library" in ran.stderr


def test_the_pipeline_program_imports_the_users_loss_and_optimizer(tmp_path):
    project(tmp_path)
    write_spec(tmp_path, """
        mpgen: 1
        name: FocalPipe
        inputs:
          x: [batch, 8]
        layers:
          fc: {op: Linear, args: [8, 16]}
          act: {op: ReLU}
          out: {op: Linear, args: [16, 3]}
        placement:
          fc: cuda:0
          out: cuda:1
        train:
          loss: {op: mytraining.losses.FocalLoss, gamma: 1.5, class_dim: 1}
          optimizer: {op: mytraining.losses.SignSGD, lr: 0.001}
          batch_size: 4
        """, "focal_pipe.yaml")
    built = mpgen("build", "focal_pipe.yaml", "-o", "out", "--device-map", "cpu", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    # The stages' losses and optimizers are train_focal_pipe.py's, which imports them.
    script = (tmp_path / "out" / "pp_focal_pipe.py").read_text()
    assert "import train_focal_pipe\n" in script
    assert "import mytraining.losses\n" in (tmp_path / "out" / "train_focal_pipe.py").read_text()
    ran = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "pp_focal_pipe.py", "--steps", "2", "--batch-size", "4"],
              tmp_path / "out", str(tmp_path))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "step 2/2  loss " in ran.stdout
