"""Batches: synthetic ones shaped from the spec, or tensors from a file, or
a user's Dataset or DataLoader, in an order that is a function of the seed
and the step (so a resumed run sees the data it would have seen)."""

from __future__ import annotations

import functools
import importlib
import itertools
import pathlib
import sys
from typing import Optional

import torch
from torch.utils.data import DataLoader, Dataset, Subset

DATA_FILES = (".pt", ".pth", ".npz", ".safetensors")
DATA_HELP = (
    "FILE.pt/.npz/.safetensors, or module:function returning a Dataset or DataLoader"
)


class SyntheticData(Dataset):
    """``samples`` samples of the spec's ``make_batch()``, sample ``i`` a pure
    function of ``seed`` and ``first + i``."""

    def __init__(self, training, samples: int, seed: int, first: int = 0) -> None:
        self.make_batch, self.dims = training.make_batch, training.batch_dims
        self.samples, self.seed, self.first = samples, seed, first

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(
                (self.seed * 1_000_003 + self.first + i) % 2**64
            )
            inputs, targets = self.make_batch(1)
        return tuple(
            t if t is None or d is None else t.select(d, 0)
            for t, d in zip((*inputs, *targets), self.dims)
        )


class TensorData(Dataset):
    """The spec's keys' tensors, samples along dim 0 (none for a key without a batch dim)."""

    def __init__(self, tensors: dict, where: str, training) -> None:
        keys, dims = training.keys, training.batch_dims
        missing = [key for key in keys if key not in tensors]
        if missing:
            sys.exit(
                f"{where}: no tensor {', '.join(missing)} (it has {', '.join(tensors) or 'none'})"
            )
        self.tensors = [torch.as_tensor(tensors[key]) for key in keys]
        self.dims = dims
        sizes = {len(t) for t, d in zip(self.tensors, dims) if d is not None}
        if len(sizes) > 1:
            sys.exit(
                f"{where}: the tensors hold different numbers of samples {sorted(sizes)}"
            )
        self.samples = sizes.pop() if sizes else 1

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple:
        return tuple(t if d is None else t[i] for t, d in zip(self.tensors, self.dims))


def read_tensors(path: pathlib.Path, lazy: bool = False) -> dict:
    """The tensors in a .pt/.pth (a dict of tensors), .npz or .safetensors
    file. ``lazy``: memory-mapped, so only the tensors used are read (a
    pipeline rank takes its stages' keys of a whole model's file)."""
    if path.suffix == ".npz":
        import numpy

        with numpy.load(path) as arrays:
            return {key: torch.from_numpy(arrays[key]) for key in arrays.files}
    if path.suffix == ".safetensors":
        try:
            import safetensors.torch
        except ModuleNotFoundError:
            raise ValueError("it needs safetensors: pip install safetensors") from None
        if lazy:
            return Lazy(path)
        return safetensors.torch.load_file(path)
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=lazy)
    except (
        RuntimeError
    ) as error:  # not a zip file (an old format, or damaged): read it whole
        if not lazy or "mmap" not in str(error):
            raise
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(tensors, dict):
        raise ValueError(f"expected a dict of tensors, got {type(tensors).__name__}")
    return tensors


class Lazy(dict):
    """A .safetensors file's keys, each tensor read when first asked for."""

    def __init__(self, path: pathlib.Path) -> None:
        from safetensors import safe_open

        self.file = safe_open(str(path), "pt")
        super().__init__(dict.fromkeys(self.file.keys()))

    def __getitem__(self, key: str) -> torch.Tensor:
        value = super().__getitem__(key)
        if value is None:
            value = self.file.get_tensor(key)
            self[key] = value
        return value

    def get(self, key, default=None):
        return self[key] if key in self else default


