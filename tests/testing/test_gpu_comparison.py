"""The real-GPU comparison of the generated tests, proven on the CPU.

``check_split_outputs`` must accept the differences GPU kernels really make
(measured on an H200, see the NOTE in mpgen/testing/compare.py) and reject
real bugs.  ``merged_devices``, which runs split code on one device for that
comparison, is checked on virtual devices and on the meta device.
"""

from __future__ import annotations

import ast
import contextlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import mpgen.testing
from mpgen.testing import check_split_outputs, merged_devices, virtual_devices
from mpgen.testing import _function_mode, _torch_compat, suite
from mpgen.testing.merge import _MergeDevices

from helpers import EXAMPLES, build_to, import_generated

# From the measurement on one H200 (torch 2.11), float32 against a float64
# CPU reference with the same weights: max|output|, then the largest error of
# the CPU in float32, the GPU in float32 (TF32 off) and the GPU with TF32.
MEASURED = {
    "gpt2_small": (2.89, 2.1e-06, 2.7e-04, 1.1e-03),
    "bert_base": (0.092, 2.6e-07, 4.2e-05, 2.8e-04),
    "res_net18": (0.16, 2.8e-08, 7.6e-08, 6.4e-05),
    "small_cnn": (0.17, 2.1e-08, 2.6e-08, 6.2e-05),
    "residual_mlp": (0.60, 3.6e-08, 3.6e-08, 2.7e-04),
    "multi_task_net": (0.12, 1.6e-08, 1.7e-08, 4.0e-05),
}


def noise(like: torch.Tensor, largest: float, seed: int) -> torch.Tensor:
    """Uniform noise in [-largest, largest], reaching ``largest`` once."""
    g = torch.Generator().manual_seed(seed)
    n = (torch.rand(like.shape, generator=g, dtype=torch.float64) * 2 - 1) * largest
    n.view(-1)[0] = largest
    return n


def reference(magnitude: float, seed: int = 0) -> torch.Tensor:
    """A float64 'exact' output whose largest entry is ``magnitude``."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(2, 32, 100, generator=g, dtype=torch.float64)
    return t * (magnitude / t.abs().max())


@pytest.mark.parametrize("tf32", [False, True], ids=["fp32", "tf32"])
@pytest.mark.parametrize("model", MEASURED)
def test_gpu_kernel_sized_differences_pass(model, tf32):
    magnitude, cpu_error, gpu_error, tf32_error = MEASURED[model]
    exact = reference(magnitude)
    gpu = (exact + noise(exact, tf32_error if tf32 else gpu_error, 1)).float()
    cpu = (exact + noise(exact, cpu_error, 2)).float()
    # The split and the merged run use the same kernels: equal, or a few
    # ulps apart where a reduction ran in another order.
    ulps = magnitude * torch.finfo(torch.float32).eps * 4
    reordered = (gpu.double() + noise(exact, ulps, 3)).float()
    check_split_outputs([gpu], [gpu.clone()], [cpu])
    check_split_outputs([reordered], [gpu], [cpu])


class TwoHeads(nn.Module):
    """A small residual network with two outputs, and bugs on request."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.head_a = nn.Linear(32, 8)
        self.head_b = nn.Linear(32, 8)

    def forward(self, x, bug=None):
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i == 2 and bug == "layer skipped":
                continue
            if i == 2 and bug == "residual missing":
                h = torch.tanh(block(h))
            else:
                h = h + torch.tanh(block(h))
        if bug == "transfer lost half the data":
            h = torch.cat([h[:, :16], torch.zeros_like(h[:, 16:])], dim=1)
        if bug == "nan":
            h = h.clone()
            h[0, 0] = float("nan")
        a, b = self.head_a(h), self.head_b(h)
        return (b, a) if bug == "outputs swapped" else (a, b)


BUGS = ["layer skipped", "residual missing", "transfer lost half the data",
        "outputs swapped", "nan"]


def outputs(net, x, magnitude, bug=None, error=0.0, seed=0):
    """The net's outputs in float32, scaled so the largest is ``magnitude``,
    plus noise up to ``error``."""
    with torch.no_grad():
        exact = [o.double() for o in net(x.double(), bug)]
        scale = magnitude / max(o.abs().max() for o in net(x.double()))
        return [(o * scale + noise(o, error, seed + i)).float() for i, o in enumerate(exact)]


