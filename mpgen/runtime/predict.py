"""Predict: the model run forward over data, every output written by name
(``predict_<name>.py``, and ``pp_<name>.py --predict`` under torchrun).

The weights come from --checkpoint (a single-process DIR/last.pt, a
pipeline checkpoint folder's newest complete step_N, or one file) or
--init (a .pt/.safetensors state dict, or a Hugging Face save_pretrained
folder); the inputs from --data in every form training reads (data.py),
each batch checked against the spec's inputs; the batches run in order
under torch.inference_mode, the outputs gathered on the CPU and written to
--out (.safetensors, .pt or .npz), concatenated along each output's batch
dim in the data's order. Where the data holds the losses' targets too, the
spec's loss and each class output's accuracy are printed.

# NOTE: [Predicting in batches]
# By default a file's (or Dataset's) samples are one batch, so the file of
# outputs is exactly the model's one forward over them. With --batch-size,
# a batch's outputs are the model's on that batch, and the file holds them
# joined along each output's batch dim: one forward over all the data
# wherever nothing couples a batch's samples (eval mode: BatchNorm reads
# its running stats, Dropout is off), up to the rounding of another batch
# size. An output whose samples sit inside a product (``[seq*batch,
# vocab]``) is joined as the samples sit there (the loss's layout); an
# output with no batch dim of its own is written as one per batch, stacked
# along a new first dim. The
# micro-batches (--microbatches) are the model's own micro-batched forward
# (``pipeline:`` in the spec) or, for another model, the runtime's split of
# each batch: CUDA runs a device's work on micro-batch i while the next
# device's work on i - 1 is queued, so the devices work at once. The
# pipeline program runs torch's forward-only schedule (``schedule.eval``)
# over equal micro-batches (the stages' receive buffers take one shape), so
# every batch is padded to a multiple of the micro-batches, and a last batch
# of fewer samples to the first's size, with copies of its last sample,
# whose outputs are dropped.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
import tempfile
import time
from datetime import timedelta
from os import environ
from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset

from . import checkpoint, sharded, threads
from .data import (
    DATA_FILES,
    TensorData,
    as_batch,
    check_batch,
    collate,
    load_data,
    one_line,
    read_tensors,
    SyntheticData,
)
from .loop import autocast, check_devices, hits
from .spec import Stages, Training

try:  # a progress bar on a terminal, when tqdm is installed (as the training log)
    from tqdm import tqdm
except ImportError:
    tqdm = None

#: The files --out writes, by suffix.
OUT_FILES = (".safetensors", ".pt", ".npz")
#: A Hugging Face save_pretrained folder's weights, in the order looked for.
PRETRAINED = ("model.safetensors", "pytorch_model.bin")
PRETRAINED_INDEX = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclasses.dataclass(frozen=True)
class Predicting:
    """One model's prediction, as ``predict_<name>.py`` states it: the
    training facts (inputs, targets, shapes, the loss), the model's outputs
    in the order it returns them with each one's batch layout (an int, a
    ``(dim, place)`` inside a product as Training.batch_dims, or None), each
    loss's ``(output index, class dim)`` where it scores classes (None:
    not), and the attribute holding the model's micro-batch count (its
    ``pipeline:`` forward; None: the runtime splits the batch)."""

    training: Training
    outputs: tuple[str, ...]
    output_dims: tuple = ()
    scored: tuple = ()
    microbatches: Optional[str] = None


# -- flags ------------------------------------------------------------------------


def parser(
    predicting: Predicting, stages: Stages | None = None
) -> argparse.ArgumentParser:
    """The flags of ``predict_<name>.py`` or of ``pp_<name>.py --predict``."""
    training = predicting.training
    d, name = training.default, training.name
    how = " as a pipeline of processes under torchrun" if stages else ""
    p = argparse.ArgumentParser(
        prog=f"pp_{training.run}.py --predict" if stages else None,
        description=f"Run {name} forward{how} over --data and write every output by name to --out.",
    )
    add = p.add_argument
    text = (
        "the weights: a train script's DIR (its last.pt), a pipeline checkpoint DIR (its newest "
        "complete step_N) or one of its step folders (DIR/best, DIR/step_N), or one state-dict file "
        "(DIR/best.pt)"
    )
    add("--checkpoint", metavar="PATH", help=text)
    text = (
        "the weights: a state dict of {} (.pt or .safetensors), or a Hugging Face save_pretrained "
        "folder"
    ).format(name)
    add("--init", metavar="FILE", help=text)
    text = (
        "FILE.pt/.npz/.safetensors, or module:function returning a Dataset or DataLoader; the "
        f"inputs, and the targets for the loss (default: {d('data') or 'synthetic data'})"
    ).replace("%", "%%")
    add("--data", default=d("data"), metavar="SPEC", help=text)
    text = "where the outputs go, each under its name: .safetensors, .pt or .npz"
    add("--out", metavar="FILE", help=text)
    text = (
        "samples per forward (default: all of a file's or Dataset's in one, so that the "
        "outputs are one forward's; a DataLoader's own batches; synthetic data: the spec's "
        "batch size)"
    )
    add("--batch-size", type=int, metavar="B", help=text)
    text = (
        "micro-batches per batch, so that the devices work at once (default: the spec's "
        "pipeline: micro-batches, else 1)"
        if not stages
        else f"micro-batches per batch, a batch padded to a multiple (default: {stages.microbatches})"
    )
    add("--microbatches", type=int, metavar="M", help=text)
    choices = ("off", "bf16") if stages else ("off", "bf16", "fp16")
    text = "autocast the forward (default off, whatever the spec trains with)"
    add("--amp", choices=choices, default="off", help=text)
    add("--samples", type=int, default=d("samples"), help="size of the synthetic data")
    add("--seed", type=int, default=d("seed"), help="the synthetic data's seed")
    add("--workers", type=int, default=d("workers"), help="DataLoader worker processes")
    if stages:
        text = "seconds a send may wait for another rank before every rank stops"
        add("--timeout", type=float, default=120.0, metavar="SECONDS", help=text)
    threads.add_flag(p)
    return p


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stop on arguments predict cannot use, in one usage line (exit 2)."""

    def refuse(message: str) -> None:
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    if bool(args.checkpoint) == bool(args.init):
        refuse("give the weights: --checkpoint PATH or --init FILE (one of them)")
    if args.checkpoint and not pathlib.Path(args.checkpoint).exists():
        refuse(f"--checkpoint: no file or folder {args.checkpoint}")
    if args.init and not pathlib.Path(args.init).exists():
        refuse(f"--init: no file {args.init}")
    if args.out and not args.out.endswith(OUT_FILES):
        refuse(f"--out {args.out}: give a file ending {', '.join(OUT_FILES)}")
    if args.out and pathlib.Path(args.out).is_dir():
        refuse(f"--out {args.out}: a folder; give the file to write")
    for flag in ("batch_size", "microbatches", "samples"):
        value = getattr(args, flag)
        if value is not None and not 1 <= value < 2**31:
            refuse(
                f"--{flag.replace('_', '-')} must be at least 1 and below 2**31, got {value}"
            )
    if args.workers < 0:
        refuse(f"--workers must be at least 0, got {args.workers}")
    if not -(2**63) <= args.seed < 2**64:
        refuse(f"--seed must be in [-2**63, 2**64), got {args.seed}")


