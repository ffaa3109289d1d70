"""mpgen.testing.memory: per-device peak memory of a training step, measured."""

import pytest
import torch
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from mpgen.testing import (
    MemoryTracker,
    measure_forward,
    measure_training_step,
    virtual_devices,
)
from mpgen.testing.memory import MEMORY_PARTS


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(256, 10))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 10))


OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def _step(model, optimizer, x, y):
    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    return step


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("make, shape", [(_cnn, (8, 3, 16, 16)), (_mlp, (32, 64))])
def test_the_cpu_peak_equals_torchs_mem_tracker(make, shape, optimizer):
    torch.manual_seed(0)
    model = make()
    opt = OPTIMIZERS[optimizer](model.parameters())
    x, y = torch.randn(shape), torch.randint(0, 10, (shape[0],))
    step = _step(model, opt, x, y)
    ours = measure_training_step(step, model, opt, extra=(x, y))["cpu"]
    assert opt.param_groups[0].get("foreach", None) is None  # the CPU's default, untouched
    opt.zero_grad(set_to_none=True)
    theirs = MemTracker()
    theirs.track_external(model, opt, x, y)
    with theirs:
        step()
    snapshot = theirs.get_tracker_snapshot("peak")[torch.device("cpu")]
    assert ours.peak == snapshot["Total"]
    assert sum(ours.at_peak.values()) == ours.peak
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert ours.at_peak["weights"] == params + buffers
    # The optimizer's state, kept between steps: Adam's two moments, SGD's momentum.
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    if ours.phase == "optimizer step":
        assert ours.at_peak["gradients"] == params
        assert ours.at_peak["optimizer"] == state
    # Each part at its largest in the step: every gradient alive after backward.
    assert ours.largest["gradients"] == params and ours.largest["optimizer"] == state
    assert ours.largest["weights"] == params + buffers
    assert ours.peak <= sum(ours.largest.values())


def test_activations_are_what_autograd_saves_until_backward_frees_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 4096), nn.ReLU(), nn.Linear(4096, 8))
    x = torch.randn(64, 128)
    tracker = MemoryTracker()
    tracker.track(model, x)
    with tracker:
        out = model(x)
        saved = tracker.current_parts["cpu"]["activations"]
        out.sum().backward()
        after = tracker.current_parts["cpu"]["activations"]
    # Forward saved x (64x128) and ReLU's output (64x4096, float32; the
    # second Linear's input too); the first Linear's output died (ReLU
    # saves its result), the weights saved count as weights.
    assert saved == 4 * (64 * 128 + 64 * 4096)
    assert after == 0
    assert tracker.peaks["cpu"].phase in ("forward", "backward")


def test_per_device_peaks_on_virtual_devices():
    class TwoDevices(nn.Module):
        def __init__(self):
            super().__init__()
            self.big = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512)).to("cuda:0")
            self.small = nn.Linear(512, 10).to("cuda:1")

        def forward(self, x):
            return self.small(self.big(x.to("cuda:0")).to("cuda:1"))

    with virtual_devices(cuda=2) as vd:
        torch.manual_seed(0)
        model = TwoDevices()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))

        def step():
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y.to("cuda:1")).backward()
            opt.step()

        step()
        vd.reset_peak()
        peaks = measure_training_step(step, model, opt, extra=(x, y))
        expected = vd.peak_bytes  # the virtual devices' own count of the same storages
        # Adam's default resolves as on CUDA: the foreach kernels (the CPU's: a loop).
        assert _default_to_fused_or_foreach(list(model.parameters()), False) == (False, True)
    assert _default_to_fused_or_foreach([torch.zeros(1)], False) == (False, False)
    assert [d for d in peaks if d != "cpu"] == ["cuda:0", "cuda:1"]
    assert {d: peaks[d].peak for d in ("cuda:0", "cuda:1")} == expected
    # cuda:0 holds ~50x the weights of cuda:1, and with Adam the weights,
    # gradients and moments dominate.
    assert peaks["cuda:0"].peak > 10 * peaks["cuda:1"].peak
    weights = {d: sum(p.numel() * 4 for n, p in model.named_parameters()
                      if str(p.device) == d) for d in ("cuda:0", "cuda:1")}
    for device, peak in peaks.items():
        assert set(peak.at_peak) == set(MEMORY_PARTS)
        assert sum(peak.at_peak.values()) == peak.peak
        if device != "cpu":
            assert peak.at_peak["weights"] == weights[device]
    # The copy onto cuda:1 is saved by its Linear: an activation there, not a transfer.
    assert peaks["cuda:1"].phase in ("forward", "backward", "optimizer step")


def test_a_copy_between_devices_counts_as_a_transfer():
    with virtual_devices(cuda=2):
        x = torch.randn(1000, device="cuda:0", requires_grad=True)
        tracker = MemoryTracker()
        tracker.track(x)
        with tracker:
            y = x.to("cuda:1")
            z = (y * 2).sum()  # saves no y: y stays a transfer
            moved = tracker.current_parts["cuda:1"]["transfers"]
            z.backward()
        del y, z
    assert moved == 4000
    assert tracker.peaks["cuda:1"].peak >= 4000
    assert tracker.peaks["cuda:0"].at_peak["transient"] >= 4000  # x, then its gradient


def test_a_forward_without_gradients_holds_no_activations():
    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(32, 64)
    peak = measure_forward(lambda: model(x), model, extra=(x,))["cpu"]
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert peak.at_peak["activations"] == 0 and peak.at_peak["gradients"] == 0
    assert peak.at_peak["weights"] == weights
    # At most two 32x256 float32 tensors alive beside the weights and the input.
    assert weights + 32 * 64 * 4 < peak.peak <= weights + 32 * 64 * 4 + 2 * 32 * 256 * 4


def test_a_tracker_is_entered_once():
    tracker = MemoryTracker()
    with tracker:
        pass
    with pytest.raises(RuntimeError, match="entered once"):
        with tracker:
            pass
