"""Experiment trackers beside log.csv and TensorBoard: Weights & Biases and
MLflow, where asked for (``--logger wandb``, ``--logger mlflow``, or the
environment's ``MPGEN_LOGGER=wandb,mlflow``) and installed. Each is given
the run's settings once and every row the log writes, under TensorBoard's
tags (``train/loss``, ``eval/accuracy``). Their own environment settings
apply: ``WANDB_MODE=offline``, ``WANDB_PROJECT``, ``MLFLOW_TRACKING_URI``
(default ``./mlruns``), ``MLFLOW_EXPERIMENT_NAME``."""

from __future__ import annotations

import importlib.util
import os

#: --logger's choices, and the package each needs.
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}


def chosen(args) -> list[str]:
    """The trackers asked for: --logger, else MPGEN_LOGGER (comma-separated)."""
    given = getattr(args, "logger", None) or [
        name.strip()
        for name in os.environ.get("MPGEN_LOGGER", "").split(",")
        if name.strip()
    ]
    return list(dict.fromkeys(given))


def missing(names: list[str]) -> str | None:
    """What is wrong with the trackers asked for, in one line; None: nothing."""
    for name in names:
        if name not in PACKAGES:
            return f"--logger {name}: expected one of {', '.join(PACKAGES)}"
        try:
            found = importlib.util.find_spec(PACKAGES[name])
        except ValueError:  # in sys.modules as None: not importable
            found = None
        if found is None:
            return (
                f"--logger {name}: the {PACKAGES[name]} package is not installed "
                f"(pip install {'mlflow-skinny' if name == 'mlflow' else name})"
            )
    return None


def check(parser, args) -> None:
    """Stop with the parser's one line when a tracker asked for is missing."""
    problem = missing(chosen(args))
    if problem:
        parser.error(problem)


class WandB:
    """A W&B run in the log folder (offline with WANDB_MODE=offline)."""

    def __init__(self, folder, name: str) -> None:
        import wandb

        project = os.environ.get("WANDB_PROJECT", name)
        self.run = wandb.init(project=project, name=name, dir=str(folder))

    def config(self, settings: dict) -> None:
        self.run.config.update(settings, allow_val_change=True)

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run (under MLFLOW_TRACKING_URI, default ./mlruns)."""

    def __init__(self, folder, name: str) -> None:
        import mlflow

        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=name)

    def config(self, settings: dict) -> None:
        # MLflow's parameters are text of at most 6000 characters.
        flat = {k: str(v)[:6000] for k, v in settings.items()}
        self.mlflow.log_params(flat)

    def log(self, values: dict, step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def start(names: list[str], folder, name: str, stop) -> list:
    """The trackers ``names`` asks for, each started for the run ``name``;
    ``stop`` says in one line why one cannot start (its own settings: a
    tracking URI it refuses, a W&B run without a login and not offline)."""
    made, started = {"wandb": WandB, "mlflow": MLflow}, []
    for tracker in names:
        try:
            started.append(made[tracker](folder, name))
        except Exception as error:  # the tracker's own: say its first line
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            stop(f"--logger {tracker}: cannot start ({type(error).__name__}: {first})")
    return started