# -- weights ----------------------------------------------------------------------


class Checkpointed(dict):
    """A pipeline checkpoint's model tensors (DIR/step_N), each read when first
    asked for, by this process alone: a rank reads only its stages' keys."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        found = sharded.keys(path)
        self.metas = {
            key[len("model.") :]: meta
            for key, meta in found.items()
            if key.startswith("model.") and hasattr(meta, "size")
        }
        super().__init__(dict.fromkeys(self.metas))

    def __getitem__(self, key: str) -> torch.Tensor:
        value = super().__getitem__(key)
        if value is None:
            meta = self.metas[key]
            value = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            try:
                sharded.load(self.path, {"model": {key: value}}, no_dist=True)
            except Exception as error:  # DCP's own, a damaged or refused file
                raise ValueError(f"cannot read {key} ({one_line(error)})") from None
            self[key] = value
        return value


def pretrained(folder: pathlib.Path) -> dict:
    """A Hugging Face save_pretrained folder's state dict: its one weights
    file, or the shards its index names (each read lazily)."""
    for name in PRETRAINED:
        if (folder / name).is_file():
            return read_tensors(folder / name, lazy=True)
    for name in PRETRAINED_INDEX:
        index = folder / name
        if index.is_file():
            shards = json.loads(index.read_text())["weight_map"]
            state: dict = {}
            for shard in dict.fromkeys(shards.values()):
                part = read_tensors(folder / pathlib.Path(shard).name, lazy=True)
                for key in part:
                    state[key] = part[key]
            return state
    raise ValueError(f"no {' or '.join(PRETRAINED + PRETRAINED_INDEX)} in the folder")


def weights(args) -> tuple[dict, str]:
    """The state dict --checkpoint or --init names, and how to name it:
    a folder's last.pt, else its newest complete step_N, else (--init) a
    save_pretrained folder's files; or the file itself. Raises ValueError."""
    flag, given = (
        ("--checkpoint", args.checkpoint) if args.checkpoint else ("--init", args.init)
    )
    path = pathlib.Path(given)
    try:
        if path.is_dir() and (path / "last.pt").is_file():
            path = path / "last.pt"
        elif path.is_dir() and sharded.resolve(str(path)):
            path = sharded.resolve(str(path))[0]  # a step folder, or the newest
            return Checkpointed(path), f"{flag} {path}"
        elif path.is_dir() and any(
            (path / n).is_file() for n in PRETRAINED + PRETRAINED_INDEX
        ):
            return pretrained(path), f"{flag} {path}"
        elif path.is_dir():
            raise ValueError(
                "a folder with no last.pt, no complete step_N checkpoint (with its "
                f"{sharded.MARKER} marker) and no {PRETRAINED[0]}"
            )
        state = read_tensors(path, lazy=True)
    except ValueError:
        raise
    except Exception as error:  # torch, DCP and safetensors each raise their own
        raise ValueError(f"cannot read it ({one_line(error)})") from None
    if isinstance(state.get("model"), dict) and "step" in state:  # DIR/last.pt
        state = state["model"]
    return state, f"{flag} {path}"


