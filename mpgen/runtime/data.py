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
        return tuple(one_sample(t, d) for t, d in zip((*inputs, *targets), self.dims))


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
        if 0 in (t.dim() for t, d in zip(self.tensors, dims) if d is not None):
            sys.exit(f"{where}: a key with samples along dim 0 holds one number")
        self.tensors = list(check_file(self.tensors, training, where))

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

        with numpy.load(path, allow_pickle=False) as arrays:
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


class Unstacked:
    """What collate gives for a key whose samples do not stack (it may run in a
    DataLoader worker, which cannot exit): check_batch says why, in the main process."""

    def __init__(self, why: str) -> None:
        self.why = why


def collate(samples: list, training) -> tuple:
    """Stack samples into a batch, each tensor at its batch dim (checked
    against the spec by :func:`check_batch` where the batch is used)."""
    columns = zip(*(as_batch(sample, training.keys) for sample in samples))
    dims = training.batch_dims
    batch = []
    for key, column, d in zip(training.keys, columns, dims):
        if d is None or column[0] is None:
            batch.append(column[0])
            continue
        try:
            batch.append(stack([torch.as_tensor(x) for x in column], d))
        except (RuntimeError, TypeError, ValueError) as error:  # shapes that differ
            why = f"the samples' {key} do not stack ({one_line(error)})"
            batch.append(Unstacked(why))
    return tuple(batch)


# -- batches of the spec's layout ---------------------------------------------------
#
# A key's batch dim is an int, None (no samples: the first sample's tensor
# stands for the batch), or for a target flattened with its samples
# (``[seq*batch]``) ``(dim, place)``: a sample is the product without the
# batch (``[seq]``), samples stack at ``dim + place`` and the two dims are
# flattened, so that sample b's values sit where the output's do.


def one_sample(x, d):
    """The one sample of a batch of one (``make_batch(1)``)."""
    if x is None or d is None:
        return x
    if isinstance(d, tuple):  # [R*1] is the sample [R] itself
        return x
    return x.select(d, 0)


def stack(column: list, d) -> torch.Tensor:
    """Samples stacked at batch dim ``d`` (a pair: stacked, then flattened)."""
    if isinstance(d, tuple):
        k, place = d
        return torch.stack(column, k + place).flatten(k, k + 1)
    return torch.stack(column, d)


def batch_size(batch: tuple, dims: tuple) -> Optional[int]:
    """The samples in a batch: the size of the first key's own batch dim."""
    for x, d in zip(batch, dims):
        if x is not None and isinstance(d, int):
            return x.shape[d]
    return None


def narrow(x: torch.Tensor, d, size: int, start: int, length: int) -> torch.Tensor:
    """Samples ``start`` to ``start + length`` of a batch of ``size``, along batch dim ``d``."""
    if isinstance(d, tuple):
        k, place = d
        split = x.unflatten(k, (size, -1) if place == 0 else (-1, size))
        return split.narrow(k + place, start, length).flatten(k, k + 1)
    return x.narrow(d, start, length)


# -- the spec's shapes and dtypes ---------------------------------------------------
#
# NOTE [Batches checked against the spec]: every batch (a file's tensors once,
# at load) is compared with the shapes and dtypes the spec states
# (Training.shapes, .dtypes) before the model runs: a dim named in the spec
# (batch, seq) takes one size across the batch's keys, a product
# (seq*batch) is the product of those, ? is any size; a dtype of the same
# kind (float64 for float32, int32 for int64) is converted, another kind is
# refused; a class-index target must hold classes in [0, C) or the loss's
# ignore_index, an input an Embedding reads indices below its rows, and a dim
# whose positions read a table of fixed rows (Training.dim_limits: a learned
# position Embedding) at most those rows. A mismatch is one line naming the data, the key, the spec's
# shape and the data's, and the script exits 1 (never a traceback from
# inside forward).


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "integer"


