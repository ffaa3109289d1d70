"""Tests for mpgen.testing.virtual_devices (virtual CUDA devices on the CPU)."""

from __future__ import annotations

import copy
import io
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mpgen.testing import Transfer, VirtualDeviceError, VirtualTensor, virtual_devices

MIXED_RE = r"^Expected all tensors to be on the same device, but found at least two devices, "


# --------------------------------------------------------------------------
# models used in several tests
# --------------------------------------------------------------------------
class SimpleModel(nn.Module):
    """The canonical two-GPU model mpgen generates."""

    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(10, 20).to("cuda:0")
        self.layer2 = nn.Linear(20, 10).to("cuda:1")

    def forward(self, x):
        x = x.to("cuda:0")
        layer1 = self.layer1(x)
        layer2 = self.layer2(layer1.to("cuda:1"))
        return layer2


class MissingToModel(SimpleModel):
    """Forgets to move layer1's output to cuda:1."""

    def forward(self, x):
        x = x.to("cuda:0")
        return self.layer2(self.layer1(x))


class WrongDeviceModel(nn.Module):
    """layer2 was built on cuda:0 but its input is moved to cuda:1."""

    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(10, 20).to("cuda:0")
        self.layer2 = nn.Linear(20, 10).to("cuda:0")  # bug: should be cuda:1

    def forward(self, x):
        x = x.to("cuda:0")
        layer1 = self.layer1(x)
        return self.layer2(layer1.to("cuda:1"))


class TwoStageMLP(nn.Module):
    """Same layers on one device (place=False) or split over cuda:0/cuda:1."""

    def __init__(self, place: bool):
        super().__init__()
        self.place = place
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        if place:
            self.fc1.to("cuda:0")
            self.fc2.cuda(1)

    def forward(self, x):
        if self.place:
            x = x.to("cuda:0")
        h = F.relu(self.fc1(x))
        if self.place:
            h = h.to("cuda:1")
        return self.fc2(h)


# --------------------------------------------------------------------------
# device reporting, factories, module moves
# --------------------------------------------------------------------------
def test_device_reporting_and_factories():
    with virtual_devices(cuda=4) as vd:
        specs = ["cuda:1", torch.device("cuda", 1), torch.device("cuda:1"), 1]
        for spec in specs:
            t = torch.zeros(2, 3, device=spec)
            assert t.device == torch.device("cuda:1")
            assert t.is_cuda and not t.is_cpu
            assert t.get_device() == 1
            assert vd.device_of(t) == "cuda:1"
        made = [
            torch.ones(3, device="cuda:3"),
            torch.empty(3, device="cuda:3"),
            torch.randn(3, device="cuda:3"),
            torch.rand(3, device="cuda:3"),
            torch.full((3,), 2.0, device="cuda:3"),
            torch.arange(3, device="cuda:3"),
            torch.eye(3, device="cuda:3"),
            torch.tensor([1.0, 2.0], device="cuda:3"),
            torch.randint(0, 5, (3,), device="cuda:3"),
        ]
        for t in made:
            assert t.device == torch.device("cuda:3"), t
        src = torch.ones(2, device="cuda:2")
        assert torch.zeros_like(src).device.index == 2
        assert src.new_zeros(4).device.index == 2
        assert torch.empty_like(src, device="cuda:0").device.index == 0
        assert nn.Linear(3, 3, device="cuda:3").weight.device == torch.device("cuda:3")
        # "cuda" means the current device
        torch.cuda.set_device(2)
        assert torch.zeros(1, device="cuda").device.index == 2
        torch.cuda.set_device(0)
        # plain factories stay ordinary CPU tensors
        c = torch.zeros(3)
        assert type(c) is torch.Tensor and c.device.type == "cpu"
        assert vd.device_of(c) == "cpu"
        # factories are not transfers
        assert vd.transfers == []
        with pytest.raises(VirtualDeviceError, match="invalid device ordinal"):
            torch.zeros(1, device="cuda:4")
        torch.cuda.set_device(2)
        assert torch.zeros(1).cuda().device.index == 2
        torch.cuda.set_device(0)