def load_weights(
    modules: list, keys: list, training: Training, args, stop=sys.exit
) -> str:
    """Fill ``modules`` (the model, or a rank's stages) from the weights the
    flags name, strictly against ``keys`` (the whole model's: only the
    modules' own tensors are read); ``stop`` in one line when they do not
    fit. What was loaded, as a message names it."""
    flag = "--checkpoint" if args.checkpoint else "--init"
    try:
        state, where = weights(args)
        checkpoint.initialise(modules, where, keys, training, state=state)
    except ValueError as error:
        stop(f"{flag} {args.checkpoint or args.init}: {error}")
    return where.split(" ", 1)[1]


# -- data -------------------------------------------------------------------------


def inputs_only(training: Training) -> Training:
    """``training`` with no targets: what data without them is checked against."""
    n = len(training.inputs)
    return dataclasses.replace(
        training,
        targets=(),
        batch_dims=training.batch_dims[:n],
        shapes=training.shapes[:n],
        dtypes=training.dtypes[:n],
        classes=training.classes[:n],
    )


def read_data(training: Training, args) -> tuple[Dataset | DataLoader, Training, str]:
    """--data (a file, a factory's Dataset or DataLoader, else synthetic
    samples), the training facts its samples are checked against (without
    targets where it holds none), and how messages name it."""
    source = args.data
    if not source:
        return (
            SyntheticData(training, args.samples, args.seed),
            training,
            "the synthetic data",
        )
    if source.endswith(DATA_FILES):
        path = pathlib.Path(source)
        if not path.is_file():
            sys.exit(f"--data: no file {path}")
        try:
            tensors = read_tensors(path)
        except Exception as error:  # torch, numpy and safetensors each raise their own
            sys.exit(f"--data: cannot read {path} ({one_line(error)})")
        given = (
            training
            if all(key in tensors for key in training.targets)
            else inputs_only(training)
        )
        return TensorData(tensors, str(path), given), given, str(path)
    kwargs = training.data_kwargs if source == training.default("data") else {}
    data = load_data(source, kwargs, "--data", training)
    first = next(iter(data), None)
    if first is None:
        sys.exit(f"--data {source}: gives no sample")
    sized = len(first) if isinstance(first, (tuple, list)) else None
    missing = isinstance(first, dict) and any(
        first.get(key) is None for key in training.targets
    )
    given = (
        training
        if not (missing or sized == len(training.inputs))
        else inputs_only(training)
    )
    return data, given, f"--data {source}"


