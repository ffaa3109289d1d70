"""``pipeline:`` -> :class:`~mpgen.compiler.ir.PipelineConfig`, with positions.

What the spec alone decides is checked here: the schedule's name, that some
input has a batch dim to split, that the replicas (``dp``) share the training
batch equally and that each micro-batch gets at least one sample of a
replica's share. Whether the outputs can be put back together, the
checkpointed devices are used and the layout suits the schedule needs the
inferred shapes and the layout (``placement.pipelining``).
"""

from __future__ import annotations

from typing import Optional

from mpgen.compiler.ir import Graph, PipelineConfig
from mpgen.errors import Collector, did_you_mean, shown
from mpgen.spec_schema.load import SourceMap
from mpgen.spec_schema.models import PipelineSpec


def resolve_pipeline(spec: Optional[PipelineSpec], graph: Graph,
                     source: SourceMap) -> Optional[PipelineConfig]:
    """The pipeline settings (None: the plain forward); raises MpgenError."""
    if spec is None:
        return None
    errors = Collector()
    schedules = PipelineConfig.SCHEDULES
    if spec.schedule not in schedules:
        hint = (did_you_mean(spec.schedule, schedules)
                or f" (expected one of {', '.join(schedules)})")
        errors.add(source.value(("pipeline", "schedule")), f"pipeline.schedule: unknown "
                   f"schedule {shown(spec.schedule)}{hint}")
    if not any(t.type.batch_dim is not None for t in graph.inputs):
        errors.add(source.key(("pipeline",)), "pipeline: the forward splits its inputs along "
                   "their batch dim into micro-batches, but no input has a 'batch' dim "
                   f"({', '.join(f'{t.name} {t.type}' for t in graph.inputs)})")
    batch = dict(graph.train.dims).get("batch") if graph.train else None
    if batch is not None and batch % spec.dp:
        errors.add(source.value(("pipeline", "dp")), f"pipeline.dp: {spec.dp} replicas cannot "
                   f"share a training batch of {batch} equally; use a divisor of {batch}, or "
                   "another train.batch_size")
    elif batch is not None and spec.microbatches > batch // spec.dp:
        part = batch // spec.dp
        of = (f"a training batch of {batch}" if spec.dp == 1 else
              f"a replica's {part} samples (a training batch of {batch} over {spec.dp} replicas)")
        errors.add(source.value(("pipeline", "microbatches")), f"pipeline.microbatches: "
                   f"{spec.microbatches} micro-batches of {of} would "
                   f"leave some empty; use at most {part}, or a larger train.batch_size")
    twice = [d for i, d in enumerate(spec.checkpoint) if d in spec.checkpoint[:i]]
    for device in dict.fromkeys(twice):
        index = len(spec.checkpoint) - 1 - spec.checkpoint[::-1].index(device)
        errors.add(source.value(("pipeline", "checkpoint", index)),
                   f"pipeline.checkpoint: {device!r} is listed twice")
    errors.raise_if_any()
    return PipelineConfig(
        microbatches=spec.microbatches,
        schedule=spec.schedule,
        dp=spec.dp,
        sync_bn=spec.sync_bn,
        checkpoint=tuple(spec.checkpoint),
        pos=source.key(("pipeline",)),
        schedule_pos=source.value(("pipeline", "schedule")),
        checkpoint_pos=tuple(source.value(("pipeline", "checkpoint", i))
                             for i in range(len(spec.checkpoint))),
    )