@pytest.mark.parametrize("bug", BUGS)
@pytest.mark.parametrize("model", MEASURED)
def test_a_real_bug_fails(model, bug):
    magnitude, cpu_error, _, tf32_error = MEASURED[model]
    net = TwoHeads().double()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    cpu = outputs(net, x, magnitude, error=cpu_error, seed=10)
    merged = outputs(net, x, magnitude, error=tf32_error, seed=20)  # the noisiest GPU
    check_split_outputs(merged, merged, cpu)  # no bug: passes
    # A bug in the split run only (a transfer, a device-dependent branch).
    split = outputs(net, x, magnitude, bug, error=tf32_error, seed=20)
    with pytest.raises(AssertionError, match="splitting the model changed its result"
                       if bug != "nan" else "inf/nan entries differ"):
        check_split_outputs(split, merged, cpu)
    # The same bug in both GPU runs (a GPU kernel computing something else):
    # the loose comparison with the CPU still catches it.
    with pytest.raises(AssertionError, match="GPU vs CPU|inf/nan"):
        check_split_outputs(split, split, cpu)


def test_outputs_must_agree_in_number_shape_and_dtype():
    a = torch.ones(2, 3)
    with pytest.raises(AssertionError, match="1 outputs, expected 2"):
        check_split_outputs([a], [a, a])
    with pytest.raises(AssertionError, match="shape"):
        check_split_outputs([a], [torch.ones(3, 2)])
    with pytest.raises(AssertionError, match="dtype"):
        check_split_outputs([a], [a.double()])
    with pytest.raises(AssertionError, match="1 entries differ"):
        check_split_outputs([torch.tensor([1, 2])], [torch.tensor([1, 3])])
    with pytest.raises(AssertionError, match="differs by up to"):
        check_split_outputs([a + 1e-6], [a], exact=True)
    check_split_outputs(torch.zeros(2), torch.zeros(2), torch.zeros(2))


# -- merged_devices ----------------------------------------------------------