def in_order(data, given: Training, args, where: str):
    """``data``'s batches in its order (a Dataset's samples by index), checked."""
    if not isinstance(data, DataLoader):
        data = DataLoader(
            data,
            args.batch_size,
            shuffle=False,
            collate_fn=functools.partial(collate, training=given),
            num_workers=args.workers,
        )
    for batch in data:
        yield check_batch(as_batch(batch, given.keys), given, where)


def per_forward(data, args, training: Training) -> Optional[int]:
    """The samples of one forward: --batch-size; else all of a file's or
    Dataset's (the outputs are one forward's); a DataLoader's own batches
    (None); synthetic data's, the spec's batch size."""
    if args.batch_size:
        return args.batch_size
    if isinstance(data, SyntheticData):
        return training.default("batch_size") or 1
    if isinstance(data, DataLoader):
        return None
    return max(len(data), 1)


def batch_size(batch: tuple, dims: tuple) -> int:
    """The samples in a batch (1 where no key has a batch dim of its own)."""
    for x, d in zip(batch, dims):
        if x is not None and isinstance(d, int):
            return x.shape[d]
    return 1


# -- outputs ----------------------------------------------------------------------


def split(x: torch.Tensor, layout, size: int, parts: int) -> list:
    """``x``'s samples in ``parts`` runs (as tensor_split), along ``layout``."""
    if layout is None:
        return [x] * parts
    if isinstance(layout, tuple):
        k, place = layout
        grouped = x.unflatten(k, (size, -1) if place == 0 else (-1, size))
        return [p.flatten(k, k + 1) for p in grouped.tensor_split(parts, k + place)]
    return list(x.tensor_split(parts, layout))


def join(parts: list, layout, sizes: list) -> torch.Tensor:
    """Runs of ``sizes`` samples joined along ``layout`` (inverse of
    :func:`split`); an output with no batch dim of its own: one run as it
    is, more stacked along a new first dim (NOTE [Predicting in batches])."""
    if layout is None:
        return parts[0] if len(parts) == 1 else torch.stack(parts)
    if isinstance(layout, tuple):
        k, place = layout
        if place == 0:  # b * R + r: each run's samples are a run of the product
            return torch.cat(parts, k)
        # r * B + b: each run [R, b_i] along the product, joined on its batch
        rows = [p.unflatten(k, (-1, s)) for p, s in zip(parts, sizes)]
        return torch.cat(rows, k + 1).flatten(k, k + 1)
    return torch.cat(parts, layout)


def first_samples(x: torch.Tensor, layout, size: int, keep: int) -> torch.Tensor:
    """The first ``keep`` samples of a batch of ``size`` (a padded one's real ones)."""
    if layout is None or keep == size:
        return x
    if isinstance(layout, tuple):
        k, place = layout
        grouped = x.unflatten(k, (size, -1) if place == 0 else (-1, size))
        return grouped.narrow(k + place, 0, keep).flatten(k, k + 1)
    return x.narrow(layout, 0, keep)


