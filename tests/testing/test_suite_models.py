"""ModelSuite builds each model once per test class and mode, and hands every
test that model exactly as a fresh build has it.

The suites below run under pytest, in this process (run_pytest), on a small
model with a BatchNorm, a frozen layer, a non-persistent buffer and a layer
built in eval mode: once split over cuda:0 and cuda:1 (its real-GPU arm
skips on a machine without them; the virtual arm runs) and once on the CPU
(both arms run here).  A test that trains the model, and changes everything
else a test can change in place, is followed by one that checks, bit for
bit, that its build() is the same model object in the state of a fresh
build.
"""

from __future__ import annotations

import textwrap

import pytest

from run_generated import run_pytest

MODEL = textwrap.dedent('''
    import weakref

    import torch
    from torch import nn

    #: The class name of every model built, in order, and a weak reference.
    BUILDS = []
    MODELS = []


    class Net(nn.Module):
        devices = ("cuda:0", "cuda:1")

        def __init__(self):
            super().__init__()
            BUILDS.append(type(self).__name__)
            MODELS.append(weakref.ref(self))
            first, second = self.devices
            self.fc1 = nn.Linear(6, 8).to(first)
            self.bn = nn.BatchNorm1d(8).to(first)
            self.frozen = nn.Linear(8, 8).to(second)
            self.frozen.weight.requires_grad_(False)
            self.drop = nn.Dropout(0.5).eval()  # a module built in eval mode
            self.fc2 = nn.Linear(8, 3).to(second)
            self.register_buffer("scale", torch.full((3,), 2.0).to(second), persistent=False)

        def forward(self, x):
            first, second = self.devices
            h = self.bn(self.fc1(x.to(first))).relu().to(second)
            return self.fc2(self.drop(self.frozen(h))) * self.scale


    class CpuNet(Net):
        devices = ("cpu", "cpu")


    class CountedNet(Net):
        pass


    class CountedCpuNet(CpuNet):
        pass
''')

