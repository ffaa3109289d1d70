"""bench/gpu_pipeline.py, the GPU experiment, run here in its CPU smoke mode.

``--device cpu`` runs the script's GPU code on virtual CUDA devices: the
seed example (two devices) with a BatchNorm built as one GPU, the naive
split and micro-batched, each measured (or failing, or refused by mpgen, as
a row saying so), in a markdown table on stdout and in --out.
With ``--gpus 1`` the split builds run merged onto cuda:0 beside a control.
Without GPUs and without --device cpu it says so and exits 0; a bad spec is
``FILE:LINE:COL: message`` and exit 2 with nothing written.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import sys

import pytest

from helpers import ROOT, write_spec

pytestmark = pytest.mark.slow  # runs generated scripts (subprocesses, torchrun) or builds many specs

SCRIPT = ROOT / "bench" / "gpu_pipeline.py"


def load_script():
    """The script as a module (registered: its dataclasses look themselves up)."""
    spec = importlib.util.spec_from_file_location("gpu_pipeline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_script(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = load_script().main([str(a) for a in argv])
    return status, out.getvalue(), err.getvalue()


def table(report: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The markdown table's header and its rows by their first cell."""
    lines = [line for line in report.splitlines() if line.startswith("|")]
    split = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    header, rows = split[0], split[2:]
    return header, {row[0]: dict(zip(header, row)) for row in rows}


def ms(cell: str) -> float:
    assert cell.endswith(" ms"), cell
    return float(cell[:-3])


def speedup(cell: str) -> float:
    assert cell.endswith("x"), cell
    return float(cell[:-1])


#: The seed example with a BatchNorm: a micro-batch of one sample fails in training.
SPEC = """
    mpgen: 1
    name: SimpleModel
    inputs:
      x: [batch, 10]
    layers:
      layer1: {op: Linear, args: [10, 20]}
      norm: {op: BatchNorm1d, args: [20]}
      layer2: {op: Linear, args: [20, 10]}
    placement:
      layer1: cuda:0
      layer2: cuda:1
    train:
      loss: MSELoss
      optimizer: {op: SGD, lr: 0.01}
      batch_size: 5
    """