class Outputs:
    """Each output's batches, on the CPU, joined at the end; a product layout
    whose batch is the inner factor is kept per sample count and joined so."""

    def __init__(self, predicting: Predicting) -> None:
        self.names, self.dims = predicting.outputs, predicting.output_dims
        self.parts: list[list] = [[] for _ in self.names]
        self.sizes: list[int] = []

    def add(self, outputs: tuple, samples: int) -> None:
        for k, x in enumerate(outputs):
            self.parts[k].append(x.detach().to("cpu"))
        self.sizes.append(samples)

    def joined(self) -> dict:
        layouts = self.dims or (0,) * len(self.names)
        return {
            name: join(parts, layout, self.sizes)
            for name, parts, layout in zip(self.names, self.parts, layouts)
        }


def write(outputs: dict, path: str) -> None:
    """``outputs`` (name -> CPU tensor) into ``path``, atomically: a
    .safetensors or .pt file of the tensors, or .npz arrays (bfloat16,
    which numpy lacks, as float32)."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    f = tempfile.NamedTemporaryFile(
        dir=out.parent, prefix=f".{out.stem}.", suffix=out.suffix, delete=False
    )
    f.close()
    tmp = pathlib.Path(f.name)
    tensors = {name: x.contiguous() for name, x in outputs.items()}
    try:
        if out.suffix == ".safetensors":
            import safetensors.torch

            safetensors.torch.save_file(tensors, str(tmp))
        elif out.suffix == ".npz":
            import numpy

            arrays = {
                name: (x.float() if x.dtype == torch.bfloat16 else x).numpy()
                for name, x in tensors.items()
            }
            with tmp.open("wb") as handle:
                numpy.savez(handle, **arrays)
        else:
            torch.save(tensors, tmp)
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# -- the loss and accuracy --------------------------------------------------------


class Scores:
    """The loss over the batches (each weighted by its samples) and each
    class output's hits, where the data has targets."""

    def __init__(self, predicting: Predicting) -> None:
        self.scored = predicting.scored
        self.total, self.samples = 0.0, 0
        self.right = [0] * len(self.scored)
        self.seen = [0] * len(self.scored)

    def add(
        self, loss: torch.Tensor, outputs: tuple, targets: tuple, samples: int
    ) -> None:
        self.total += float(loss) * samples
        self.samples += samples
        for k, score in enumerate(self.scored):
            if score is None or targets[k] is None:
                continue
            index, class_dim = score
            right, seen = hits(
                outputs[index], targets[k].to(outputs[index].device), class_dim
            )
            self.right[k] += int(right)
            self.seen[k] += int(seen)

    def line(self, names: tuple) -> str:
        loss = self.total / max(self.samples, 1)
        parts = [f"loss {loss:.6g} over {self.samples:,} samples"]
        for k, score in enumerate(self.scored):
            if score is not None and self.seen[k]:
                what = names[score[0]]
                parts.append(f"{what} accuracy {self.right[k] / self.seen[k]:.4f}")
        return "; ".join(parts)


def bar(total: Optional[int]):
    """A tqdm bar over batches on a terminal (None elsewhere or without tqdm)."""
    if tqdm is None or not sys.stderr.isatty():
        return None
    return tqdm(total=total, unit="batch", dynamic_ncols=True)


def batches_in(data) -> Optional[int]:
    try:
        return len(data) if isinstance(data, DataLoader) else None
    except TypeError:
        return None


# -- the single process -----------------------------------------------------------


