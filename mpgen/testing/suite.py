"""The checks behind every generated ``test_<name>.py``.

A generated test file states what mpgen planned for one model -- its
devices, where each layer lives, the output shapes, the transfers in
forward, the parameter count, how to make inputs and the optimizer -- in a
subclass of :class:`ModelSuite`; pytest collects the test methods it
inherits.  A hand-written test can do the same::

    class TestSimpleModel(ModelSuite):
        model = SimpleModel
        devices = ("cuda:0", "cuda:1")
        placement = {"layer1": "cuda:0", "layer2": "cuda:1"}
        total_params = 430
        output_shapes = [(2, 10)]
        transfers = [("x", "cpu", "cuda:0", 80), ("layer1", "cuda:0", "cuda:1", 160)]

        def make_inputs(self):
            torch.manual_seed(1)
            return (torch.randn(2, 10),)

        def make_optimizer(self, model):
            return torch.optim.SGD(model.parameters(), lr=0.01)

Every check runs twice, through the ``virtual`` fixture: on the real GPUs
when the machine has them (skipped, with the reason, when it does not), and
on virtual devices (:func:`~mpgen.testing.virtual_devices`), which run the
same code on the CPU while tracking the device every tensor would live on.

While the tests of one class run, the model is built once per mode (the
real devices, the class's virtual devices) and each test's
:meth:`ModelSuite.build` gets it back exactly as built: weights, buffers,
gradients, ``requires_grad``, training flags and random number generators
put back in place (:mod:`mpgen.testing._models` says what that covers and
what it assumes).  Needs pytest.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator, Optional

import pytest
import torch

from mpgen.testing._models import Models, build_seeded
from mpgen.testing.memory import DevicePeak, measure_training_step
from mpgen.testing._torch_compat import full_float32_on_gpu
from mpgen.testing.compare import check_split_outputs
from mpgen.testing.merge import merged_devices
from mpgen.testing.virtual import VirtualDevices, virtual_devices

__all__ = ["ModelSuite"]

#: Where a test class's Models live while its tests run.
_MODELS = pytest.StashKey[Models]()


def _as_tuple(outputs: Any) -> tuple[torch.Tensor, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


class _Defaults:
    """The training script's flags at their defaults (``args.lr``), for its
    optimizer and schedule."""

    def __init__(self, training: Any) -> None:
        self._training = training

    def __getattr__(self, flag: str) -> Any:
        if flag == "settings":  # the spec's train: settings, as args.settings holds them
            return self._training.settings
        return self._training.default(flag)


def _memory_line(device: str, planned: int, parts: dict[str, int],
                 got: Optional[DevicePeak]) -> str:
    """One device's planned and measured peaks, each with its parts."""
    def mib(n: int) -> str:
        return f"{n / 2**20:.2f} MiB"

    plan = ", ".join(f"{p} {mib(b)}" for p, b in parts.items() if b)
    if got is None:
        return f"{device}: measured nothing, planned {mib(planned)} [{plan}]"
    measured = ", ".join(f"{p} {mib(b)}" for p, b in got.at_peak.items() if b)
    return (f"{device}: measured {mib(got.peak)} in {got.phase} [{measured}], "
            f"planned {mib(planned)} [{plan}]: {got.peak / planned:.2f}x")