def test_tensor_to_forms():
    with virtual_devices(cuda=2) as vd:
        x = torch.randn(4, 3)
        a = x.to("cuda:0")
        assert a.device.index == 0 and torch.equal(a.cpu(), x)
        assert x.to(torch.device("cuda", 1)).device.index == 1
        assert x.to(1).device.index == 1
        assert x.cuda(1).device.index == 1
        assert x.cuda().device.index == 0
        assert x.to(device="cuda:1", dtype=torch.float64).dtype == torch.float64
        h = x.to("cuda:1", torch.float16, non_blocking=True)
        assert h.device.index == 1 and h.dtype == torch.float16
        assert x.to(a).device.index == 0  # to(other tensor)
        assert a.to(torch.float64).device.index == 0
        assert a.double().device.index == 0
        # same device: returns self and is not a transfer
        vd.reset_transfers()
        assert a.to("cuda:0") is a
        assert a.cuda(0) is a
        assert x.to("cpu") is x
        assert vd.transfers == []
        # copy=True on the same device copies but does not transfer
        c = a.to("cuda:0", copy=True)
        assert c is not a and c.device.index == 0 and vd.transfers == []
        back = a.cpu()
        assert type(back) is torch.Tensor and torch.equal(back, x)
        assert [t[:3] for t in vd.transfers] == [("cuda:0", "cpu", 48)]


def test_module_to_and_cuda_keep_parameters():
    with virtual_devices(cuda=2):
        m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        m[2].weight.requires_grad_(False)
        w0 = m[0].weight
        m.to("cuda:0")
        assert m[0].weight is w0  # identity kept (optimizers built before .to still work)
        for p in m.parameters():
            assert isinstance(p, nn.Parameter)
            assert p.device == torch.device("cuda:0") and p.is_leaf
        assert m[0].weight.requires_grad and not m[2].weight.requires_grad
        for b in m.buffers():
            assert b.device == torch.device("cuda:0")
        m.cuda(1)
        assert all(p.device.index == 1 for p in m.parameters())
        m.to(0)
        assert all(p.device.index == 0 for p in m.parameters())
        m.to(torch.device("cuda:1"), torch.float64)
        assert all(p.device.index == 1 and p.dtype == torch.float64 for p in m.parameters())
        assert m[1].num_batches_tracked.dtype == torch.int64
        m.cpu()
        assert m[0].weight is w0
        assert all(type(p) is nn.Parameter and p.device.type == "cpu" for p in m.parameters())


def test_data_assignment_and_in_place_shape_changes():
    with virtual_devices(cuda=2) as vd:
        m = nn.Linear(3, 3)
        w = m.weight
        for p in m.parameters():  # old-style move
            p.data = p.data.to("cuda:1")
        assert m.weight is w and isinstance(w, nn.Parameter) and w.requires_grad
        assert w.device == torch.device("cuda:1")
        m(torch.ones(2, 3, device="cuda:1")).sum().backward()
        assert w.grad.device == torch.device("cuda:1")
        t = torch.ones(2, 3, device="cuda:0")
        base = vd.current_bytes["cuda:0"]
        t.resize_(4, 5)
        assert t.shape == (4, 5) and vd.current_bytes["cuda:0"] == base + (20 - 6) * 4
        t.unsqueeze_(0)
        assert t.shape == (1, 4, 5) and t.stride() == (20, 5, 1)
        out = torch.empty(0, device="cuda:0")
        torch.mul(t, 2, out=out)
        assert out.shape == (1, 4, 5) and out.device.index == 0