def one_line(error: BaseException) -> str:
    """``Type: message`` of an exception, on one line of at most 300 characters."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]


def load_data(source: str, kwargs: dict, flag: str, training) -> Dataset | DataLoader:
    """A file of tensors, or ``module:function`` called with ``kwargs``: a
    Dataset or a DataLoader. ``flag`` (--data, --eval-data) names it in errors."""
    if source.endswith(DATA_FILES):
        path = pathlib.Path(source)
        if not path.is_file():
            sys.exit(f"{flag}: no file {path}")
        try:
            tensors = read_tensors(path)
        except Exception as error:  # torch, numpy and safetensors each raise their own
            sys.exit(f"{flag}: cannot read {path} ({one_line(error)})")
        return TensorData(tensors, str(path), training)
    module, colon, function = source.partition(":")
    if not (module and colon and function):
        sys.exit(
            f"{flag} {source}: expected a file ({', '.join(DATA_FILES)}) or module:function"
        )
    if "" not in sys.path and str(pathlib.Path.cwd()) not in sys.path:
        # modules of the working directory, as python -m does
        sys.path.insert(0, str(pathlib.Path.cwd()))
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is None or not f"{module}.".startswith(f"{error.name}."):
            raise  # the module is there, but what it imports is not: the traceback says where
        sys.exit(f"{flag} {source}: no module {error.name}")
    factory = vars(imported).get(function)
    if not callable(factory):
        sys.exit(f"{flag} {source}: {module} has no function {function}")
    data = factory(**kwargs)
    if not isinstance(data, (Dataset, DataLoader)):
        sys.exit(
            f"{flag} {source}: returned {type(data).__name__}, not a Dataset or DataLoader"
        )
    return data


def as_batch(batch, keys: tuple) -> tuple:
    """A batch (or sample) as a tuple in ``keys`` order: from a dict keyed by them, or a sequence in that order."""
    if isinstance(batch, dict):
        return tuple(batch.get(key) for key in keys)
    batch = tuple(batch)
    if len(batch) != len(keys):
        sys.exit(
            f"the data gives {len(batch)} items per sample; expected {len(keys)}: {', '.join(keys)}"
        )
    return batch


def collate(samples: list, training) -> tuple:
    """Stack samples into a batch, each tensor at its batch dim."""
    columns = zip(*(as_batch(sample, training.keys) for sample in samples))
    dims = training.batch_dims
    return tuple(
        (
            column[0]
            if d is None or column[0] is None
            else torch.stack([torch.as_tensor(x) for x in column], d)
        )
        for column, d in zip(columns, dims)
    )


def epoch_batches(data: Dataset | DataLoader, batch_size: int) -> int:
    """How many (micro-)batches one pass over ``data`` gives."""
    if isinstance(data, DataLoader):
        return len(data)
    return len(data) // batch_size


def batches(data: Dataset | DataLoader, training, args, first: int, shard=(0, 1)):
    """Batches from number ``first`` on, epoch after epoch: a Dataset in a
    shuffled order that is a function of --seed and the epoch (so resuming
    at any batch sees the same data), a DataLoader in its own order.

    ``shard`` ``(r, n)``: replica r of n data-parallel replicas takes the
    r-th of n equal parts of every batch (its samples only are loaded), so
    the n replicas together see each batch the single-process script sees."""
    keys, batch_size, seed = training.keys, args.batch_size, args.seed
    replica, replicas = shard
    per_epoch = epoch_batches(data, batch_size)
    epoch, skip = divmod(first, per_epoch)
    while True:
        generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**64)
        if isinstance(data, DataLoader):
            loader = (
                share(as_batch(batch, keys), training, replica, replicas)
                for batch in itertools.islice(data, skip, None)
            )
        else:
            order = torch.randperm(len(data), generator=generator)[
                skip * batch_size : per_epoch * batch_size
            ]
            part = batch_size // replicas
            order = order.view(-1, batch_size)[:, replica * part : (replica + 1) * part]
            loader = DataLoader(
                data,
                part,
                sampler=order.flatten().tolist(),
                collate_fn=functools.partial(collate, training=training),
                drop_last=True,
                num_workers=args.workers,
                pin_memory=torch.cuda.is_available(),
                generator=generator,
            )
        for batch in loader:
            yield as_batch(batch, keys)
        epoch, skip = epoch + 1, 0


def share(batch: tuple, training, replica: int, replicas: int) -> tuple:
    """Replica ``replica``'s part of a batch: its slice of each key's batch dim."""
    if replicas == 1:
        return batch
    parts = []
    for x, d in zip(batch, training.batch_dims):
        if x is None or d is None:
            parts.append(x)
            continue
        size = x.shape[d]
        if size % replicas:
            sys.exit(
                f"a batch of {size} samples does not split into {replicas} equal parts (--dp {replicas})"
            )
        part = size // replicas
        parts.append(x.narrow(d, replica * part, part))
    return tuple(parts)


def load_flag(training, args, flag: str) -> Dataset | DataLoader:
    """What --data or --eval-data (``flag``: "data", "eval_data") names, the
    spec's own factory with the spec's arguments for it."""
    source, spec = getattr(args, flag), getattr(training, f"{flag}_kwargs")
    kwargs = spec if source == training.default(flag) else {}
    return load_data(source, kwargs, f"--{flag.replace('_', '-')}", training)


def training_data(training, args) -> Dataset | DataLoader:
    """--data, else synthetic samples."""
    if not args.data:
        return SyntheticData(training, args.samples, args.seed)
    return load_flag(training, args, "data")


def split_data(
    training, args, parser, data
) -> tuple[Dataset | DataLoader, Optional[DataLoader]]:
    """The training data and the evaluation batches: --eval-data, a held-out
    --eval-split, or more synthetic samples for --eval-every (None: none)."""
    eval_data = None
    if args.eval_data:
        eval_data = load_flag(training, args, "eval_data")
    elif args.eval_split:
        if isinstance(data, DataLoader):
            parser.error(
                "--eval-split needs a Dataset; this --data gives a DataLoader (use --eval-data)"
            )
        held_out = torch.randperm(
            len(data), generator=torch.Generator().manual_seed(args.seed % 2**64)
        ).tolist()
        cut = int(len(held_out) * args.eval_split)
        data, eval_data = Subset(data, held_out[cut:]), Subset(data, held_out[:cut])
    elif args.eval_every and not args.data:
        size = max(args.samples // 10, args.batch_size)
        eval_data = SyntheticData(training, size, args.seed, first=args.samples)
    elif args.eval_every:
        parser.error("--eval-every needs --eval-data or --eval-split")
    if isinstance(eval_data, Dataset):
        collated = functools.partial(collate, training=training)
        size, workers = args.batch_size, args.workers
        eval_data = DataLoader(
            eval_data, size, collate_fn=collated, num_workers=workers
        )
    return data, eval_data
