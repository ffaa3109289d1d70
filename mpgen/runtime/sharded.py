"""The pipeline program's checkpoints: one folder per step, written by every
rank at once with torch.distributed.checkpoint (DCP), each rank its shards.

# NOTE: [Coordinated checkpoints]
# A save writes DIR/.step_N.partial/ (DCP: one file per rank and a
# .metadata the coordinator writes once every rank has written), then rank
# 0 marks it complete (DIR/.step_N.partial/COMPLETE) and renames it to
# DIR/step_N, and removes the older ones; every rank waits for that before
# it goes on. So a folder named step_N is whole, and a save killed half way
# leaves only a .partial folder, which the next run removes (clean) and no
# resume reads. The state dict is keyed by the single-process model's
# state-dict keys (``model.h.0.attn.weight``; the optimizer's state
# flattened under those keys too), whatever the stages, replicas or
# sharding that wrote it, so DCP loads it into another --dp, another
# --dp-mode or another schedule's layout, resharding as it reads.
# DCP writes every rank's files into one folder: the ranks of a multi-node
# job need a folder they all see (a shared filesystem); check_shared says
# so at the start instead of a resume that depends on the node.

# NOTE: [The best step]
# The step where the monitored metric was best (--monitor) is saved as any
# step is, DIR/step_N, and DIR/best is a relative symbolic link to it,
# replaced atomically (a new link renamed over it) once the step is
# complete. Pruning (--keep-last) keeps the newest N complete steps and the
# one DIR/best links to; the run's newest step is never older than its best,
# so a resume reads the best's record (its value and step) from the newest.
# --merge DIR/best OUT and predict's --checkpoint DIR/best read the step it
# links to (any step folder, DIR/step_N, is read alike).

# NOTE: [Reading a checkpoint folder safely]
# A checkpoint folder may come from someone else, and DCP reads two kinds of
# pickle: the .metadata file (plain pickle.load) and the non-tensor values
# (the step, the layout, the RNG states, the optimizer's hyperparameters:
# torch.load with weights_only=False). Both would run whatever code a
# crafted file names. Every read here goes through Reader, whose
# read_metadata unpickles with an allow-list (DCP's metadata classes,
# torch.Size, dtypes, layouts, a path: what DCP's Metadata holds), and
# Planner, which loads the values with weights_only=True (tensors, numbers,
# strings, tuples, lists, dicts). A file that names anything else is refused
# with one line, before anything is loaded.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import re
import shutil
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .checkpoint import save as save_file
from .data import one_line
from .mesh import tied_apart

MARKER = "COMPLETE"
STEP = re.compile(r"step_(\d+)")
#: The link to the step of the monitored metric's best (NOTE [The best step]).
BEST = "best"

#: What a checkpoint's .metadata may name (NOTE [Reading a checkpoint folder safely]).
METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class Refused(pickle.UnpicklingError):
    """A checkpoint file names something it may not."""


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that finds only METADATA_CLASSES and torch's dtypes."""

    def find_class(self, module: str, name: str):
        if name in METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise Refused(
            f"its .metadata names {module}.{name}, which a checkpoint's metadata never holds: "
            "refused (not unpickled)"
        )


class Reader(dcp.FileSystemReader):
    """DCP's reader of a checkpoint folder, unpickling its .metadata with
    MetadataUnpickler (NOTE [Reading a checkpoint folder safely])."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise Refused(
                f"its .metadata holds a {type(metadata).__name__}, not DCP's Metadata"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class Planner(DefaultLoadPlanner):
    """DCP's load planner, reading the non-tensor values with weights_only=True."""

    def load_bytes(self, read_item, value) -> None:
        try:
            found = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            raise Refused(f"{read_item.dest_index.fqn}: {one_line(error)}") from None
        if self.flatten_state_dict:
            set_element(
                self.original_state_dict, self.mappings[read_item.dest_index.fqn], found
            )
        else:
            self.state_dict[read_item.dest_index.fqn] = found


def folder(root: str, step: int) -> pathlib.Path:
    return pathlib.Path(root, f"step_{step}")


def complete(root: str) -> list[int]:
    """The steps with a complete checkpoint in ``root``, oldest first."""
    path = pathlib.Path(root)
    if not path.is_dir():
        return []
    found = []
    for entry in path.iterdir():
        match = STEP.fullmatch(entry.name)
        if match and (entry / MARKER).is_file():
            found.append(int(match.group(1)))
    return sorted(found)


def leftovers(root: str) -> list[pathlib.Path]:
    """What killed saves left in ``root``: .partial folders, step folders
    without their marker, temporary files of torch.save."""
    path = pathlib.Path(root)
    if not path.is_dir():
        return []
    found = []
    for entry in sorted(path.iterdir()):
        if entry.name.endswith(".partial") or entry.name.endswith(".tmp"):
            found.append(entry)
        elif STEP.fullmatch(entry.name) and not (entry / MARKER).is_file():
            found.append(entry)
    return found


def remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():  # a link goes, not what it links to
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def check_shared(root: str, group=None) -> bool:
    """Whether every rank sees the file rank 0 writes in ``root`` (a
    collective). Run before anything is saved or resumed."""
    probe = pathlib.Path(
        root, f".shared-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    )
    if dist.get_rank() == 0:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("written by rank 0\n")
    dist.barrier(group=group)
    seen = torch.tensor([float(probe.is_file())])
    dist.all_reduce(seen, op=dist.ReduceOp.MIN, group=group)
    dist.barrier(group=group)
    if dist.get_rank() == 0:
        probe.unlink(missing_ok=True)
    return bool(seen.item())


def save(
    root: str, step: int, state: dict, keep: int = 1, best: bool = False
) -> pathlib.Path:
    """Write ``state`` (every rank's, a collective) as DIR/step_N
    (NOTE [Coordinated checkpoints]); ``best``: DIR/best links to it. All
    but the ``keep`` newest and the best are removed."""
    partial = pathlib.Path(root, f".step_{step}.partial")
    rank = dist.get_rank()
    if rank == 0:
        remove(partial)
        partial.mkdir(parents=True)
    dist.barrier()
    dcp.save(state, checkpoint_id=partial)
    dist.barrier()  # every rank's files are written
    if rank == 0:
        with open(partial / MARKER, "w") as f:
            f.write(f"step {step}\n")
            f.flush()
            os.fsync(f.fileno())
        final = folder(root, step)
        remove(final)
        partial.rename(final)
        if best:
            point(root, step)
        prune(root, keep)
    dist.barrier()
    return folder(root, step)


def point(root: str, step: int) -> None:
    """DIR/best a link to DIR/step_N, replaced atomically (NOTE [The best step])."""
    tmp = pathlib.Path(root, f".{BEST}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(f"step_{step}", tmp)
    os.replace(tmp, pathlib.Path(root, BEST))


def best_step(root: str) -> int | None:
    """The step DIR/best links to, where it links to a complete one."""
    path = pathlib.Path(root, BEST)
    match = STEP.fullmatch(os.readlink(path)) if path.is_symlink() else None
    if match and (path / MARKER).is_file():
        return int(match.group(1))
    return None


def prune(root: str, keep: int) -> None:
    """Remove all but the ``keep`` newest complete steps and the best."""
    found, kept = complete(root), best_step(root)
    for old in found[: max(len(found) - keep, 0)]:
        if old != kept:
            remove(folder(root, old))


def resolve(where: str) -> tuple[pathlib.Path, int] | None:
    """The checkpoint --merge and --predict read from ``where``: a step folder
    itself (DIR/step_N, DIR/best), else its newest complete step; and its
    step. None: neither."""
    path = pathlib.Path(where)
    if (path / MARKER).is_file():  # its marker says "step N"
        said = (path / MARKER).read_text().split()
        return path, int(said[1]) if len(said) > 1 and said[1].isdigit() else -1
    found = complete(where)
    return (folder(where, found[-1]), found[-1]) if found else None


def keys(path: pathlib.Path) -> dict:
    """The flattened keys a checkpoint holds, with their metadata."""
    return dict(Reader(str(path)).read_metadata().state_dict_metadata)


def stage_steps(saved: dict) -> list[str]:
    """The step counters of an older checkpoint, one per stage (step.stage_K):
    today's holds one, ``step``."""
    return [key for key in saved if re.fullmatch(r"step\.stage_\d+", key)]


def load(path: pathlib.Path, state: dict, no_dist: bool = False) -> None:
    """Fill ``state`` (tensors in place, other values replaced) from ``path``,
    reading nothing that could run code (a collective unless ``no_dist``).
    Raises the first rank's error (DCP gathers every rank's into a
    CheckpointException, a BaseException with their tracebacks)."""
    Reader(str(path)).read_metadata()  # refused in one line, before DCP wraps it
    try:
        # DCP warns "assuming the intent is to load in a single process": no_dist says so.
        with warnings.catch_warnings():
            if no_dist:
                warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                state,
                storage_reader=Reader(str(path)),
                planner=Planner(),
                no_dist=no_dist,
            )
    except CheckpointException as error:
        found = [failure[0] for failure in error.failures.values()]
        raise (found[0] if found else RuntimeError(str(error))) from None


def model_state(path: pathlib.Path) -> dict:
    """The model's state dict in a checkpoint, whole, on the CPU (no
    process group): what --merge writes."""
    found = {}
    for key, meta in keys(path).items():
        if key.startswith("model.") and hasattr(meta, "size"):
            found[key[len("model.") :]] = torch.empty(
                tuple(meta.size), dtype=meta.properties.dtype
            )
    load(path, {"model": found}, no_dist=not dist.is_initialized())
    return found


def merge(stages, where: str, out: str) -> None:
    """Write one state dict of the model from the newest complete checkpoint
    in ``where`` (it loads with strict=True)."""
    if pathlib.Path(out).is_dir():
        sys.exit(f"--merge: {out} is a folder; give the file to write")
    found = resolve(where)
    if found is None:
        sys.exit(
            f"--merge: no complete checkpoint in {where} (a step_N folder with its {MARKER} marker)"
        )
    path, step = found
    try:
        state = model_state(path)
    except Exception as error:  # not a checkpoint of this program
        sys.exit(f"--merge: cannot read {path} ({one_line(error)})")
    with torch.device("meta"):
        keys = {key for stage in stages.stages for key in stage().state_dict()}
    if set(state) != keys:
        sys.exit(f"--merge: {path} is not a checkpoint of {stages.training.name}")
    apart = tied_apart(state, stages.ties)
    if apart:
        sys.exit(
            f"--merge: {path}: {apart}; they are one parameter of the model, so nothing was written"
        )
    try:
        save_file(state, pathlib.Path(out))
    except OSError as error:
        sys.exit(f"--merge: cannot write {out} ({error})")
    print(f"merged {path} (step {step}) into {out} ({len(state)} tensors)")