# --------------------------------------------------------------------------
# device errors
# --------------------------------------------------------------------------
def test_mixed_device_error_message():
    with virtual_devices(cuda=2):
        a = torch.ones(3, device="cuda:0")
        b = torch.ones(3, device="cuda:1")
        with pytest.raises(VirtualDeviceError) as info:
            a + b
        msg = str(info.value)
        assert msg.startswith(
            "Expected all tensors to be on the same device, but found at least two "
            "devices, cuda:0 and cuda:1!"
        )
        assert "(when running aten::add)" in msg
        assert isinstance(info.value, RuntimeError)
        with pytest.raises(
            RuntimeError, match=MIXED_RE + r"cuda:0 and cuda:1! \(when running aten::cat\)"
        ):
            torch.cat([a, b])
        lin = nn.Linear(3, 3).to("cuda:1")
        with pytest.raises(
            VirtualDeviceError, match=MIXED_RE + r"cuda:0 and cuda:1! \(when running aten::addmm\)"
        ):
            lin(a.unsqueeze(0))


def test_missing_to_raises_device_error():
    with virtual_devices(cuda=2):
        model = MissingToModel()
        with pytest.raises(
            VirtualDeviceError, match=MIXED_RE + r"cuda:0 and cuda:1! \(when running aten::addmm\)"
        ):
            model(torch.randn(5, 10))


def test_missing_input_to_raises_device_error():
    with virtual_devices(cuda=2):
        lin = nn.Linear(10, 20).to("cuda:0")
        with pytest.raises(VirtualDeviceError, match=MIXED_RE + r"cuda:0 and cpu!"):
            lin(torch.randn(5, 10))


def test_wrong_device_layer_raises_device_error():
    with virtual_devices(cuda=2):
        model = WrongDeviceModel()
        with pytest.raises(
            VirtualDeviceError, match=MIXED_RE + r"cuda:0 and cuda:1! \(when running aten::addmm\)"
        ):
            model(torch.randn(5, 10))


def test_cpu_scalar_exception():
    with virtual_devices(cuda=2):
        a = torch.ones(3, device="cuda:0")
        s = torch.tensor(2.0)  # zero-dim CPU tensor: allowed, like on real CUDA
        out = a * s + torch.tensor(1.0)
        assert out.device.index == 0 and out.tolist() == [3.0, 3.0, 3.0]
        assert torch.where(a > 0, a, torch.tensor(0.0)).device.index == 0
        with pytest.raises(VirtualDeviceError, match=MIXED_RE + r"cuda:0 and cpu!"):
            a + torch.ones(3)
        with pytest.raises(VirtualDeviceError, match=MIXED_RE + r"cuda:0 and cpu!"):
            torch.ones(3) * a
        # a zero-dim *CUDA* tensor on another device is not exempt
        with pytest.raises(VirtualDeviceError, match=MIXED_RE + r"cuda:0 and cuda:1!"):
            a + torch.tensor(1.0, device="cuda:1")
        # CPU index tensors may index a CUDA tensor (as on real CUDA)
        assert a[torch.tensor([0, 2])].device.index == 0


def test_copy_across_devices_is_a_transfer():
    with virtual_devices(cuda=2) as vd:
        dst = torch.zeros(4, device="cuda:0")
        src = torch.arange(4.0, device="cuda:1")
        vd.reset_transfers()
        dst.copy_(src)
        assert dst.device.index == 0 and dst.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert [t[:3] for t in vd.transfers] == [("cuda:1", "cuda:0", 16)]
        host = torch.empty(4)
        host.copy_(dst)
        assert host.tolist() == [0.0, 1.0, 2.0, 3.0]
        dst.copy_(torch.ones(4))
        assert [t[:2] for t in vd.transfers] == [
            ("cuda:1", "cuda:0"),
            ("cuda:0", "cpu"),
            ("cpu", "cuda:0"),
        ]
        # gradients flow back through a cross-device copy_
        w = torch.ones(4, device="cuda:1", requires_grad=True)
        buf = torch.zeros(4, device="cuda:0")
        buf.copy_(w * 2)
        buf.sum().backward()
        assert w.grad.device.index == 1 and w.grad.tolist() == [2.0] * 4