class ModelSuite:
    """Checks of one generated model; subclass it as ``Test<Model>``.

    The checks:

    * parameters and buffers live on the devices the spec places them on,
      and the model has ``total_params`` parameters;
    * forward gives ``output_shapes``;
    * forward makes exactly the planned ``transfers``, with their bytes
      (virtual devices only: real GPUs do not report copies);
    * backward and an optimizer step leave every parameter, gradient and
      optimizer state on its device (a model without parameters: backward
      reaches every floating-point input, on its device);
    * the outputs equal those of the same code merged onto one device
      (:func:`~mpgen.testing.check_split_outputs`): bit for bit on virtual
      devices; on real GPUs within a reduction-order tolerance, and within
      a loose tolerance of the CPU;
    * where the suite states a ``memory_plan``: each device's peak over a
      steady-state step of the training script's (``training``) batch, loss
      and optimizer, measured on virtual devices, is within
      ``memory_tolerance`` of the plan's.
    """

    #: The generated model class.
    model: type[torch.nn.Module]
    #: Every device the model uses, e.g. ``("cuda:0", "cuda:1")``.
    devices: tuple[str, ...]
    #: State-dict prefix -> the device the spec puts it on.
    placement: dict[str, str]
    total_params: int
    #: Output shapes at the sizes of make_inputs() (None: a size not known
    #: at build time).
    output_shapes: list[tuple[Optional[int], ...]]
    #: Forward transfers in order: (tensor, from, to, bytes at the sizes of
    #: make_inputs(), None if not known at build time).
    transfers: list[tuple[str, str, str, Optional[int]]]

    #: The models and virtual devices of the class's tests, while they run
    #: under pytest (None otherwise: every build is fresh).
    _models: Optional[Models] = None
    #: The build's memory plan of one training step at ``memory_batch``
    #: samples: device -> (peak bytes, {part: bytes alive at the peak})
    #: (None: the suite states no plan).
    memory_plan: Optional[dict[str, tuple[int, dict[str, int]]]] = None
    memory_batch: int = 0
    #: The training script's facts (``train_<name>.TRAINING``): the batch,
    #: the loss and the optimizer of the step measured.
    training: Any = None
    #: How far a measured peak may be from the plan's: ±10%, and at least
    #: ``memory_slack`` bytes (a model of a few KiB: one small buffer more
    #: is a large share of it, and of no device's capacity).
    memory_tolerance: float = 0.10
    memory_slack: int = 4096

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # A suite that states no plan claims no check of one: the test is
        # not collected, rather than skipped.
        if cls.__dict__.get("memory_plan", cls.memory_plan) is None:
            cls.test_a_training_step_peaks_as_planned = None

    def make_inputs(self) -> tuple[torch.Tensor, ...]:
        """Small inputs on the CPU, the same on every call."""
        raise NotImplementedError

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        raise NotImplementedError

    # ---- devices ----
    @property
    def cuda_count(self) -> int:
        """How many CUDA devices the model needs (highest index + 1)."""
        cuda = [int(d.split(":")[1]) for d in self.devices if d.startswith("cuda:")]
        return max(cuda) + 1 if cuda else 0

    def missing_gpus(self) -> Optional[str]:
        """Why the real devices cannot run here, or None when they can."""
        needed = self.cuda_count
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have >= needed:
            return None
        return (
            f"real-GPU run skipped: {self.model.__name__} needs {needed} CUDA "
            f"device{'s' if needed > 1 else ''} "
            f"({', '.join(self.devices)}) and this machine has {have}; the virtual "
            "run checks the same code on the CPU"
        )

    @pytest.fixture(autouse=True)
    def _class_models(self, request) -> Models:
        """The Models of this test's class, made for its first test and
        cleared (the models freed) when its last test is done."""
        node = request.node.getparent(pytest.Class)
        models = node.stash.get(_MODELS, None)
        if models is None:
            models = node.stash[_MODELS] = Models()
            node.addfinalizer(models.clear)
        self._models = models
        return models

    @pytest.fixture(params=["real", "virtual"])
    def virtual(self, request, _class_models) -> Iterator[Optional[VirtualDevices]]:
        """None on the real devices; the virtual devices' handle otherwise:
        the class's one ``virtual_devices(cuda=N)`` context (so that the
        models built in it can be kept), entered for this test, with no
        transfers yet, its peak memory reset and cuda:0 current."""
        if request.param == "real":
            reason = self.missing_gpus()
            if reason:
                pytest.skip(reason)
            yield None
            return
        with _class_models.devices(max(self.cuda_count, 1)) as devices:
            devices.reset_transfers()
            devices.reset_peak()
            torch.cuda.set_device(0)
            yield devices

    def expected_device(self, name: str) -> str:
        """The planned device of a parameter or buffer, by its longest prefix."""
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            prefix = ".".join(parts[:end])
            if prefix in self.placement:
                return self.placement[prefix]
        raise AssertionError(f"{name} belongs to no placed layer")

    def build(self) -> torch.nn.Module:
        """The model as ``torch.manual_seed(0); self.model()`` builds it here.

        Under pytest, the first build in each mode (the real devices, the
        class's virtual devices) is kept, and later builds in that mode
        return it, put back in place into the state that build had; builds
        merged onto one device are fresh (see :mod:`mpgen.testing._models`)."""
        if self._models is None:
            return build_seeded(self.model, 0)
        return self._models.build(self.model, 0)

    # ---- the checks ----
    def test_parameters_and_buffers_live_where_the_spec_says(self, virtual):
        model = self.build()
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            want = self.expected_device(name)
            assert str(tensor.device) == want, (
                f"{name} is on {tensor.device}, but the spec places it on {want}"
            )
        assert sum(p.numel() for p in model.parameters()) == self.total_params

    def test_forward_gives_the_inferred_shapes(self, virtual):
        outputs = _as_tuple(self.build()(*self.make_inputs()))
        assert len(outputs) == len(self.output_shapes)
        for output, shape in zip(outputs, self.output_shapes):
            got = tuple(output.shape)
            assert len(got) == len(shape), f"{got} != {shape}"
            assert all(w is None or g == w for g, w in zip(got, shape)), f"{got} != {shape}"

    def test_forward_makes_exactly_the_planned_transfers(self, virtual):
        if virtual is None:
            pytest.skip("transfers are recorded on virtual devices only")
        model, inputs = self.build(), self.make_inputs()
        with virtual.record() as recording:
            model(*inputs)
        made = [(t.src, t.dst, t.nbytes) for t in recording.forward_transfers]
        planned = [(src, dst, nbytes) for _, src, dst, nbytes in self.transfers]
        assert [m[:2] for m in made] == [p[:2] for p in planned], (
            f"forward moved tensors {[m[:2] for m in made]}, but mpgen planned "
            f"{[p[:2] for p in planned]}"
        )
        for (src, dst, got), (_, _, want) in zip(made, planned):
            assert want is None or got == want, f"{src} -> {dst}: {got} bytes, planned {want}"

    def test_backward_and_an_optimizer_step_keep_every_tensor_in_place(self, virtual):
        model = self.build()
        inputs = self.make_inputs()
        if not any(p.requires_grad for p in model.parameters()):
            # Nothing to train (an optimizer refuses an empty parameter
            # list): backward must still reach the floating-point inputs,
            # through every transfer, on the device each input came from.
            self.check_backward_reaches_the_inputs(model, inputs)
            return
        optimizer = self.make_optimizer(model)

        def loss_and_gradients() -> torch.Tensor:
            optimizer.zero_grad()
            outputs = _as_tuple(model(*inputs))
            loss = sum(out.float().mean().to(outputs[0].device) for out in outputs)
            loss.backward()
            return loss

        loss_and_gradients()
        for name, param in model.named_parameters():
            if param.requires_grad:
                assert param.grad is not None, f"{name} got no gradient"
                assert param.grad.device == param.device, f"{name}: gradient on another device"
        closure = inspect.signature(optimizer.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            optimizer.step(loss_and_gradients)  # LBFGS evaluates the loss several times
        else:
            optimizer.step()
        for name, param in model.named_parameters():
            assert str(param.device) == self.expected_device(name), f"{name} moved in the step"
        for param, state in optimizer.state.items():
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    assert value.device == param.device, f"optimizer state {name} off its device"

    def check_backward_reaches_the_inputs(self, model: torch.nn.Module,
                                          inputs: tuple[torch.Tensor, ...]) -> None:
        """A model without trainable parameters: gradients of the outputs
        reach every floating-point input, on the input's device."""
        inputs = tuple(x.detach().requires_grad_() if x.is_floating_point() else x
                       for x in inputs)
        outputs = _as_tuple(model(*inputs))
        differentiable = [out for out in outputs if out.requires_grad]
        if not differentiable:
            return  # integer inputs only, nothing that backward could reach
        loss = sum(out.float().mean().to(differentiable[0].device) for out in differentiable)
        loss.backward()
        for k, x in enumerate(inputs):
            if x.requires_grad:
                assert x.grad is not None, f"input {k} got no gradient"
                assert x.grad.device == x.device, f"input {k}: gradient on another device"

    def test_a_training_step_peaks_as_planned(self, virtual):
        """Each device's peak over a steady-state training step of the
        training script's batch, loss and optimizer (measured on virtual
        devices, :func:`~mpgen.testing.measure_training_step`) is within
        ``memory_tolerance`` of the plan's."""
        if virtual is None:
            pytest.skip("peaks are measured on virtual devices (bench/gpu_memory.py: on GPUs)")
        peaks = self.measure_training_step()
        wrong = []
        for device, (planned, parts) in self.memory_plan.items():
            got = peaks.get(device)
            measured = got.peak if got is not None else 0
            if abs(measured - planned) > max(self.memory_tolerance * planned, self.memory_slack):
                wrong.append(_memory_line(device, planned, parts, got))
        assert not wrong, (
            f"measured peaks off the plan's by more than {self.memory_tolerance:.0%} "
            f"(batch {self.memory_batch}):\n" + "\n".join(wrong)
        )

    def measure_training_step(self) -> dict[str, DevicePeak]:
        """Each device's peak over the training script's step at
        ``memory_batch`` samples, on the model as built: its batch (seeded),
        loss and optimizer (``self.training``), the gradients to None first."""
        training = self.training
        assert training is not None, "memory_plan needs the training script's facts (training)"
        model = self.build()
        model.train()
        args = _Defaults(training)
        optimizer = training.optimizer(model, args) if training.optimizer is not None else None
        loss_fns = training.losses(training.settings)
        torch.manual_seed(0)
        inputs, targets = training.make_batch(self.memory_batch)

        def loss_and_gradients() -> torch.Tensor:
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            # The loss alone: the outputs and targets beside it are not held
            # through backward (the training loop drops them too).
            loss = training.forward_loss(model, loss_fns, inputs, targets)[0]
            if optimizer is not None:
                loss.backward()
            return loss

        def step() -> None:
            if optimizer is None:
                loss_and_gradients()
            elif training.closure:
                optimizer.step(loss_and_gradients)
            else:
                loss_and_gradients()
                optimizer.step()

        batch = [t for t in (*inputs, *targets) if isinstance(t, torch.Tensor)]
        return measure_training_step(step, model, optimizer, extra=batch)

    def run_eval(self, weights: Optional[dict] = None) -> tuple[dict, list[torch.Tensor]]:
        """Build the model in eval mode, load ``weights`` if given, run
        make_inputs(); return its weights and outputs, on the CPU."""
        with torch.no_grad():
            model = self.build().eval()
            if weights is not None:
                model.load_state_dict(weights)
            outputs = [out.cpu() for out in _as_tuple(model(*self.make_inputs()))]
            weights = {k: v.cpu() for k, v in model.state_dict().items()}
        return weights, outputs

    def test_outputs_equal_the_same_model_on_one_device(self, virtual):
        if virtual is not None:
            # The same CPU kernels either way: equal bit for bit.
            weights, split = self.run_eval()
            with merged_devices("cuda:0"):
                _, merged = self.run_eval(weights)
            check_split_outputs(split, merged, exact=True)
            return
        self.compare_on_real_gpus()

    def compare_on_real_gpus(self) -> None:
        """Split over the GPUs vs merged onto cuda:0 (TF32 off), and vs the
        CPU: the same weights and inputs, compared by check_split_outputs.
        (A model built for the CPU alone runs on the CPU three times.)"""
        with virtual_devices(cuda=max(self.cuda_count, 1), merge=True):  # CPU kernels
            weights, cpu = self.run_eval()
        with full_float32_on_gpu():
            _, split = self.run_eval(weights)
            with merged_devices("cuda:0"):
                _, merged = self.run_eval(weights)
        check_split_outputs(split, merged, cpu)
