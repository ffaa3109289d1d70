"""What a generated script says of its spec: the facts the runtime runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

#: Each flag's default where the spec says nothing (Training.defaults; None
#: for a flag not here): a train: section's defaults.
BASE_DEFAULTS = dict(seed=0, log_every=1, amp="off", grad_clip=0.0, accumulate=1)
BASE_DEFAULTS |= dict(eval_split=0.0, eval_every=0, samples=1024, workers=0)
BASE_DEFAULTS |= dict(keep_last=1, early_stop=0)


@dataclass(frozen=True)
class Training:
    """One model's training, as ``train_<name>.py`` states it: ``make_batch(batch_size)``
    gives synthetic ``(inputs, targets)``, ``forward_loss(model, loss_fns, inputs,
    targets)`` the loss and each output's ``(loss, output, target)``,
    ``optimizer(model, args)`` and ``scheduler(optimizer, args, steps)`` make them
    for a model or a stage; ``defaults``: the flags' defaults the spec sets."""

    model: Callable[[], Any]  # the model's class
    spec: str  # the spec the script was generated from
    devices: tuple[str, ...]  # the devices the model is placed on
    inputs: tuple[str, ...]  # a batch's keys: the model's inputs,
    targets: tuple[str, ...]  # then the losses' targets
    #: Each key's batch dim (None: none), or for a target whose batch sits
    #: inside a product (``[seq*batch]``) ``(dim, place)``: place 0 when the
    #: batch is its outer factor (``b*R + r``), 1 when its inner (``r*B + b``).
    batch_dims: tuple[Optional[int] | tuple[int, int], ...]
    make_batch: Callable
    losses: Callable[[dict], tuple]  # each output's loss, for the run's settings
    forward_loss: Callable
    optimizer: Optional[Callable] = None  # None: no parameters, nothing to train
    scheduler: Optional[Callable] = None
    closure: bool = False  # the optimizer's step recomputes the loss (LBFGS)
    ties: tuple = ()  # (key, owner's key): each tied parameter's two state-dict keys
    defaults: dict = field(default_factory=dict)
    #: Each key's shape as the spec states it, a dim a number or its name
    #: (``"batch"``, ``"seq*batch"``, ``"?"``: any), and its dtype: every batch
    #: is checked against them before the model runs (data.check_batch).
    shapes: tuple[tuple[int | str, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    #: Per key, a class-index target's ``(classes, ignore_index)``, or an
    #: input's ``(rows, None)`` where an Embedding reads it (None: neither).
    classes: tuple[Optional[tuple[int, Optional[int]]], ...] = ()
    #: ``(dim, largest size, why)``: a named dim whose positions read a table
    #: of fixed rows (a learned position Embedding): data past it is refused.
    dim_limits: tuple[tuple[str, int, str], ...] = ()
    data_kwargs: dict = field(default_factory=dict)  # for the spec's data factory
    #: The spec's ``train:`` section, resolved (each loss, optimizer and
    #: schedule a mapping with its ``op``): what ``--set`` changes, and the
    #: run's copy (``args.settings``) what the generated code reads.
    settings: dict = field(default_factory=dict)
    eval_data_kwargs: dict = field(default_factory=dict)
    #: The build's memory plan of this script's step: device -> peak bytes (--memory).
    memory: dict = field(default_factory=dict)
    #: The output each loss is of, in ``targets``' order, and its class dim
    #: (None: not a class-index loss): the log's columns and the metrics'.
    loss_outputs: tuple[str, ...] = ()
    class_dims: tuple[Optional[int], ...] = ()
    #: The evaluation's metrics (``metrics.Metric``), in the log's order.
    metrics: tuple = ()

    @property
    def name(self) -> str:
        return self.model.__name__

    @property
    def run(self) -> str:
        """runs/<run>: the default log folder, the model module's name."""
        return self.model.__module__

    @property
    def keys(self) -> tuple[str, ...]:
        return self.inputs + self.targets

    @property
    def eval_metrics(self) -> list[str]:
        """The columns of log.csv's evaluation rows, in order: what
        ``evaluate()`` returns and ``--monitor`` may name."""
        from .metrics import eval_columns

        return eval_columns(self)

    @property
    def device_type(self) -> str:
        """Where autocast applies: the type of the model's devices."""
        return "cuda" if any(d.startswith("cuda") for d in self.devices) else "cpu"

    def default(self, flag: str) -> Any:
        return self.defaults.get(flag, BASE_DEFAULTS.get(flag))


@dataclass(frozen=True)
class Stages:
    """The model as a pipeline, as ``pp_<name>.py`` states it: the stage
    classes in order with the device of each in the spec, the last stage's
    loss ``loss(outputs, index, targets, loss_fns, microbatches)`` (with each
    output's ``(loss, output, target)``, as ``forward_loss``), and the
    parameters tied across stages (the owner's ``(stage, key)``, then each
    copy's)."""

    training: Training
    stages: tuple[type, ...]
    devices: tuple[str, ...]
    loss: Callable
    ties: tuple[tuple[tuple[int, str], ...], ...] = ()
    schedule: str = "1f1b"  # --schedule's default
    microbatches: int = 2  # --microbatches' least (a divisor of the batch from it on)
    dp: int = 1  # --dp's default: replicas of the pipeline (data parallel)
    #: --sync-bn's default (NOTE [BatchNorm under data parallelism]).
    sync_bn: bool = False
    #: Each stage's forward and backward seconds for ONE sample, and each
    #: boundary's transfer seconds for one sample, at the cost model's speeds
    #: (compiler analysis.schedule.stage_times divided by the training batch):
    #: the simulator's inputs for the predicted bubble (empty: not predicted).
    costs: tuple[tuple[float, float], ...] = ()
    transfers: tuple[float, ...] = ()
    #: The hardware each stage's costs were measured on (``mpgen profile``;
    #: empty: the cost model's FLOPs at a nominal speed).
    measured_on: tuple[str, ...] = ()
    #: Training FLOPs of one sample (forward + backward, the cost model's
    #: matmuls and convolutions), for MFU (0: unknown).
    flops: float = 0.0
    #: The build's memory plan of each stage's device under the spec's
    #: schedule and micro-batches: device -> peak bytes (--memory).
    memory: dict = field(default_factory=dict)

    @property
    def script(self) -> str:
        return f"pp_{self.training.run}.py"

    @property
    def input_dims(self) -> tuple[Optional[int], ...]:
        return self.training.batch_dims[: len(self.training.inputs)]