def test_merge_runs_the_same_code_on_one_device():
    torch.manual_seed(0)
    x = torch.randn(5, 10)
    with virtual_devices(cuda=2) as vd, torch.no_grad():
        torch.manual_seed(0)
        out = SimpleModel()(x).cpu()
    with virtual_devices(cuda=2, merge=True) as merged, torch.no_grad():
        torch.manual_seed(0)
        model = SimpleModel()
        assert merged.merged and torch.cuda.device_count() == 2
        assert {p.device for p in model.parameters()} == {torch.device("cuda:0")}
        merged.reset_transfers()
        ref = model(x)
        assert ref.device == torch.device("cuda:0")
        # only the input is moved; "cuda:0 -> cuda:1" is now a no-op
        assert [t[:2] for t in merged.transfers] == [("cpu", "cuda:0")]
        with pytest.raises(VirtualDeviceError, match="invalid device ordinal"):
            torch.zeros(1, device="cuda:2")
        ref = ref.cpu()
    assert not vd.merged
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------
# transfers
# --------------------------------------------------------------------------
def test_simple_model_transfers():
    with virtual_devices(cuda=2) as vd:
        model = SimpleModel()
        x = torch.randn(5, 10)
        with vd.record() as fwd:
            out = model(x)
        assert out.device == torch.device("cuda:1")
        assert fwd.transfers == [
            Transfer("cpu", "cuda:0", 200, (5, 10), torch.float32, "forward"),
            Transfer("cuda:0", "cuda:1", 400, (5, 20), torch.float32, "forward"),
        ]
        with vd.record() as bwd:
            out.sum().backward()
        # the gradient of layer1's output flows back from cuda:1 to cuda:0;
        # x does not require grad, so nothing goes back to the CPU.
        assert bwd.transfers == [
            Transfer("cuda:1", "cuda:0", 400, (5, 20), torch.float32, "backward")
        ]
        assert model.layer1.weight.grad.device == torch.device("cuda:0")
        assert model.layer2.weight.grad.device == torch.device("cuda:1")
        # vd.transfers keeps everything (module moves included), in order
        assert vd.transfers[-3:] == fwd.transfers + bwd.transfers
        assert [t.phase for t in vd.transfers[-3:]] == ["forward", "forward", "backward"]
        vd.reset_transfers()
        assert vd.transfers == []


def test_backward_through_transfer_to_cpu_leaf():
    with virtual_devices(cuda=2) as vd:
        x = torch.randn(3, 4, requires_grad=True)
        y = (x.to("cuda:0") * 2).to("cuda:1").sum()
        y.backward()
        assert type(x.grad) is torch.Tensor and x.grad.device.type == "cpu"
        assert torch.equal(x.grad, torch.full((3, 4), 2.0))
        back = [t[:3] for t in vd.transfers if t.phase == "backward"]
        assert back == [("cuda:1", "cuda:0", 48), ("cuda:0", "cpu", 48)]


# --------------------------------------------------------------------------
# training: bit-identical to a plain CPU run
# --------------------------------------------------------------------------
OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_momentum_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}


def _train(place: bool, make_opt, steps: int = 3):
    torch.manual_seed(0)
    model = TwoStageMLP(place)
    opt = make_opt(model.parameters())
    torch.manual_seed(1)
    x = torch.randn(16, 8)
    y = torch.randn(16, 4)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        out = model(x)
        loss = F.mse_loss(out, y.to(out.device))
        loss.backward()
        opt.step()
        losses.append(loss.detach().cpu())
    return model, opt, losses


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_training_step_bit_identical_to_cpu(opt_name):
    make_opt = OPTIMIZERS[opt_name]
    ref_model, _, ref_losses = _train(False, make_opt)
    with virtual_devices(cuda=2):
        model, opt, losses = _train(True, make_opt)
        devices = {n: p.device for n, p in model.named_parameters()}
        grad_devices = {n: p.grad.device for n, p in model.named_parameters()}
        state_devices = {
            k: v.device
            for p in model.parameters()
            for k, v in opt.state[p].items()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        }
        got = {n: p.detach().cpu() for n, p in model.named_parameters()}
    expected_dev = {
        "fc1.weight": torch.device("cuda:0"),
        "fc1.bias": torch.device("cuda:0"),
        "fc2.weight": torch.device("cuda:1"),
        "fc2.bias": torch.device("cuda:1"),
    }
    assert devices == expected_dev
    assert grad_devices == expected_dev
    assert set(state_devices.values()) <= {torch.device("cuda:0"), torch.device("cuda:1")}
    for n, p in ref_model.named_parameters():
        assert torch.equal(got[n], p.detach()), n  # bit for bit
    for a, b in zip(losses, ref_losses):
        assert torch.equal(a, b)