def forward(model, predicting: Predicting, inputs: tuple, microbatches: int):
    """The model on one batch: its own micro-batched forward, or the batch
    split here into ``microbatches`` runs, the outputs joined (NOTE
    [Predicting in batches]); what the model returns, as it returns it."""
    if predicting.microbatches is not None or microbatches == 1:
        return model(*inputs)
    training = predicting.training
    dims = training.batch_dims[: len(training.inputs)]
    size = batch_size(inputs, dims)
    count = min(microbatches, size)
    runs = list(zip(*(split(x, d, size, count) for x, d in zip(inputs, dims))))
    found = [model(*run) for run in runs]
    single = not isinstance(found[0], tuple)
    found = [(f,) if single else f for f in found]
    layouts = predicting.output_dims or (0,) * len(found[0])
    sizes = [batch_size(run, dims) for run in runs]
    joined = []
    for k, layout in enumerate(layouts):
        parts = [f[k] for f in found]
        # no samples of its own: the same for every run
        joined.append(parts[0] if layout is None else join(parts, layout, sizes))
    return joined[0] if single else tuple(joined)


def predict(predicting: Predicting, argv: list[str] | None = None) -> None:
    """``predict_<name>.py``: load the weights, run the model over --data in
    batches, write its outputs to --out and print the loss where the data
    has targets."""
    training = predicting.training
    p = parser(predicting)
    args = p.parse_args(argv)
    check(p, args)
    check_devices(training, argv, f"predict_{training.run}.py")
    torch.manual_seed(args.seed)
    model = training.model()
    where = load_weights([model], list(model.state_dict()), training, args)
    model.eval()
    if args.microbatches is not None and predicting.microbatches is not None:
        setattr(model, predicting.microbatches, args.microbatches)
    microbatches = args.microbatches or 1
    data, given, named = read_data(training, args)
    args.batch_size = per_forward(data, args, training)
    threads.cap(args.threads, sys.stdout)  # the weights and data read
    n = len(training.inputs)
    scores = Scores(predicting) if given.targets else None
    loss_fns = training.losses(training.settings) if scores is not None else ()
    outputs = Outputs(predicting)
    progress = bar(batches_in(data) or _count(data, args.batch_size or 1))
    started, samples = time.perf_counter(), 0
    with torch.inference_mode():
        for batch in in_order(data, given, args, named):
            inputs, targets = batch[:n], batch[n:]
            size = batch_size(batch, given.batch_dims)
            with autocast(training.device_type, args.amp):
                found = forward(model, predicting, inputs, microbatches)
                if scores is not None:
                    loss, _ = training.forward_loss(
                        lambda *_: found, loss_fns, inputs, targets
                    )
            each = found if isinstance(found, tuple) else (found,)
            if scores is not None:
                scores.add(loss, each, targets, size)
            outputs.add(each, size)
            samples += size
            if progress is not None:
                progress.update(1)
    if progress is not None:
        progress.close()
    if not samples:
        sys.exit(f"{named}: gives no batch")
    said(training.name, samples, f"of {named} from {where}", started)
    if scores is not None:
        print(scores.line(predicting.outputs))
    finish(outputs.joined(), args.out)


def said(name: str, samples: int, what: str, started: float) -> None:
    """The run's line: how many samples went through, in how long, how fast."""
    seconds = time.perf_counter() - started
    print(
        f"{name}: {samples:,} samples {what} in {seconds:.2f} s "
        f"({samples / max(seconds, 1e-9):,.1f} samples/s)"
    )