def shown(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _role(training, i: int) -> str:
    key = training.keys[i]
    if i < len(training.inputs):
        return f"input {key}"
    return "target" if key == "target" else f"target {key}"


def sample_shape(shape: tuple, d) -> tuple:
    """A spec shape without its batch: a sample's (a product loses its ``batch`` factor)."""
    if d is None:
        return shape
    if isinstance(d, tuple):
        k = d[0]
        rest = [f for f in str(shape[k]).split("*") if f != "batch"]
        return (*shape[:k], "*".join(rest) if rest else 1, *shape[k + 1 :])
    return shape[:d] + shape[d + 1 :]


def _fits(x: torch.Tensor, spec: tuple, sizes: dict) -> bool:
    """Whether ``x``'s shape is ``spec``'s, binding its named dims in ``sizes``."""
    if x.dim() != len(spec):
        return False
    later = []
    for size, dim in zip(x.shape, spec):
        if isinstance(dim, int) or str(dim).isdigit():
            if size != int(dim):
                return False
        elif dim == "?":
            continue
        elif "*" in dim:
            later.append((size, dim))
        elif sizes.setdefault(dim, size) != size:
            return False
    for size, dim in later:
        factors = dim.split("*")
        if all(f.isdigit() or f in sizes for f in factors):
            product = 1
            for f in factors:
                product *= int(f) if f.isdigit() else sizes[f]
            if product != size:
                return False
    return True


def _mismatch(training, i: int, x, spec, sizes: dict, where: str, file=None) -> str:
    """The line for key ``i`` not shaped as the spec says."""
    key, role = training.keys[i], _role(training, i)
    bound = ", ".join(
        f"{name} = {size}"
        for name, size in sizes.items()
        if any(name in str(d).split("*") for d in spec)
    )
    given = f" (with {bound} from the other keys)" if bound else ""
    if file is None:
        return f"{where}: {key} is {shown(x.shape)}; the spec's {role} is {shown(spec)}{given}"
    whole, d = training.shapes[i], training.batch_dims[i]
    per = "" if d is None else f", {len(file)} samples of {shown(x.shape)}"
    each = "" if d is None else f", a sample {shown(spec)}"
    return (
        f"{where}: {key} is {shown(file.shape)}{per}; the spec's {role} is "
        f"{shown(whole)}{each}{given}"
    )


def _check_tensors(
    tensors: list, training, where: str, specs: list, files=None
) -> list:
    """``tensors`` (a batch, or a file's first samples against ``specs``
    without the batch) checked, converted to the spec's dtypes."""
    sizes: dict = {}
    checked = []
    for i, x in enumerate(tensors):
        key = training.keys[i]
        if x is None:
            if "?" not in (str(d) for d in specs[i]):  # forward_loss makes only those
                sys.exit(
                    f"{where}: no {key} (the spec's {_role(training, i)} {shown(specs[i])})"
                )
            checked.append(x)
            continue
        if isinstance(x, Unstacked):
            sys.exit(f"{where}: {x.why}")
        if not isinstance(x, torch.Tensor):
            sys.exit(f"{where}: {key} is a {type(x).__name__}, not a tensor")
        before = dict(sizes)  # what the other keys bound
        if not _fits(x, specs[i], sizes):
            file = None if files is None else files[i]
            sys.exit(_mismatch(training, i, x, specs[i], before, where, file))
        checked.append(x)
    for dim, most, why in training.dim_limits:
        if sizes.get(dim, 0) > most:
            sys.exit(
                f"{where}: {dim} is {sizes[dim]:,}; the model takes {dim} up to {most:,}: {why}"
            )
    return checked


def _convert(x: torch.Tensor, training, i: int, where: str) -> torch.Tensor:
    """``x`` in the spec's dtype (of the same kind), else exit."""
    if x is None or i >= len(training.dtypes):
        return x
    want = getattr(torch, training.dtypes[i], None)
    if not isinstance(want, torch.dtype) or x.dtype == want:
        return x
    if _kind(x.dtype) != _kind(want):
        sys.exit(
            f"{where}: {training.keys[i]} is {str(x.dtype).removeprefix('torch.')}; the spec's "
            f"{_role(training, i)} is {training.dtypes[i]} ({_kind(want)} values)"
        )
    return x.to(want)


def _check_classes(x: torch.Tensor, training, i: int, where: str) -> None:
    """A class-index target's values in [0, C) or its ignore_index."""
    limits = training.classes[i] if i < len(training.classes) else None
    if x is None or limits is None or not x.numel():
        return
    classes, ignored = limits
    bad = (x < 0) | (x >= classes)
    if ignored is not None:
        bad &= x != ignored
    if bool(bad.any()):
        value = int(x[bad][0])
        if i < len(training.inputs):
            sys.exit(
                f"{where}: {training.keys[i]} holds {value}; the spec's {_role(training, i)} "
                f"indexes an Embedding of {classes:,} rows, so it takes 0 to {classes - 1:,}"
            )
        also = "" if ignored is None else f" or the ignore_index {ignored}"
        sys.exit(
            f"{where}: {training.keys[i]} holds class {value}; the spec's "
            f"{_role(training, i)} takes classes 0 to {classes - 1}{also}"
        )


def check_batch(batch: tuple, training, where: str) -> tuple:
    """A batch checked against the spec's shapes, dtypes and classes (NOTE
    [Batches checked against the spec]), in the spec's dtypes."""
    if not training.shapes:
        for x in batch:
            if isinstance(x, Unstacked):
                sys.exit(f"{where}: {x.why}")
        return batch
    checked = _check_tensors(list(batch), training, where, list(training.shapes))
    return tuple(_values_checked(checked, training, where))


def check_file(tensors: list, training, where: str) -> list:
    """A data file's tensors (samples along dim 0) checked by their first
    samples, then whole for dtypes and classes; converted."""
    if not training.shapes:
        return tensors
    specs = [sample_shape(s, d) for s, d in zip(training.shapes, training.batch_dims)]
    firsts = [t if d is None else t[0] for t, d in zip(tensors, training.batch_dims)]
    _check_tensors(firsts, training, where, specs, files=tensors)
    return _values_checked(tensors, training, where)


def _values_checked(tensors: list, training, where: str) -> list:
    """Each key converted to the spec's dtype, its class indices checked."""
    out = []
    for i, x in enumerate(tensors):
        x = _convert(x, training, i, where)
        _check_classes(x, training, i, where)
        out.append(x)
    return out


class Checked:
    """A user's DataLoader whose batches are checked as they come (evaluation data)."""

    def __init__(self, loader: DataLoader, training, where: str) -> None:
        self.loader, self.training, self.where = loader, training, where

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):  # the loader's own (dataset, batch_size)
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self):
        keys = self.training.keys
        for batch in self.loader:
            yield check_batch(as_batch(batch, keys), self.training, self.where)