def test_no_grad_eval_dropout_batchnorm_match_cpu():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.3))

    x = torch.randn(2, 3, 8, 8)
    ref = build()
    torch.manual_seed(5)
    ref_train = ref(x)
    ref.eval()
    with torch.no_grad():
        ref_eval = ref(x)
    with virtual_devices(cuda=2):
        m = build().to("cuda:1")
        torch.manual_seed(5)
        out_train = m(x.to("cuda:1"))
        m.eval()
        with torch.no_grad():
            out_eval = m(x.cuda(1))
        assert out_eval.device.index == 1 and not out_eval.requires_grad
        assert m[1].running_mean.device.index == 1
        got_train, got_eval = out_train.detach().cpu(), out_eval.cpu()
    assert torch.equal(got_train, ref_train.detach())
    assert torch.equal(got_eval, ref_eval)


def test_state_dict_round_trip():
    torch.manual_seed(0)
    cpu_model = TwoStageMLP(False)
    with torch.no_grad():
        for p in cpu_model.parameters():
            p.mul_(3)
    with virtual_devices(cuda=2) as vd:
        model = TwoStageMLP(True)
        sd = model.state_dict()
        assert sd["fc1.weight"].device.index == 0 and sd["fc2.weight"].device.index == 1
        vd.reset_transfers()
        model.load_state_dict(cpu_model.state_dict())  # CPU tensors copied into cuda params
        assert {(t.src, t.dst) for t in vd.transfers} == {("cpu", "cuda:0"), ("cpu", "cuda:1")}
        assert len(vd.transfers) == 4
        assert model.fc1.weight.device.index == 0 and model.fc2.bias.device.index == 1
        assert isinstance(model.fc1.weight, nn.Parameter)
        # virtual -> CPU model, and torch.save stores CPU tensors
        back = TwoStageMLP(False)
        back.load_state_dict(model.state_dict())
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        buf.seek(0)
        loaded = torch.load(buf)
        clone = copy.deepcopy(model)
        assert clone.fc2.weight.device.index == 1 and isinstance(clone.fc2.weight, nn.Parameter)
    for n, p in cpu_model.state_dict().items():
        assert torch.equal(back.state_dict()[n], p)
        assert type(loaded[n]) is torch.Tensor and torch.equal(loaded[n], p)


# --------------------------------------------------------------------------
# memory accounting
# --------------------------------------------------------------------------
def test_memory_current_bytes_views_and_free():
    with virtual_devices(cuda=2) as vd:
        base = vd.current_bytes["cuda:0"]
        a = torch.zeros(256, device="cuda:0")  # 1024 bytes
        assert vd.current_bytes["cuda:0"] == base + 1024
        views = [a[:10], a.view(16, 16), a.view(16, 16).t(), a.detach()]
        assert vd.current_bytes["cuda:0"] == base + 1024  # views share the storage
        del a
        assert vd.current_bytes["cuda:0"] == base + 1024  # still alive through the views
        del views
        assert vd.current_bytes["cuda:0"] == base
        assert vd.peak_bytes["cuda:0"] >= base + 1024
        assert vd.current_bytes["cuda:1"] == 0
        assert torch.cuda.memory_allocated(0) == base
        vd.reset_peak()
        assert vd.peak_bytes == vd.current_bytes
        b = torch.ones(10, 10, device="cuda:1", dtype=torch.float64)
        assert vd.peak_bytes["cuda:1"] == 800 and torch.cuda.max_memory_allocated(1) == 800
        del b


class _PeakMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(256, 512).to("cuda:0")
        self.fc2 = nn.Linear(512, 256).to("cuda:1")

    def forward(self, x):
        h = torch.relu(self.fc1(x.to("cuda:0")))
        return self.fc2(h.to("cuda:1"))