SUITES = textwrap.dedent('''
    import gc
    import weakref

    import torch
    from torch import nn

    from net import BUILDS, MODELS, CountedCpuNet, CountedNet, CpuNet, Net
    from mpgen.testing import ModelSuite

    LAYERS = ("fc1", "bn", "frozen", "fc2", "scale")


    class Facts(ModelSuite):
        total_params = 6 * 8 + 8 + 2 * 8 + 8 * 8 + 8 + 8 * 3 + 3
        output_shapes = [(4, 3)]

        def make_inputs(self):
            torch.manual_seed(1)
            return (torch.randn(4, 6),)

        def make_optimizer(self, model):
            return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


    class OnTwoGpus(Facts):
        devices = ("cuda:0", "cuda:1")
        placement = {"fc1": "cuda:0", "bn": "cuda:0", "frozen": "cuda:1", "fc2": "cuda:1",
                     "scale": "cuda:1"}
        transfers = [("x", "cpu", "cuda:0", 4 * 6 * 4), ("bn", "cuda:0", "cuda:1", 4 * 8 * 4)]


    class OnTheCpu(Facts):
        devices = ("cpu",)
        placement = {layer: "cpu" for layer in LAYERS}
        transfers = []


    def state(model):
        """Every parameter and buffer, by name, as bits; and the state_dict's names."""
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        return {name: (t.dtype, tuple(t.shape), str(t.device), t.requires_grad,
                       t.detach().cpu().view(torch.int32 if t.is_floating_point() else t.dtype))
                for name, t in tensors.items()}, list(model.state_dict())


    def assert_as_built(model, fresh):
        (got, got_keys), (want, want_keys) = state(model), state(fresh)
        assert got_keys == want_keys
        assert got.keys() == want.keys()
        for name in want:
            *got_facts, got_bits = got[name]
            *want_facts, want_bits = want[name]
            assert got_facts == want_facts, name
            assert torch.equal(got_bits, want_bits), f"{name} differs from a fresh build"
        assert all(p.grad is None for p in model.parameters())
        assert [m.training for m in model.modules()] == [m.training for m in fresh.modules()]


    #: (class, arm) -> the model a test changed, for the next test to compare.
    CHANGED = weakref.WeakValueDictionary()


    class RestoreChecks:
        """Run after the inherited checks (pytest collects base classes' tests first)."""

        def test_1_a_test_changes_the_model_in_every_way_it_can_in_place(self, virtual):
            model = self.build()
            CHANGED[type(self), virtual is None] = model
            optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
            model.train()
            model(*self.make_inputs()).sum().backward()
            optimizer.step()  # weights, and the BatchNorm's statistics in forward
            assert int(model.bn.num_batches_tracked) == 1
            model.frozen.weight.requires_grad_(True)
            model.bn.eval()
            with torch.no_grad():
                model.scale.mul_(3)  # a buffer outside the state dict
            model.fc1.weight.data.add_(1)  # a change autograd does not see
            torch.rand(3)  # the random numbers move on

        def test_2_the_next_test_gets_the_same_model_as_a_fresh_build(self, virtual):
            model = self.build()
            assert model is CHANGED[type(self), virtual is None]
            random_state = torch.get_rng_state()
            torch.manual_seed(0)
            fresh = self.model()
            assert torch.equal(torch.get_rng_state(), random_state)
            assert_as_built(model, fresh)

        def test_3_a_test_replaces_a_layer(self, virtual):
            model = self.build()
            CHANGED[type(self), virtual is None] = model
            model.fc2 = nn.Linear(8, 3).to(self.devices[-1])

        def test_4_the_next_test_gets_a_fresh_build(self, virtual):
            model = self.build()
            assert model is not CHANGED.get((type(self), virtual is None))
            torch.manual_seed(0)
            assert_as_built(model, self.model())


    class TestRestoredOnTwoGpus(RestoreChecks, OnTwoGpus):
        model = Net


    class TestRestoredOnTheCpu(RestoreChecks, OnTheCpu):
        model = CpuNet


    class TestBuiltOncePerModeOnTwoGpus(OnTwoGpus):
        model = CountedNet

        def test_each_mode_built_once(self):
            # Kept: the split builds on the real devices (where the GPUs are
            # there) and on the virtual devices. Built fresh, once each by
            # the output check: the merged references (virtual devices
            # merged; where the GPUs are there, merged onto cuda:0, and the
            # CPU's).
            builds = 2 if self.missing_gpus() else 5
            assert BUILDS.count("CountedNet") == builds


    class TestBuiltOncePerModeOnTheCpu(OnTheCpu):
        model = CountedCpuNet

        def test_each_mode_built_once(self):
            assert BUILDS.count("CountedCpuNet") == 5

        def test_the_models_of_the_classes_before_are_freed(self):
            gc.collect()
            alive = [type(m).__name__ for m in (ref() for ref in MODELS) if m is not None]
            assert set(alive) <= {"CountedCpuNet"}
''')


@pytest.fixture
def suites(tmp_path):
    (tmp_path / "net.py").write_text(MODEL)
    (tmp_path / "test_suites.py").write_text(SUITES)
    return tmp_path / "test_suites.py"


@pytest.mark.slow  # 5 s: too long for the quick loop
def test_each_test_gets_the_model_as_built_and_each_mode_is_built_once(suites):
    run = run_pytest(suites)
    assert run.exit_code == 0, run.text[-3000:]
    assert run.failed == []
    passed = {id.split("::", 1)[1] for id in run.passed}
    for arm in ("virtual", "real"):
        for check in ("1_a_test_changes_the_model_in_every_way_it_can_in_place",
                      "2_the_next_test_gets_the_same_model_as_a_fresh_build",
                      "3_a_test_replaces_a_layer", "4_the_next_test_gets_a_fresh_build"):
            assert f"TestRestoredOnTheCpu::test_{check}[{arm}]" in passed
            if arm == "virtual":
                assert f"TestRestoredOnTwoGpus::test_{check}[{arm}]" in passed
    assert {"TestBuiltOncePerModeOnTwoGpus::test_each_mode_built_once",
            "TestBuiltOncePerModeOnTheCpu::test_each_mode_built_once",
            "TestBuiltOncePerModeOnTheCpu::test_the_models_of_the_classes_before_are_freed",
            } <= passed
    # the inherited checks, both arms on the CPU, the virtual arm on two GPUs
    assert sum(id.startswith("TestBuiltOncePerModeOnTheCpu") for id in passed) == 2 + 9
    assert sum(id.startswith("TestBuiltOncePerModeOnTwoGpus") for id in passed) >= 1 + 5