class Split(nn.Module):
    """Moves by every spelling the generated code or a person might use."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3).to("cuda:0")
        self.b = nn.Linear(3, 3).to(torch.device("cuda", 1))
        self.c = nn.Linear(3, 3, device="cuda:1")
        self.d = nn.Linear(3, 2).cuda(1)

    def forward(self, x):
        h = self.a(x.to("cuda:0"))
        h = self.b(h.to("cuda:1")) + torch.ones(3, device="cuda:1")
        return self.d(self.c(h.cuda(1)))


def test_merged_devices_runs_split_code_on_one_virtual_device():
    x = torch.randn(5, 4)
    with virtual_devices(cuda=2) as vd:
        torch.manual_seed(0)
        split = Split()
        with vd.record() as rec:
            out = split(x)
        assert [(t.src, t.dst) for t in rec.transfers] == [("cpu", "cuda:0"), ("cuda:0", "cuda:1")]
        with merged_devices("cuda:0"):
            torch.manual_seed(0)
            merged = Split()
            assert {str(p.device) for p in merged.parameters()} == {"cuda:0"}
            with vd.record() as rec:
                merged_out = merged(x)
            assert [(t.src, t.dst) for t in rec.transfers] == [("cpu", "cuda:0")]
            assert merged_out.device == torch.device("cuda:0")
        # restored on exit
        assert torch.zeros(1, device="cuda:1").device == torch.device("cuda:1")
        assert split(x).device == torch.device("cuda:1")
        check_split_outputs(out.cpu(), merged_out.cpu(), exact=True)


def test_merged_devices_restores_the_virtual_devices_after_an_error():
    with virtual_devices(cuda=2):
        with pytest.raises(ZeroDivisionError):
            with merged_devices():
                1 / 0
        assert torch.ones(1).to("cuda:1").device == torch.device("cuda:1")


def test_the_remapping_mode_alone_rewrites_every_device_argument():
    # What real GPUs see, without virtual devices: onto the meta device here.
    with _MergeDevices(torch.device("meta")):
        layer = nn.Linear(2, 2).to("cuda:1")
        assert layer.weight.device.type == "meta"
        assert nn.Linear(2, 2, device="cuda:3").weight.device.type == "meta"
        assert torch.zeros(2, device=torch.device("cuda", 2)).device.type == "meta"
        assert torch.randn(2).to(1).device.type == "meta"
        assert torch.randn(2).to("cuda:1", torch.float64).dtype == torch.float64
        assert torch.randn(2).to("cpu").device.type == "cpu"
        assert torch.randn(2).to(torch.float16).dtype == torch.float16


def test_merged_devices_wants_one_cuda_device():
    with pytest.raises(ValueError):
        with merged_devices("cpu"):
            pass


# -- torch compatibility -----------------------------------------------------


def test_full_float32_restores_the_matmul_precision():
    before = torch.get_float32_matmul_precision()
    with _torch_compat.full_float32_on_gpu():
        assert torch.get_float32_matmul_precision() == "highest"
        assert not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == before


def test_the_torch_2_11_redispatch_works(monkeypatch):
    # torch 2.11 lacks torch.overrides.redispatch_function; the fallback is
    # the private hook it wraps.  Run attention (a Python-level torch
    # function) on virtual devices with the fallback.
    monkeypatch.delattr(torch.overrides, "redispatch_function", raising=False)
    fallback = _torch_compat._find_redispatch()
    assert fallback is not None
    monkeypatch.setattr(_function_mode, "redispatch", fallback)
    with virtual_devices(cuda=2):
        torch.manual_seed(0)
        attention = nn.MultiheadAttention(8, 2, batch_first=True).to("cuda:1")
        x = torch.randn(2, 5, 8).to("cuda:1")
        out, _ = attention(x, x, x)
        assert out.device == torch.device("cuda:1")
        got = out.cpu()
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(got, attention(x, x, x)[0], rtol=0, atol=0)


PRIVATE_NAMES = {"_cdata", "_schema", "_make_wrapper_subclass", "_is_param"}


def test_only_the_compat_module_touches_private_torch_apis():
    package = Path(mpgen.testing.__file__).parent
    for path in sorted(package.glob("*.py")):
        if path.name == "_torch_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                assert not (parts[0] == "torch" and any(p.startswith("_") for p in parts)), where
            if isinstance(node, ast.Attribute):
                assert node.attr not in PRIVATE_NAMES, where
                chain, value = [node.attr], node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id == "torch":
                    private = [c for c in chain if c.startswith("_") and not c.startswith("__")]
                    assert not private, f"{where}: torch...{'.'.join(reversed(chain))}"


# -- the generated tests' real-GPU arm, with virtual devices standing in -------


@pytest.fixture
def fresh_seed_modules():
    """The seed's generated modules are imported anew, and forgotten after."""
    names = ("simple_model", "test_simple_model")
    for name in names:
        sys.modules.pop(name, None)
    yield
    for name in names:
        sys.modules.pop(name, None)


def seed_suite(tmp_path, monkeypatch, sabotage: str = ""):
    """The seed's generated TestSimpleModel, its model optionally sabotaged,
    with the real-GPU arm's "GPUs" being virtual devices."""
    build_to(EXAMPLES / "seed.yaml", tmp_path)
    model = tmp_path / "simple_model.py"
    line = '        layer1 = layer1.to("cuda:1")  # [batch, 20]\n'
    assert line in model.read_text()
    model.write_text(model.read_text().replace(line, line + sabotage))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = import_generated(tmp_path / "test_simple_model.py")

    @contextlib.contextmanager
    def gpus_on_this_cpu():
        with virtual_devices(cuda=2):
            yield

    monkeypatch.setattr(suite, "full_float32_on_gpu", gpus_on_this_cpu)
    return module.TestSimpleModel()


@pytest.mark.usefixtures("fresh_seed_modules")
def test_the_real_gpu_arm_passes_when_splitting_changes_nothing(tmp_path, monkeypatch):
    seed_suite(tmp_path, monkeypatch).compare_on_real_gpus()


# A transfer that loses data only when it really crosses GPUs: the split run
# differs from the merged one (where cuda:1 is cuda:0).
LOSSY = '        layer1 = layer1 if layer1.get_device() == 0 else layer1 * 0.5\n'


@pytest.mark.usefixtures("fresh_seed_modules")
def test_the_real_gpu_arm_fails_when_splitting_changes_the_outputs(tmp_path, monkeypatch):
    tests = seed_suite(tmp_path, monkeypatch, LOSSY)
    with pytest.raises(AssertionError, match="splitting the model changed its result"):
        tests.compare_on_real_gpus()
    with virtual_devices(cuda=2) as vd, pytest.raises(
        AssertionError, match="splitting the model changed its result"
    ):
        tests.test_outputs_equal_the_same_model_on_one_device(vd)
