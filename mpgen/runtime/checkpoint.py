"""Checkpoints of the single-process script (DIR/last.pt, written
atomically), the pieces a pipeline checkpoint shares with them (the RNG
states; sharded.py writes those), and --init's strict load."""

from __future__ import annotations

import pathlib
import random
import tempfile

import torch

from .data import one_line, read_tensors


def rng_states() -> dict:
    """Every RNG's state: torch's CPU one, each CUDA device's, Python's."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    """Restore the states rng_states() returned."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def state(model, optimizer, scheduler, scaler, step: int) -> dict:
    """What a checkpoint holds: the model's (or a stage's) state dict, the
    optimizer's, the scheduler's and the gradient scaler's (None where there
    is none), the optimizer steps done and every RNG's state."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "step": step,
        "rng": rng_states(),
    }


def restore(saved: dict, model, optimizer, scheduler, scaler) -> int:
    """Load what :func:`state` saved (RNGs included); the step it was at."""
    model.load_state_dict(saved["model"])
    if optimizer is not None:
        optimizer.load_state_dict(saved["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(saved["scheduler"])
    if scaler is not None and saved["scaler"] is not None:
        scaler.load_state_dict(saved["scaler"])
    set_rng_states(saved["rng"])
    return saved["step"]


def save(state: dict, path: pathlib.Path) -> None:
    """``torch.save(state)`` to ``path`` atomically: into a temporary file in
    its folder, then renamed over it, so a crash leaves the previous one whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = tempfile.NamedTemporaryFile(
        dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp", delete=False
    )
    tmp = pathlib.Path(f.name)
    try:
        with f:
            torch.save(state, f)
        tmp.replace(path)  # os.replace: atomic
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load(path: pathlib.Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def initialise(
    modules: list, path: str, keys: list, training, state: dict | None = None
) -> None:
    """--init: load the state dict in ``path`` (.pt/.pth, or a checkpoint's
    model; .safetensors), or ``state`` where the caller read it (predict's
    folders), into ``modules`` (the model, or a rank's stages),
    strictly against ``keys`` (the whole model's). A key missing because its
    parameter is tied to one there takes that tensor (Hugging Face's
    save_pretrained leaves out lm_head.weight, tied to the embedding).
    Raises ValueError saying what is wrong, in one line."""
    if state is None:
        try:
            state = read_tensors(pathlib.Path(path), lazy=True)
        except Exception as error:  # torch and safetensors each raise their own
            raise ValueError(f"cannot read it ({one_line(error)})") from None
    if isinstance(state.get("model"), dict) and "step" in state:  # DIR/last.pt
        state = state["model"]
    for pair in training.ties:
        for key, owner in (pair, pair[::-1]):
            if key not in state and owner in state:
                state[key] = state[owner]
    known = set(keys)
    missing = [k for k in keys if k not in state]
    unexpected = [k for k in state if k not in known]
    wrong = [
        f"{len(found)} {what} ({', '.join(found[:5])}{', ...' * (len(found) > 5)})"
        for what, found in (("missing", missing), ("unexpected", unexpected))
        if found
    ]
    if wrong:
        raise ValueError(f"not a state dict of {training.name}: {'; '.join(wrong)}")
    for module in modules:
        try:
            module.load_state_dict({key: state[key] for key in module.state_dict()})
        except RuntimeError as error:  # a tensor of another shape
            raise ValueError(one_line(error)) from None
