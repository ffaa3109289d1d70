"""What every benchmark table shares: timing a fresh interpreter, medians of
interleaved ratios, the markdown table, the machine and the versions."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
#: The baseline every process-level time is divided by.
IMPORT_TORCH = [PYTHON, "-c", "import torch"]


def cpu_seconds(argv: Sequence[str], cwd: Path | None = None) -> float:
    """CPU time (user + system) of a fresh process running ``argv``."""
    usage = run_process(argv, cwd)
    return usage.ru_utime + usage.ru_stime


def run_process(argv: Sequence[str], cwd: Path | None = None):
    """Run ``argv`` in a fresh process; its own resource usage (CPU times,
    ``ru_maxrss`` in KiB), from ``os.wait4``. Raises when it fails.

    CPU time rather than wall time: the machine is shared, and another
    process's work lengthens wall time but not this process's CPU time.
    Output goes to a temporary file (a pipe could fill up and block).
    """
    with tempfile.TemporaryFile() as out:
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        proc = subprocess.Popen(list(argv), cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            out.seek(0)
            tail = out.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{tail}")
    return usage


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def ratio(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table, the first column left-aligned, the others right."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    return "unknown"


def gpus() -> str:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return "no GPU"


def machine_lines() -> list[str]:
    """The page's header: machine, versions, date."""
    versions = ", ".join(f"{p} {version(p)}" for p in
                         ("torch", "mpgen", "black", "pydantic", "accelerate", "transformers"))
    return [
        f"- Machine: {cpu_model()}, {os.cpu_count()} cores, {memory_gib()} memory, "
        f"{platform.system()} {platform.release()}; {gpus()}.",
        f"- Versions: Python {platform.python_version()}, {versions}.",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.",
    ]