def _measure_second_step_peak(**adam_kwargs):
    with virtual_devices(cuda=2) as vd:
        torch.manual_seed(0)
        net = _PeakMLP()
        opt = torch.optim.Adam(net.parameters(), lr=1e-3, **adam_kwargs)
        x = torch.randn(64, 256)
        y = torch.randn(64, 256)

        def step():
            opt.zero_grad()  # set_to_none: no grads while the forward runs
            loss = F.mse_loss(net(x), y.to("cuda:1"))
            loss.backward()
            opt.step()

        step()  # creates the optimizer state
        vd.reset_peak()
        step()
        return vd.peak_bytes


# Hand computation, float32 = 4 bytes, batch B = 64.
F32 = 4
B = 64
W1, b1 = 512 * 256 * F32, 512 * F32  # fc1 on cuda:0
W2, b2 = 256 * 512 * F32, 256 * F32  # fc2 on cuda:1
P0, P1 = W1 + b1, W2 + b2  # parameter bytes per device
X0 = B * 256 * F32  # x moved to cuda:0 (saved by fc1's addmm for dW1)
H = B * 512 * F32  # relu output on cuda:0 (saved by ReluBackward) / its copy on cuda:1
OUT = B * 256 * F32  # fc2 output, the target y on cuda:1, and grad wrt fc2 output
# ATen's mse_loss reduces in place: the 0-dim loss keeps its B x 256 buffer alive.
LOSS = B * 256 * F32


def test_memory_peak_mlp_adam_fused_within_10_percent():
    """Fused Adam has no temporaries, so the peak of step 2 is in backward,
    where parameters, optimizer state, saved activations and new gradients
    are alive together (grads of step 1 were set to None by zero_grad).

    cuda:0 -- peak while fc1's AddmmBackward runs (ReluBackward has already
    released the saved relu output and its incoming gradient):
        params + exp_avg + exp_avg_sq (3*P0) + two 4-byte step counters
        + saved x0 (X0) + grad wrt fc1's output (H) + new dW1 + db1
    cuda:1 -- peak while fc2's AddmmBackward runs (MseLossBackward has
    already released the saved fc2 output and target):
        3*P1 + two step counters + saved copy of the relu output (H)
        + the loss and its buffer (LOSS) + grad of the loss (4 bytes)
        + grad wrt fc2's output (OUT) + new db2 + grad wrt fc2's input (H)
        + new dW2
    """
    peak = _measure_second_step_peak(fused=True)
    steps = 2 * F32  # fused Adam keeps its 0-dim step counters on the device
    expected0 = 3 * P0 + steps + X0 + H + W1 + b1
    expected1 = 3 * P1 + steps + H + LOSS + F32 + OUT + b2 + H + W2
    assert abs(peak["cuda:0"] - expected0) <= 0.10 * expected0, (peak, expected0)
    assert abs(peak["cuda:1"] - expected1) <= 0.10 * expected1, (peak, expected1)
    # and it is clearly more than params + grads + optimizer state alone
    assert peak["cuda:0"] > 4 * P0 and peak["cuda:1"] > 4 * P1


def test_memory_peak_mlp_adam_single_tensor_within_10_percent():
    """Single-tensor Adam (``foreach=False``, the CPU's default): the peak is
    inside opt.step() while the weight matrix is updated: params + grads +
    exp_avg + exp_avg_sq (4*P) plus two weight-sized temporaries of
    ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt)`` (the sqrt result
    is still alive while the division allocates).  Activations are already
    freed by backward; on cuda:1 the loss (with its buffer) is still referenced.
    """
    peak = _measure_second_step_peak(foreach=False)
    expected0 = 4 * P0 + 2 * W1
    expected1 = 4 * P1 + 2 * W2 + LOSS
    assert abs(peak["cuda:0"] - expected0) <= 0.10 * expected0, (peak, expected0)
    assert abs(peak["cuda:1"] - expected1) <= 0.10 * expected1, (peak, expected1)


