"""ModelSuite's models: built once per mode, and handed to every test as built.

Building a transformer with a hundred million parameters costs more than
most checks made on it.  So while the tests of one ``ModelSuite`` class run,
the model is built once per *mode* -- on the real devices, or on the class's
virtual devices -- and a copy of its state is kept; each later ``build()``
in that mode puts the same model back into that state and returns it.

Builds merged onto one device (under ``merged_devices()``, or inside a
``virtual_devices(merge=True)`` context: the references of the output
check) are not kept: each check makes its merged build once, so keeping it
would only hold one more copy of the weights while the check runs.  Nor are
builds inside any virtual-devices context but the class's own.

What "the state of a built model" means here, and what is put back:

* every parameter and buffer (``model.parameters()``, ``model.buffers()``:
  the BatchNorm running statistics and ``num_batches_tracked`` included),
  copied back in place from a clone taken right after the build -- the
  same tensor objects, bit for bit the built values;
* each parameter's and buffer's ``requires_grad`` as built, and ``.grad``
  set to None;
* every module's ``training`` flag as built;
* the random number generators as the build left them (the CPU's; a real
  CUDA device's, when the build initialised CUDA).

Restoring assumes that this is all the state a test changes.  Before it
restores anything it checks that the model still has the module objects,
and the parameter and buffer objects, it was built with, with the type,
shape, strides, dtype and device they were built with; where any of that
changed (a test replaced a layer, moved the model, or changed a dtype), the
model is built afresh instead.  Not put back: anything else a test may
change -- hooks it registered, attributes it set, plain tensor attributes
or other state a user module keeps outside its parameters and buffers.
ModelSuite's own checks change nothing of that kind.  A model with lazy
(uninitialised) parameters or buffers is built afresh every time: its
first forward changes what it is.

A model built under virtual devices belongs to that context (its tensors
are the context's), so the class's context is kept with its models and
entered again for every test.
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, List, Optional, Tuple

import torch

from mpgen.testing import _state
from mpgen.testing.merge import merging_onto
from mpgen.testing.virtual import VirtualDevices, virtual_devices


def build_seeded(model_class: type[torch.nn.Module], seed: int) -> torch.nn.Module:
    """A fresh build: ``torch.manual_seed(seed); model_class()``."""
    torch.manual_seed(seed)
    return model_class()


def _layout(t: torch.Tensor) -> Tuple[Any, ...]:
    return type(t), t.shape, t.stride(), t.dtype, t.device


class BuiltModel:
    """A model just built, with a copy of its state to put it back as built."""

    def __init__(self, model: torch.nn.Module, seed: int):
        self.model = model
        self._seed = seed
        self._training = [(m, m.training) for m in model.modules()]
        with torch.no_grad():
            self._tensors = [(t, t.detach().clone(), t.requires_grad, _layout(t))
                             for t in _tensors_of(model)]
        self._cpu_rng = torch.get_rng_state()
        # Under virtual devices the CUDA generator is the CPU's.
        real_cuda = _state.ACTIVE is None and torch.cuda.is_initialized()
        self._cuda_rng = torch.cuda.get_rng_state_all() if real_cuda else None

    @staticmethod
    def of(model: torch.nn.Module, seed: int) -> Optional["BuiltModel"]:
        """The model's BuiltModel; None for a model that cannot be kept (one
        with lazy parameters or buffers)."""
        if any(torch.nn.parameter.is_lazy(t) for t in _tensors_of(model)):
            return None
        return BuiltModel(model, seed)

    def unchanged_structure(self) -> bool:
        """Whether the model still has the modules, parameters and buffers
        it was built with, laid out as built."""
        modules = list(self.model.modules())
        tensors = _tensors_of(self.model)
        return (len(modules) == len(self._training)
                and all(m is built for m, (built, _) in zip(modules, self._training))
                and len(tensors) == len(self._tensors)
                and all(t is built and _layout(t) == layout
                        for t, (built, _, _, layout) in zip(tensors, self._tensors)))

    def restore(self) -> bool:
        """Put the model back as built, in place; False, changing nothing,
        where its structure changed (see :meth:`unchanged_structure`)."""
        if not self.unchanged_structure():
            return False
        with torch.no_grad():
            for t, saved, requires_grad, _ in self._tensors:
                t.copy_(saved)
                t.grad = None
                t.requires_grad_(requires_grad)
        for module, training in self._training:
            module.training = training
        # As after torch.manual_seed(seed) and the build's own draws: a CUDA
        # generator the build did not initialise is as the seed left it.
        torch.manual_seed(self._seed)
        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)
        return True


def _tensors_of(model: torch.nn.Module) -> List[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


class Models:
    """The built models and the virtual devices of one ModelSuite class
    while its tests run; :meth:`clear` frees them when the class is done."""

    def __init__(self) -> None:
        self._devices: Dict[int, VirtualDevices] = {}
        self._built: Dict[Hashable, BuiltModel] = {}

    def devices(self, cuda: int) -> VirtualDevices:
        """The class's ``virtual_devices(cuda=cuda)`` context, the same one
        on every call: the models built in it stay valid."""
        if cuda not in self._devices:
            self._devices[cuda] = virtual_devices(cuda=cuda)
        return self._devices[cuda]

    def build(self, model_class: type[torch.nn.Module], seed: int) -> torch.nn.Module:
        """``model_class`` as ``build_seeded(model_class, seed)`` builds it
        where this is called: in a mode whose builds are kept, the kept one
        put back as built, or a fresh build, kept for next time; elsewhere
        a fresh build."""
        mode = self._mode()
        if mode is None:
            return build_seeded(model_class, seed)
        key = (model_class, seed, mode)
        built = self._built.pop(key, None)
        if built is not None and built.restore():
            self._built[key] = built
            return built.model
        built = None  # a kept model that changed is freed before the new build
        model = build_seeded(model_class, seed)
        built = BuiltModel.of(model, seed)
        if built is not None:
            self._built[key] = built
        return model

    def _mode(self) -> Optional[Hashable]:
        """Where a build happens now, if its builds are kept: the real
        devices, or the class's virtual devices (not merged), with the
        default dtype, which a build depends on too; None for any other
        place (merged onto one device, another virtual-devices context)."""
        dtype = torch.get_default_dtype()
        if _state.ACTIVE is None:
            return None if merging_onto() is not None else ("real", dtype)
        for cuda, devices in self._devices.items():
            if devices.active:
                return None if devices.merged else ("virtual", cuda, dtype)
        return None

    def clear(self) -> None:
        self._built.clear()
        self._devices.clear()