def smoke(folder, *extra):
    spec, out = write_spec(folder, SPEC), folder / "report.md"
    status, stdout, stderr = run_script("--device", "cpu", "--spec", spec, "--batch", "8",
                                        "--microbatches", "2,8,16", "--warmup", "1",
                                        "--repeats", "2", "--out", out, *extra)
    return status, stdout, stderr, out


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory):
    return smoke(tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return smoke(tmp_path_factory.mktemp("one"), "--gpus", "1")


def test_smoke_run_measures_one_gpu_naive_split_and_micro_batched(two_devices):
    status, stdout, stderr, out = two_devices
    assert status == 0, stderr
    assert out.read_text(encoding="utf-8") == stdout
    header, rows = table(stdout)
    assert header == ["run", "time per batch", "vs one GPU", "peak cuda:0", "peak cuda:1",
                      "simulator: time per batch", "simulator: vs one GPU"]
    assert list(rows) == ["one GPU", "naive split over 2 GPUs", "micro-batched, M = 2",
                          "micro-batched, M = 8", "micro-batched, M = 16"]
    one, split = rows["one GPU"], rows["naive split over 2 GPUs"]
    micro = rows["micro-batched, M = 2"]
    for row in (one, split, micro):
        assert ms(row["time per batch"]) > 0
        assert speedup(row["vs one GPU"]) > 0
    assert one["vs one GPU"] == "1.00x"
    # The one-GPU build lives on cuda:0 alone; the split uses both devices.
    assert one["peak cuda:1"] == "0 B" and one["peak cuda:0"] != "0 B"
    assert split["peak cuda:0"] != "0 B" and split["peak cuda:1"] != "0 B"
    assert micro["peak cuda:1"] != "0 B"
    # The simulator: one GPU is itself; two equal Linear stages at M = 2 gain.
    assert one["simulator: time per batch"] == one["time per batch"]
    assert one["simulator: vs one GPU"] == "1.00x"
    assert speedup(split["simulator: vs one GPU"]) <= 1.0
    assert 1.2 < speedup(micro["simulator: vs one GPU"]) < 1.4


def test_a_layout_that_would_fail_when_run_is_refused_at_build(two_devices, one_device):
    """M = 8 gives BatchNorm1d one sample per micro-batch: the build refuses
    it (it checks the model at a micro-batch's sizes), so it is a row and a
    note, never a run that fails."""
    for (_, stdout, _, _), label in ((two_devices, "micro-batched, M = 8"),
                                     (one_device, "micro-batched, M = 8, all on cuda:0")):
        _, rows = table(stdout)
        assert rows[label]["time per batch"] == "not built (see below)"
        assert rows[label]["vs one GPU"] == ""
        note = next(line for line in stdout.splitlines()
                    if line.startswith("- not built") and "M = 8" in line)
        assert "BatchNorm1d(20)" in note


def test_a_micro_batch_count_mpgen_refuses_is_a_row_and_a_note(two_devices):
    status, stdout, _, _ = two_devices
    _, rows = table(stdout)
    assert rows["micro-batched, M = 16"]["time per batch"] == "not built (see below)"
    note = next(line for line in stdout.splitlines()
                if line.startswith("- not built") and "M = 16" in line)
    assert "16 micro-batches of a training batch of 8" in note
    assert "/tmp" not in note  # the temporary variant's position is left out


def test_with_one_gpu_the_split_builds_run_merged_beside_a_control(one_device):
    status, stdout, stderr, out = one_device
    assert status == 0, stderr
    assert out.read_text(encoding="utf-8") == stdout
    header, rows = table(stdout)
    assert [h for h in header if h.startswith("peak")] == ["peak cuda:0"]
    assert list(rows) == ["one GPU", "one GPU under merged_devices (control)",
                          "naive split, all on cuda:0", "micro-batched, M = 2, all on cuda:0",
                          "micro-batched, M = 8, all on cuda:0",
                          "micro-batched, M = 16, all on cuda:0"]
    assert rows["one GPU under merged_devices (control)"]["vs one GPU"] == "1.00x"
    for label in ("naive split, all on cuda:0", "micro-batched, M = 2, all on cuda:0"):
        assert ms(rows[label]["time per batch"]) > 0
        assert rows[label]["peak cuda:0"] != "0 B"
    # What the simulator predicts on the layout's two devices stands beside.
    assert speedup(rows["micro-batched, M = 2, all on cuda:0"]["simulator: vs one GPU"]) > 1.2
    assert "Fewer GPUs than the layout needs" in stdout
    summary = [line for line in stdout.splitlines()
               if line.startswith("- ") and line.endswith("over the control")]
    assert summary[0].startswith("- the generated transfers (same-device .to): ")
    assert summary[1].startswith("- 2 micro-batches and the transfers: ")


def test_without_gpus_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / "report.md"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, SCRIPT, "--out", out], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "gpu_pipeline: no CUDA GPU visible, nothing measured "
        "(--device cpu runs a smoke test on the CPU)"]
    assert not out.exists()


def test_a_bad_spec_is_its_line_and_exit_2_with_nothing_written(tmp_path):
    spec = write_spec(tmp_path, """
        mpgen: 1
        name: Bad
        inputs:
          x: [batch, 10]
        layers:
          layer1: {op: Linaer, args: [10, 20]}
        train:
          loss: MSELoss
          optimizer: {op: SGD, lr: 0.01}
          batch_size: 5
        """)
    out = tmp_path / "report.md"
    status, stdout, stderr = run_script("--device", "cpu", "--spec", spec, "--out", out)
    assert status == 2
    assert stderr == (f"{spec}:6:16: layer 'layer1': unknown op 'Linaer' "
                      "(did you mean 'Linear'?)\n")
    assert stdout == "" and not out.exists()


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(io.StringIO()) as err:
        load_script().main(["--microbatches", "0,x"])
    assert exit_info.value.code == 2
    assert "expected positive integers like 2,4,6, got '0,x'" in err.getvalue()