def test_memory_peak_mlp_adam_default_is_a_gpus_foreach():
    """Adam's default on virtual devices is a GPU's, the foreach kernels: the
    step holds params + grads + exp_avg + exp_avg_sq (4*P) and the square
    roots of every exp_avg_sq at once (P), where the CPU's loop holds one
    weight's temporaries at a time."""
    peak = _measure_second_step_peak()
    expected0 = 5 * P0
    expected1 = 5 * P1 + LOSS
    assert abs(peak["cuda:0"] - expected0) <= 0.10 * expected0, (peak, expected0)
    assert abs(peak["cuda:1"] - expected1) <= 0.10 * expected1, (peak, expected1)


def test_record_window_peak():
    with virtual_devices(cuda=2) as vd:
        keep = torch.zeros(100, device="cuda:0")  # 400 bytes live before the window
        with vd.record() as rec:
            tmp = torch.zeros(1000, device="cuda:0")
            del tmp
            moved = keep.to("cuda:1")
        assert rec.peak_bytes == {"cuda:0": 4400, "cuda:1": 400}
        assert [t[:3] for t in rec.transfers] == [("cuda:0", "cuda:1", 400)]
        assert rec.forward_transfers == rec.transfers and rec.backward_transfers == []
        del moved


# --------------------------------------------------------------------------
# torch.cuda emulation and restoration
# --------------------------------------------------------------------------
def test_cuda_api_inside_context():
    with virtual_devices(cuda=3) as vd:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 3
        assert vd.num_devices == 3 and vd.devices == ["cuda:0", "cuda:1", "cuda:2"]
        assert torch.cuda.current_device() == 0
        with torch.cuda.device(2):
            assert torch.cuda.current_device() == 2
            assert torch.zeros(1, device="cuda").device.index == 2
        assert torch.cuda.current_device() == 0
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            t = torch.ones(2, device="cuda:1")
        torch.cuda.current_stream().wait_stream(s)
        t.record_stream(s)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        ev.synchronize()
        assert torch.cuda.memory_allocated(1) == vd.current_bytes["cuda:1"] == 8


def test_restoration_after_exit():
    assert not torch.cuda.is_available()
    parse_to = torch._C._nn._parse_to
    with virtual_devices(cuda=2):
        out = SimpleModel()(torch.randn(5, 10))
    assert not torch.cuda.is_available()
    assert torch.cuda.device_count() == 0
    assert torch._C._nn._parse_to is parse_to
    assert torch._C._len_torch_function_stack() == 0
    assert not torch.utils._python_dispatch._get_current_dispatch_mode_stack()
    plain = torch.ones(3) * 2
    assert type(plain) is torch.Tensor and plain.device.type == "cpu"
    # tensors created inside still report their device; .cpu() gives a plain tensor
    assert out.device == torch.device("cuda:1")
    assert type(out.cpu()) is torch.Tensor and out.cpu().shape == (5, 10)
    with pytest.raises(VirtualDeviceError):
        out.to("cuda:0")
    # an exception inside the context restores everything as well
    with pytest.raises(ZeroDivisionError):
        with virtual_devices(cuda=2):
            1 / 0
    assert not torch.cuda.is_available()
    assert torch._C._len_torch_function_stack() == 0
    with virtual_devices(cuda=1):
        with pytest.raises(VirtualDeviceError, match="nested"):
            with virtual_devices(cuda=1):
                pass


def test_a_context_entered_again_runs_its_tensors_again():
    # ModelSuite keeps a model built in one context for all of a class's tests
    vd = virtual_devices(cuda=2)
    with vd:
        model = SimpleModel()
    assert not vd.active and not torch.cuda.is_available()
    moves = list(vd.transfers)  # the layers' moves onto their devices
    with vd as again:
        assert again is vd and vd.active and torch.cuda.device_count() == 2
        with vd.record() as rec:
            out = model(torch.randn(5, 10))
        assert out.device == torch.device("cuda:1")
        assert [t[:3] for t in rec.transfers] == [("cpu", "cuda:0", 200),
                                                  ("cuda:0", "cuda:1", 400)]
        assert vd.transfers == moves + rec.transfers  # the handle's carry on
        with pytest.raises(VirtualDeviceError, match=MIXED_RE + "cuda:0 and cuda:1"):
            MissingToModel.forward(model, torch.randn(5, 10))
        with pytest.raises(VirtualDeviceError, match="nested"):
            vd.__enter__()
    assert not vd.active and not torch.cuda.is_available()
    assert torch._C._len_torch_function_stack() == 0