def _count(data, size: int) -> Optional[int]:
    try:
        return -(-len(data) // size)
    except TypeError:
        return None


def finish(found: dict, out: Optional[str]) -> None:
    """Write the outputs (or, without --out, say what they are)."""
    if out and out.endswith(".npz"):  # numpy has no bfloat16: write() widens it
        found = {
            name: x.float() if x.dtype == torch.bfloat16 else x
            for name, x in found.items()
        }
    shapes = ", ".join(
        f"{name} {list(x.shape)} {str(x.dtype)[6:]}" for name, x in found.items()
    )
    if not out:
        print(f"outputs: {shapes} (give --out FILE to write them)")
        return
    try:
        write(found, out)
    except OSError as error:
        sys.exit(f"--out {out}: cannot write it ({error})")
    print(f"wrote {out}: {shapes}")


# -- the pipeline program ---------------------------------------------------------


def facts(stages: Stages) -> Predicting:
    """predict_<name>.py's facts, beside pp_<name>.py (the same build's)."""
    import importlib

    name = f"predict_{stages.training.run}"
    try:
        return importlib.import_module(name).PREDICTING
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
        sys.exit(
            f"pp_{stages.training.run}.py --predict needs {name}.py beside it (rebuild)"
        )


def padded(batch: tuple, dims: tuple, size: int, whole: int) -> tuple:
    """A batch of ``size`` samples made ``whole`` by copies of its last sample
    (the pipeline's micro-batches are equal: NOTE [Predicting in batches])."""
    if size == whole:
        return batch
    found = []
    for x, d in zip(batch, dims):
        if x is None or d is None:
            found.append(x)
            continue
        if isinstance(d, tuple):
            k, place = d
            grouped = x.unflatten(k, (size, -1) if place == 0 else (-1, size))
            last = grouped.narrow(k + place, size - 1, 1)
            more = last.expand(
                *[whole - size if i == k + place else -1 for i in range(grouped.dim())]
            )
            found.append(torch.cat([grouped, more], k + place).flatten(k, k + 1))
            continue
        last = x.narrow(d, size - 1, 1)
        more = last.expand(*[whole - size if i == d else -1 for i in range(x.dim())])
        found.append(torch.cat([x, more], d))
    return tuple(found)


def pipeline(stages: Stages, argv: list[str]) -> None:
    """``pp_<name>.py --predict ...`` under torchrun: a rank per stage, the
    weights each rank's keys of the checkpoint, torch's forward-only
    schedule (ScheduleGPipe's eval) over the batches in order, the first
    stage's rank reading the inputs and the last stage's the targets; that
    rank gathers the outputs and writes --out."""
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    from . import launch, mesh
    from .pipeline import examples, sendable

    predicting = facts(stages)
    training = predicting.training
    p = parser(predicting, stages)
    args = p.parse_args(argv)
    check(p, args)
    count = len(stages.stages)
    m = args.microbatches or stages.microbatches
    device = launch.check_devices(stages)
    command = f"torchrun --nproc-per-node {count} {stages.script} --predict ..."
    if "RANK" not in environ:
        mesh.stop(f"run it under torchrun: {command}")
    if int(environ["WORLD_SIZE"]) != count:
        mesh.stop(
            f"--predict runs {count} stages on {count} ranks, but torchrun started "
            f"{environ['WORLD_SIZE']}: {command}"
        )
    threads.cap(args.threads, sys.stdout if environ["RANK"] == "0" else None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    wait = timedelta(seconds=args.timeout)
    dist.init_process_group(backend, timeout=wait, **launch.attempt_store(wait))
    try:
        grid = mesh.make(stages, list(range(count)), 1, device.type, args.timeout)
        (k,) = grid.mine
        first, last = k == 0, k == count - 1
        torch.manual_seed(args.seed)
        module = stages.stages[k]().to(device)
        with torch.device("meta"):
            keys = [key for stage in stages.stages for key in stage().state_dict()]
        where = load_weights(
            [module], list(dict.fromkeys(keys)), training, args, mesh.stop
        )
        module.eval()
        n = len(training.inputs)
        dims = training.batch_dims[:n]
        # The first and last ranks read the data (inputs; targets), in the same order.
        # The micro-batches are equal: each batch is padded to ``whole``, a multiple of m.
        shapes, stream, given, named = [None, 0, 0], None, training, ""
        if first or last:
            data, given, named = read_data(training, args)
            args.batch_size = per_forward(data, args, training)
            stream = in_order(data, given, args, named)
            batch = next(stream, None)
            if batch is None:
                mesh.stop(f"{named}: gives no batch")
            stream = _chain(batch, stream)
            size = batch_size(batch, given.batch_dims)
            # a DataLoader's batches are its own: its first one's size
            most = size if isinstance(data, DataLoader) else args.batch_size
            whole = -(-most // m) * m
            inputs = padded(batch[:n], dims, size, whole)
            shapes = [[(tuple(x.shape), x.dtype) for x in inputs], bool(given.targets)]
            shapes.append((most, whole))
        dist.broadcast_object_list(shapes, src=0)
        most, whole = shapes[2]
        found = examples(stages, shapes[0], m)
        given_in, made = found[k]
        if not last:
            module.register_forward_hook(sendable(tuple(x.dtype for x in made)))
        stage = PipelineStage(
            module, k, count, device, given_in, made, group=grid.pp_group
        )
        chunks = [TensorChunkSpec(d) if d is not None else _Replicate() for d in dims]
        schedule = pipelining.ScheduleGPipe(stage, m, args_chunk_spec=tuple(chunks))
        # The last stage keeps each micro-batch's outputs (stage.output_chunks),
        # joined here along each output's layout, not by torch's merge (dim 0).
        schedule._merge_outputs = lambda chunks: None
        scores = Scores(predicting) if last and shapes[1] else None
        loss_fns = training.losses(training.settings) if scores is not None else ()
        outputs = Outputs(predicting)
        progress = bar(None) if last else None
        started, samples = time.perf_counter(), 0
        with torch.inference_mode():
            while True:
                batch = next(stream, None) if stream is not None else None
                more = [batch is not None]
                dist.broadcast_object_list(more, src=0)
                if not more[0]:
                    break
                size = batch_size(batch, given.batch_dims) if batch is not None else 0
                if batch is not None and size > most:
                    mesh.stop(
                        f"{named}: a batch of {size} samples after one of {most}; the stages "
                        "take one shape (give --batch-size)"
                    )
                inputs = ()
                if first:
                    inputs = padded(batch[:n], dims, size, whole)
                    if [(tuple(x.shape), x.dtype) for x in inputs] != shapes[0]:
                        mesh.stop(
                            f"{named}: a batch shaped {[list(x.shape) for x in inputs]}, where the "
                            f"first was {[list(s) for s, _ in shapes[0]]}; the stages take one shape"
                        )
                    inputs = tuple(x.to(device) for x in inputs)
                with autocast(device.type, args.amp):
                    schedule.eval(*inputs)
                if not last:
                    continue
                each = _joined(stage.output_chunks, predicting, whole // m)
                each = tuple(
                    first_samples(x, d, whole, size)
                    for x, d in zip(each, predicting.output_dims or (0,) * len(each))
                )
                each = tuple(x.to("cpu") for x in each)
                if scores is not None:
                    targets = tuple(t for t in batch[n:])
                    raw = each if len(each) > 1 else each[0]
                    loss, _ = stages.loss(raw, torch.arange(size), targets, loss_fns, 1)
                    scores.add(loss, each, targets, size)
                outputs.add(each, size)
                samples += size
                if progress is not None:
                    progress.update(1)
        if progress is not None:
            progress.close()
        if last:
            said(
                training.name,
                samples,
                f"of {named} through {count} stages from {where}",
                started,
            )
            if scores is not None:
                print(scores.line(predicting.outputs))
            finish(outputs.joined(), args.out)
        dist.barrier()
    finally:
        launch.stop_beating()
        if dist.is_initialized():
            dist.destroy_process_group()


def _chain(head, rest):
    yield head
    yield from rest


def _joined(chunks: list, predicting: Predicting, micro: int) -> tuple:
    """The last stage's micro-batch outputs (``micro`` samples each) joined into the batch's."""
    chunks = [c if isinstance(c, tuple) else (c,) for c in chunks]
    layouts = predicting.output_dims or (0,) * len(chunks[0])
    sizes = [micro] * len(chunks)
    return tuple(
        (
            join([c[j] for c in chunks], layout, sizes)
            if layout is not None
            else chunks[0][j]
        )
        for j, layout in enumerate(layouts)
    )