def named(args, flag: str = "data") -> str:
    """How a message names --data's (or --eval-data's) source: a file by its
    path, a factory by the flag and its name, else the synthetic data."""
    source = getattr(args, flag, None)
    if not source:
        return "the synthetic data"
    return (
        source
        if source.endswith(DATA_FILES)
        else f"--{flag.replace('_', '-')} {source}"
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
    where = named(args)
    per_epoch = epoch_batches(data, batch_size)
    epoch, skip = divmod(first, per_epoch)
    while True:
        generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**64)
        if isinstance(data, DataLoader):
            loader = (
                share(
                    check_batch(as_batch(batch, keys), training, where),
                    training,
                    replica,
                    replicas,
                )
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
            yield check_batch(as_batch(batch, keys), training, where)
        epoch, skip = epoch + 1, 0


def share(batch: tuple, training, replica: int, replicas: int) -> tuple:
    """Replica ``replica``'s part of a batch: its slice of each key's batch dim."""
    if replicas == 1:
        return batch
    parts = []
    size = batch_size(batch, training.batch_dims)
    for x, d in zip(batch, training.batch_dims):
        if x is None or d is None:
            parts.append(x)
            continue
        if size is None:
            sys.exit(
                f"the batch has no key with a batch dim of its own to split (--dp {replicas})"
            )
        if size % replicas:
            sys.exit(
                f"a batch of {size} samples does not split into {replicas} equal parts (--dp {replicas})"
            )
        part = size // replicas
        parts.append(narrow(x, d, size, replica * part, part))
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


def no_evaluation(args, parser) -> Optional[str]:
    """The line to print once where the spec's ``eval_every`` finds no
    evaluation data (--data with neither --eval-data nor --eval-split): the
    run trains without evaluating; None where there is some, or no
    eval_every. --eval-every given so is a usage error."""
    if not args.eval_every or args.eval_data or args.eval_split or not args.data:
        return None
    if args.eval_every != parser.get_default("eval_every"):
        parser.error("--eval-every needs --eval-data or --eval-split")
    return (
        f"no evaluation data: the spec's eval_every {args.eval_every} evaluates nothing "
        "with --data alone (give --eval-data or --eval-split)"
    )


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
    else:
        no_evaluation(args, parser)  # --eval-every given so: a usage error
    if isinstance(eval_data, Dataset):
        collated = functools.partial(collate, training=training)
        size, workers = args.batch_size, args.workers
        eval_data = DataLoader(
            eval_data, size, collate_fn=collated, num_workers=workers
        )
    if eval_data is not None:
        where = named(args, "eval_data" if args.eval_data else "data")
        eval_data = Checked(eval_data, training, where)
    return data, eval_data
