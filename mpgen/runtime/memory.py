"""--memory: this process's peak memory over one steady-state step, measured,
beside the plan's (the build's memory plan, in the script's facts).

On CUDA, ``torch.cuda.max_memory_allocated`` of each of this process's
devices after ``reset_peak_memory_stats``; on the CPU, :class:`LiveBytes`:
the bytes of the tensor storages alive at once, as mpgen.testing's
MemoryTracker counts them (a copy: generated code never imports mpgen). The
step measured is the second of the run (the first makes the optimizer's
state), or the first of a run of one step."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: What is alive at a peak, by part (the plan's parts).
PARTS = ("weights", "gradients", "optimizer", "activations", "transient")
_RANK = {part: k for k, part in enumerate(PARTS)}


class _Saved:
    """A tensor autograd saves for backward (the pack hook's): its death ends
    the storage's activation."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class LiveBytes(TorchDispatchMode):
    """The bytes of live tensor storages per device, their peak, the phase
    of the step then and the parts alive (weights, gradients, optimizer
    state, activations saved for backward, the rest transient)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = {}  # storage id -> [device, bytes, own part, part, times saved]
        self.current = {}  # device -> part -> bytes
        self.peaks = {}  # device -> (bytes, phase, {part: bytes})
        self.phase = "forward"
        self.hooks = []
        self.saved = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)

    def track(self, modules, optimizers) -> None:
        """Count what exists before the step: weights, gradients, optimizer state."""
        for module in modules:
            for tensor in module.parameters():
                self.see(tensor, "weights")
                if tensor.grad is not None:
                    self.see(tensor.grad, "gradients")
                if tensor.requires_grad:
                    self.hooks.append(
                        tensor.register_post_accumulate_grad_hook(self.gradient)
                    )
            for tensor in module.buffers():
                self.see(tensor, "weights")
        for optimizer in optimizers:
            self.optimizer_state(optimizer)
            self.hooks.append(optimizer.register_step_pre_hook(self.step_begins))
            self.hooks.append(optimizer.register_step_post_hook(self.step_ends))

    def __enter__(self) -> "LiveBytes":
        self.saved.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.saved.__exit__(*exc)
        for hook in self.hooks:
            hook.remove()

    def step_begins(self, optimizer, args, kwargs) -> None:
        self.phase = "optimizer step"

    def step_ends(self, optimizer, args, kwargs) -> None:
        self.optimizer_state(optimizer)
        self.phase = "forward"

    def optimizer_state(self, optimizer) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.see(value, "optimizer")

    def gradient(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.see(param.grad, "gradients")

    def pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        info = self.see(tensor, "transient")
        if info is not None:
            info[4] += 1
            self.label(info)
            weakref.finalize(saved, self.unsaved, info)
        return saved

    def unsaved(self, info: list) -> None:
        info[4] -= 1
        self.label(info)

    def see(self, tensor: torch.Tensor, part: str, phase: str | None = None):
        """Count ``tensor``'s storage (once), as ``part`` if it is not more already."""
        if tensor.device.type == "meta" or tensor.is_sparse:
            return None
        storage = tensor.untyped_storage()
        key = storage._cdata
        info = self.live.get(key)
        if info is None:
            info = self.live[key] = [str(tensor.device), 0, part, part, 0]
            weakref.finalize(storage, self.free, key)
        elif _RANK[part] < _RANK[info[2]]:
            info[2] = part
            self.label(info)
        nbytes = storage.nbytes()
        if nbytes != info[1]:
            delta, info[1] = nbytes - info[1], nbytes
            self.add(info, delta, phase)
        return info

    def label(self, info: list) -> None:
        part = info[2]
        if info[4] > 0 and _RANK["activations"] < _RANK[part]:
            part = "activations"
        if part != info[3]:
            parts = self.current.get(info[0])
            if parts is not None:
                parts[info[3]] -= info[1]
                parts[part] += info[1]
            info[3] = part

    def add(self, info: list, delta: int, phase: str | None = None) -> None:
        parts = self.current.setdefault(info[0], dict.fromkeys(PARTS, 0))
        parts[info[3]] += delta
        total = sum(parts.values())
        if delta > 0 and total > self.peaks.get(info[0], (0,))[0]:
            self.peaks[info[0]] = (total, phase or self.phase, dict(parts))

    def free(self, key: int) -> None:
        info = self.live.pop(key, None)
        if info is not None:
            self.add(info, -info[1])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        phase = self.phase
        if phase == "forward" and torch._C._current_autograd_node() is not None:
            phase = "backward"
        for tensor in tree_leaves((out, args, kwargs)):
            if isinstance(tensor, torch.Tensor):
                self.see(tensor, "transient", phase)
        return out


def _unpack(saved: _Saved) -> torch.Tensor:
    return saved.tensor


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


class Probe:
    """Measures one step of a run (``measured(step)``: whether it is the
    one) and prints, per device of this process, the measured peak beside
    the plan's (``planned``: device -> bytes; ``names``: this process's
    device -> the plan's, e.g. its stage's device in the spec)."""

    def __init__(
        self, planned: dict, names: dict, where: str, first: int, last: int, held
    ) -> None:
        self.planned, self.names, self.where = planned, names, where
        self.step = first + 2 if last >= first + 2 else first + 1
        self.held, self.tracker = held, None

    def measured(self, step: int) -> bool:
        return step == self.step

    def start(self) -> None:
        modules, optimizers = self.held()
        cuda = [d for d in self.names if d.startswith("cuda")]
        for device in cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        if len(cuda) < len(self.names):
            self.tracker = LiveBytes()
            self.tracker.track(modules, optimizers)
            self.tracker.__enter__()

    def stop(self) -> list[str]:
        """The lines: one per device of this process."""
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
        lines = []
        for device, name in self.names.items():
            phase, parts = "", {}
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device)
            else:
                peak, phase, parts = self.tracker.peaks.get(device, (0, "", {}))
            planned = self.planned.get(name)
            versus = (
                f"planned {mib(planned)} ({peak / planned:.2f}x)"
                if planned
                else "no plan"
            )
            at = f" in {phase}" if phase else ""
            alive = ", ".join(f"{p} {mib(b)}" for p, b in parts.items() if b)
            alive = f" [{alive}]" if alive else ""
            shown = f"{name} (on {device})" if name != device else device
            lines.append(
                f"memory {self.where}{shown}, step {self.step}: measured {mib(peak)} "
                f"({peak} bytes){at}, {versus}{alive}"
            )
        return lines


def probe(engine, done: int, last: int) -> Probe:
    """The probe of a run from step ``done`` to ``last`` of ``engine``: the
    single-process script's (its model's devices, the plan's ``train``) or
    a pipeline rank's (its device, named by its stage's device in the spec,
    and the plan's ``pipeline``)."""
    if hasattr(engine, "modules"):  # pipeline.Pipelined: this rank's stages
        stages, device = engine.stages, str(engine.device)
        names = {device: stages.devices[min(engine.mine)]}
        where = f"rank {dist.get_rank()}: "

        def held() -> tuple:
            return list(engine.modules.values()), list(engine.optimizers.values())

        return Probe(stages.memory, names, where, done, last, held)
    training = engine.training

    def held() -> tuple:
        optimizers = [engine.optimizer] if engine.optimizer is not None else []
        return [engine.model], optimizers

    names = {device: device for device in training.devices}
    return Probe(training.memory, names, "", done, last, held)