# --------------------------------------------------------------------------
# common layers do not raise false device errors
# --------------------------------------------------------------------------
def _mha():
    m = nn.MultiheadAttention(16, 4, batch_first=True).to("cuda:1")
    x = torch.randn(2, 5, 16, device="cuda:1")
    out, _ = m(x, x, x)
    out.sum().backward()
    return out, m.in_proj_weight.grad


def _lstm():
    m = nn.LSTM(8, 16, 2, batch_first=True).to("cuda:1")
    out, (h, _) = m(torch.randn(3, 4, 8).cuda(1))
    out.sum().backward()
    return out, h


def _embedding_ce():
    emb = nn.Embedding(10, 6).to("cuda:1")
    logits = emb(torch.tensor([[1, 2], [3, 4]]).to("cuda:1")).sum(1)
    loss = F.cross_entropy(logits, torch.tensor([0, 5], device="cuda:1"), label_smoothing=0.1)
    loss.backward()
    return loss, emb.weight.grad


def _partial_split():
    w = torch.randn(6, 4, device="cuda:1", requires_grad=True)
    first, _ = w.split(3)  # unused chunk: autograd materialises zeros internally
    u = w.unbind(0)[2]
    (first.sum() + u.sum()).backward()
    return w.grad, F.one_hot(torch.tensor([0, 2], device="cuda:1"), 3)


def _checkpoint():
    lin = nn.Linear(8, 8).to("cuda:1")
    x = torch.randn(4, 8, device="cuda:1", requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(lambda t: F.gelu(lin(t)), x, use_reentrant=False)
    out.sum().backward()
    return out, x.grad


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("case", [_mha, _lstm, _embedding_ce, _partial_split, _checkpoint])
def test_common_layers_run_on_virtual_device(case):
    with virtual_devices(cuda=2):
        for t in case():
            assert t.device == torch.device("cuda:1"), case.__name__


# --------------------------------------------------------------------------
# speed: ResNet-18 forward/backward at batch 2, 64x64
# --------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        out = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(out)) + idt)


class _ResNet18(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks, cin = [], 64
        for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            blocks += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# Slow: a timing of ResNet-18 on virtual devices against plain tensors
@pytest.mark.slow
def test_resnet18_overhead_is_small():
    """ResNet-18 forward+backward, batch 2, 64x64: at most a few times plain CPU.

    Timed with one intra-op thread and per-thread CPU time (best of 3,
    interleaved), so that other processes on a busy CI machine do not make the
    comparison flaky.
    """
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    plain = _ResNet18()
    vd = virtual_devices(cuda=2)
    with vd:
        virt = _ResNet18().to("cuda:0")

    def run_plain():
        t0 = time.thread_time()
        plain(x).sum().backward()
        return time.thread_time() - t0

    def run_virtual():
        with vd:
            t0 = time.thread_time()
            virt(x.to("cuda:0")).sum().backward()
            return time.thread_time() - t0

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_plain(), run_virtual()  # warm up
        tp, tv = [], []
        for _ in range(3):
            tp.append(run_plain())
            tv.append(run_virtual())
    finally:
        torch.set_num_threads(threads)
    ratio = min(tv) / min(tp)
    assert (
        ratio < 4.0
    ), f"virtual devices too slow: {ratio:.2f}x plain CPU ({min(tv):.3f}s vs {min(tp):.3f}s)"
    with vd:
        assert virt.fc.weight.grad.device == torch.device("cuda:0")
    assert isinstance(virt.fc.weight, VirtualTensor)
