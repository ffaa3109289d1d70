"""pp_<name>.py, the pipeline program: built for real, run for real under
torchrun (gloo, on the CPU; ``--standalone`` picks a free port).

The equality tests build one small spec whose layout visits cuda:0, cuda:1,
cuda:0, cuda:1 (four stages, so interleaved runs on two ranks), with an
integer input carried through stages that do not read it and a parameter
tied across stages; the single-process training script and the pipeline
start from the same weights (the script builds the model after
``torch.manual_seed(--seed)``; the test saves exactly that as --init) and
read the same --data file, and their losses, step by step, and final
weights must agree.
"""

from __future__ import annotations

import csv
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import build_to, import_generated, write_spec

pytestmark = pytest.mark.slow  # runs generated scripts (subprocesses, torchrun) or builds many specs

ROOT = Path(__file__).resolve().parents[2]
CPU = {"*": "cpu"}

PIPE = """
mpgen: 1
name: PipeNet

inputs:
  x: [batch, 8]
  ids: {shape: [batch], dtype: int64}

layers:
  l1: {op: Linear, args: [8, 16], in: x}
  a1: {op: Tanh}
  l2: {op: Linear, args: [16, 16]}
  emb: {op: Embedding, args: [10, 16], in: ids}
  add: {op: torch.add, in: [l2, emb]}
  l3: {op: Linear, args: [16, 16]}
  a3: {op: Tanh}
  l4: {op: Linear, args: [16, 16], tie: {weight: l3.weight}}

placement:
  l1: cuda:0
  l2: cuda:1
  emb: cuda:0
  l4: cuda:1

train:
  loss: MSELoss
  optimizer: {op: SGD, lr: 0.1}
  batch_size: 8
  steps: 3
"""


def torchrun(n: int, script: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(n), script.name, *args],
        cwd=script.parent, capture_output=True, text=True, timeout=timeout)


def losses(log: Path) -> list[float]:
    with log.open() as f:
        return [float(row["loss"]) for row in csv.DictReader(f) if row["loss"]]


@pytest.fixture(scope="module")
def pipe(tmp_path_factory) -> Path:
    """PipeNet built for the CPU, with a data file and the script's initial weights."""
    out = tmp_path_factory.mktemp("pipe")
    build_to(write_spec(out, PIPE), out, CPU)
    generator = torch.Generator().manual_seed(1)
    torch.save({"x": torch.randn(32, 8, generator=generator),
                "ids": torch.randint(0, 10, (32,), generator=generator),
                "target": torch.randn(32, 16, generator=generator)}, out / "data.pt")
    model = import_generated(out / "pipe_net.py")
    torch.manual_seed(0)  # as train_pipe_net.py --seed 0 does before building the model
    torch.save(model.PipeNet().state_dict(), out / "init.pt")
    single = subprocess.run(
        [sys.executable, "train_pipe_net.py", "--seed", "0", "--data", "data.pt", "--steps", "3",
         "--batch-size", "8", "--log-dir", "single", "--checkpoint", "single"],
        cwd=out, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    return out


def test_stages_hold_only_their_layers_with_the_models_keys(pipe):
    pp = import_generated(pipe / "pp_pipe_net.py")
    assert pp.STAGES.devices == ("cuda:0", "cuda:1", "cuda:0", "cuda:1")
    keys = [set(stage().state_dict()) for stage in pp.STAGES.stages]
    assert keys == [{"l1.weight", "l1.bias"}, {"l2.weight", "l2.bias"},
                    {"emb.weight", "l3.weight", "l3.bias"}, {"l4.weight", "l4.bias"}]
    model = import_generated(pipe / "pipe_net.py").PipeNet()
    assert set().union(*keys) == set(model.state_dict())
    # l4.weight is a copy of l3.weight, on another stage
    assert pp.STAGES.ties == (((2, "l3.weight"), (3, "l4.weight")),)


@pytest.mark.parametrize("schedule, ranks", [
    ("gpipe", 4), ("1f1b", 4), ("interleaved", 2), ("looped-bfs", 2), ("interleaved-zb", 2),
    ("zbv", 2), ("dualpipev", 2)])
def test_losses_equal_the_single_process_script(pipe, schedule, ranks):
    run = torchrun(ranks, pipe / "pp_pipe_net.py", "--schedule", schedule, "--steps", "3",
                   "--batch-size", "8", "--microbatches", "4", "--data", "data.pt",
                   "--init", "init.pt", "--log-dir", schedule, "--checkpoint", schedule)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 3/3  loss" in run.stdout
    # Every schedule's bubble is predicted (1f1b's was dropped: torch's order of it is shifted).
    assert "predicts a bubble of " in run.stdout + run.stderr, run.stdout
    expected = losses(pipe / "single" / "log.csv")
    assert losses(pipe / schedule / "log.csv") == pytest.approx(expected, rel=1e-5, abs=1e-7)
    # The merged stages load into the single-process model and equal its weights.
    merged = pipe / f"{schedule}.pt"
    done = subprocess.run([sys.executable, "pp_pipe_net.py", "--merge", schedule, merged.name],
                          cwd=pipe, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    state = torch.load(merged, weights_only=True)
    model = import_generated(pipe / "pipe_net.py").PipeNet()
    model.load_state_dict(state, strict=True)
    single = torch.load(pipe / "single" / "last.pt", weights_only=True)["model"]
    for key, value in single.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
    # The tied copies stayed equal, and moved: their gradients were summed.
    assert torch.equal(state["l3.weight"], state["l4.weight"])
    assert not torch.equal(state["l3.weight"], torch.load(pipe / "init.pt")["l3.weight"])


def test_tied_copies_stay_tied_over_replicas(pipe):
    # 4 stages interleaved on 2 ranks, x 2 replicas (FSDP shards the copies alike).
    run = torchrun(4, pipe / "pp_pipe_net.py", "--schedule", "interleaved", "--dp", "2",
                   "--steps", "3", "--batch-size", "8", "--microbatches", "2", "--data", "data.pt",
                   "--init", "init.pt", "--checkpoint", "tied_dp")
    assert run.returncode == 0, run.stderr[-3000:]
    expected = losses(pipe / "single" / "log.csv")
    assert losses(pipe / "tied_dp" / "log.csv") == pytest.approx(expected, rel=1e-5, abs=1e-7)
    done = subprocess.run([sys.executable, "pp_pipe_net.py", "--merge", "tied_dp", "tied_dp.pt"],
                          cwd=pipe, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    state = torch.load(pipe / "tied_dp.pt", weights_only=True)
    assert torch.equal(state["l3.weight"], state["l4.weight"])
    single = torch.load(pipe / "single" / "last.pt", weights_only=True)["model"]
    torch.testing.assert_close(state["l3.weight"], single["l3.weight"], rtol=1e-5, atol=1e-6)


SCHEDULE_RANKS = {"gpipe": 4, "1f1b": 4, "interleaved": 2, "looped-bfs": 2,
                  "interleaved-zb": 2, "zbv": 2, "dualpipev": 2}


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("schedule", list(SCHEDULE_RANKS))
def test_every_dp_mode_and_schedule_equals_the_single_process_script(pipe, schedule, mode):
    # Two replicas: the split backward of interleaved-zb, zbv and dualpipev
    # (torch.autograd.grad) never reached DDP's reducer; its gradients were not averaged.
    name = f"dp_{mode}_{schedule}"
    run = torchrun(2 * SCHEDULE_RANKS[schedule], pipe / "pp_pipe_net.py", "--schedule", schedule,
                   "--dp", "2", "--dp-mode", mode, "--steps", "3", "--batch-size", "8",
                   "--microbatches", "4", "--data", "data.pt", "--init", "init.pt",
                   "--checkpoint", name)
    assert run.returncode == 0, run.stderr[-3000:]
    assert losses(pipe / name / "log.csv") == pytest.approx(
        losses(pipe / "single" / "log.csv"), rel=1e-5, abs=1e-7)
    done = subprocess.run([sys.executable, "pp_pipe_net.py", "--merge", name, f"{name}.pt"],
                          cwd=pipe, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    state = torch.load(pipe / f"{name}.pt", weights_only=True)
    single = torch.load(pipe / "single" / "last.pt", weights_only=True)["model"]
    for key, value in single.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_another_model_is_one_line(pipe, padded):
    # A checkpoint of PipeNet at step 3 (of its own: this test may run alone).
    made = torchrun(2, pipe / "pp_pipe_net.py", "--schedule", "interleaved", "--steps", "3",
                    "--batch-size", "8", "--microbatches", "2", "--data", "data.pt", "--init",
                    "init.pt", "--checkpoint", "other_model", "--log-dir", "other_model")
    assert made.returncode == 0, made.stderr[-3000:]
    run = torchrun(2, padded / "pp_padded_lm.py", "--steps", "1", *PADDED, "--checkpoint",
                   str(pipe / "other_model"), "--resume")
    assert run.returncode != 0
    # What differs, in one line: its keys the model lacks, the model's keys it lacks.
    assert re.search(r"--resume: \S+step_3 does not match this model and optimizer: "
                     r"\d+ missing \(model\.\S+, .*; \d+ unexpected \(model\.l3\.bias, .*; "
                     r"\d+ of another shape \(model\.emb\.weight 10x16 there vs 50x16 here, ",
                     run.stderr), run.stderr[-3000:]
    assert "[rank0]: Traceback" not in run.stderr  # a worker's (torchrun's own follows)


TWO_STAGES = PIPE.replace("""placement:
  l1: cuda:0
  l2: cuda:1
  emb: cuda:0
  l4: cuda:1
""", """placement:
  l1: cuda:0
  l3: cuda:1
""")


def test_a_checkpoint_resumes_onto_more_stages_and_back(pipe, tmp_path):
    # The same model built as 2 stages (1f1b on 2 ranks) and as 4 (interleaved
    # and zbv on 2 ranks): one checkpoint goes from 4 stages to 2 and back to 4,
    # and the run is the single-process script's.
    build_to(write_spec(tmp_path, TWO_STAGES), tmp_path, CPU)
    assert len(import_generated(tmp_path / "pp_pipe_net.py").STAGES.stages) == 2
    ck = str(tmp_path / "ck")
    common = ("--batch-size", "8", "--microbatches", "4", "--data", str(pipe / "data.pt"),
              "--checkpoint", ck, "--timeout", "60")
    first = torchrun(2, pipe / "pp_pipe_net.py", "--schedule", "interleaved", "--steps", "1",
                     "--init", "init.pt", *common)
    assert first.returncode == 0, first.stderr[-3000:]
    fewer = torchrun(2, tmp_path / "pp_pipe_net.py", "--schedule", "1f1b", "--steps", "2",
                     "--resume", *common)
    assert fewer.returncode == 0, fewer.stderr[-3000:]
    assert "at step 1 (resharded onto 2 x 1 ranks)" in fewer.stdout
    more = torchrun(2, pipe / "pp_pipe_net.py", "--schedule", "zbv", "--steps", "3", "--resume",
                    *common)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "at step 2 (resharded onto 2 x 1 ranks)" in more.stdout
    expected = losses(pipe / "single" / "log.csv")
    assert losses(tmp_path / "ck" / "log.csv") == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_a_checkpoint_folder_whose_metadata_runs_code_is_refused_in_one_line(pipe, tmp_path):
    step = tmp_path / "evil" / "step_1"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("step 1\n")
    marker = tmp_path / "ran"
    (step / ".metadata").write_bytes(
        b"cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR.")  # pickle: os.system(...)
    refused = ("cannot read {}/step_1 (Refused: its .metadata names os.system, which a "
               "checkpoint's metadata never holds: refused (not unpickled))")
    merged = subprocess.run([sys.executable, "pp_pipe_net.py", "--merge", str(step.parent),
                             str(tmp_path / "merged.pt")],
                            cwd=pipe, capture_output=True, text=True, timeout=600)
    assert merged.returncode == 1
    assert merged.stderr == "--merge: " + refused.format(step.parent) + "\n"
    resumed = torchrun(4, pipe / "pp_pipe_net.py", "--steps", "2", "--data", "data.pt",
                       "--checkpoint", str(step.parent), "--resume")
    assert resumed.returncode != 0
    assert "--resume: " + refused.format(step.parent) + "\n" in resumed.stderr, resumed.stderr
    assert "[rank0]: Traceback" not in resumed.stderr
    assert not marker.exists() and not (tmp_path / "merged.pt").exists()


def test_bf16_autocast_crosses_stages_in_the_models_dtype(pipe):
    # Under autocast the stages compute in bfloat16 and send what the next stage
    # expects (float32, the model's dtype): losses as the single-process script's
    # under the same autocast, within bfloat16's precision (before, the bytes of
    # bfloat16 outputs were read as float32 and the loss blew up).
    single = subprocess.run(
        [sys.executable, "train_pipe_net.py", "--seed", "0", "--data", "data.pt", "--steps", "3",
         "--batch-size", "8", "--amp", "bf16", "--log-dir", "single_bf16"],
        cwd=pipe, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    run = torchrun(4, pipe / "pp_pipe_net.py", "--schedule", "gpipe", "--steps", "3",
                   "--batch-size", "8", "--microbatches", "4", "--data", "data.pt",
                   "--init", "init.pt", "--amp", "bf16", "--log-dir", "bf16")
    assert run.returncode == 0, run.stderr[-3000:]
    expected = losses(pipe / "single_bf16" / "log.csv")
    assert losses(pipe / "bf16" / "log.csv") == pytest.approx(expected, rel=3e-2)
    fp32 = losses(pipe / "single" / "log.csv")
    assert losses(pipe / "bf16" / "log.csv") != pytest.approx(fp32, rel=1e-6, abs=0)  # bf16 ran


def test_resume_continues_as_one_run(pipe):
    first = torchrun(4, pipe / "pp_pipe_net.py", "--schedule", "1f1b", "--steps", "2",
                     "--batch-size", "8", "--microbatches", "4", "--data", "data.pt",
                     "--init", "init.pt", "--checkpoint", "resumed")
    assert first.returncode == 0, first.stderr[-3000:]
    rest = torchrun(4, pipe / "pp_pipe_net.py", "--schedule", "1f1b", "--steps", "3",
                    "--batch-size", "8", "--microbatches", "4", "--data", "data.pt",
                    "--checkpoint", "resumed", "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resumed from resumed/step_2 at step 2" in rest.stdout
    assert "step 3/3  loss" in rest.stdout and "step 1/3" not in rest.stdout
    expected = losses(pipe / "single" / "log.csv")
    assert losses(pipe / "resumed" / "log.csv") == pytest.approx(expected, rel=1e-5, abs=1e-7)


RECURRENT = """
mpgen: 1
name: StateNet

inputs:
  tokens: {shape: [seq, batch], dtype: int64}
  h0: [1, batch, 8]
  c0: [1, batch, 8]

layers:
  emb: {op: Embedding, args: [12, 6], in: tokens}
  rnn: {op: LSTM, args: [6, 8], in: [emb, [h0, c0]], outputs: [seq_out, [hn, cn]]}
  head: {op: Linear, args: [8, 12], in: seq_out}

outputs: [head, hn, cn]

placement:
  emb: cuda:0
  rnn: cuda:1
  head: cuda:0

train:
  loss: {head: CrossEntropyLoss, hn: MSELoss, cn: MSELoss}
  optimizer: {op: SGD, lr: 0.5}
  batch_size: 4
  dims: {seq: 5}
"""


@pytest.fixture(scope="module")
def recurrent(tmp_path_factory) -> Path:
    """StateNet: three stages on two devices (cuda:0, cuda:1, cuda:0); the first
    passes the float inputs h0, c0 on unchanged (they need no gradient), the
    last passes hn, cn on; batch on dim 1."""
    out = tmp_path_factory.mktemp("recurrent")
    build_to(write_spec(out, RECURRENT), out, CPU)
    model = import_generated(out / "state_net.py")
    torch.manual_seed(0)
    torch.save(model.StateNet().state_dict(), out / "init.pt")
    single = subprocess.run(
        [sys.executable, "train_state_net.py", "--seed", "0", "--steps", "2", "--batch-size", "4",
         "--log-dir", "single"], cwd=out, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_passing_on_inputs_that_need_no_gradient(recurrent, schedule):
    # Each end must agree on which gradients cross: h0 and c0 get none (this hung before).
    run = torchrun(3, recurrent / "pp_state_net.py", "--schedule", schedule, "--steps", "2",
                   "--batch-size", "4", "--microbatches", "4", "--init", "init.pt",
                   "--log-dir", schedule, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    expected = losses(recurrent / "single" / "log.csv")
    assert losses(recurrent / schedule / "log.csv") == pytest.approx(expected, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("example, script", [("seed", "pp_simple_model.py"),
                                             ("resnet18", "pp_res_net18.py")])
def test_examples_run_under_torchrun(tmp_path, example, script):
    build_to(ROOT / "examples" / f"{example}.yaml", tmp_path, CPU)
    run = torchrun(2, tmp_path / script, "--steps", "2", "--batch-size", "4")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 2/2  loss" in run.stdout
    assert len(losses(tmp_path / "runs" / script[:-3] / "log.csv")) == 2


def test_a_damaged_init_file_stops_every_rank_with_one_message(pipe):
    (pipe / "damaged.pt").write_bytes(b"junk")
    run = torchrun(4, pipe / "pp_pipe_net.py", "--schedule", "gpipe", "--steps", "1",
                   "--data", "data.pt", "--init", "damaged.pt", "--log-dir", "damaged")
    assert run.returncode != 0
    # Printed once, by rank 0; not the traceback of torch.load in every rank.
    assert [line for line in run.stderr.splitlines() if line.startswith("--init")] == [
        "--init damaged.pt: cannot read it (error: unpack requires a buffer of 4 bytes)"]
    assert "torch.load(" not in run.stderr


def test_interleaved_needs_a_repeating_layout(tmp_path):
    build_to(ROOT / "examples" / "seed.yaml", tmp_path, CPU)
    run = subprocess.run([sys.executable, "pp_simple_model.py", "--schedule", "interleaved",
                          "--steps", "1"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 1
    assert "interleaved needs a layout that visits its devices in a repeating order" in run.stderr
    assert "cuda:0, cuda:1: use --schedule gpipe or 1f1b" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("args, status, message", [
    # argparse's usage error, before torchrun is looked for (each was a traceback in a rank)
    (["--steps", "1", "--init", "missing.pt"], 2,
     "pp_simple_model.py: error: --init: no file missing.pt"),
    (["--steps", "-1"], 2, "pp_simple_model.py: error: --steps must be at least 1, got -1"),
    (["--steps", "1", "--checkpoint", "afile"], 2,
     "pp_simple_model.py: error: --checkpoint afile: not a folder"),
    (["--steps", "1", "--lr", "inf"], 2,
     "pp_simple_model.py: error: --lr must be a finite number >= 0, got inf"),
    # --merge runs without torchrun: no complete checkpoint, a folder to write
    (["--merge", "junk", "out.pt"], 1,
     "--merge: no complete checkpoint in junk (a step_N folder with its COMPLETE marker)"),
    (["--merge", "junk", "junk"], 1, "--merge: junk is a folder; give the file to write"),
], ids=["init", "steps", "checkpoint", "lr", "merge-junk", "merge-into-a-folder"])
def test_a_bad_argument_is_one_message(tmp_path, args, status, message):
    build_to(ROOT / "examples" / "seed.yaml", tmp_path, CPU)
    (tmp_path / "afile").write_text("")
    (tmp_path / "junk").mkdir()
    for k in range(2):
        (tmp_path / "junk" / f"stage_{k}.pt").write_bytes(b"junk")
    run = subprocess.run([sys.executable, "pp_simple_model.py", *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == status, run.stderr
    assert run.stderr == message + "\n"  # one line, no traceback


def test_outside_torchrun_says_how_to_launch(tmp_path):
    build_to(ROOT / "examples" / "seed.yaml", tmp_path, CPU)
    run = subprocess.run([sys.executable, "pp_simple_model.py", "--steps", "1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 1
    assert "torchrun --nproc-per-node 2 pp_simple_model.py" in run.stderr


def test_a_model_that_cannot_be_a_pipeline_says_why(tmp_path):
    spec = write_spec(tmp_path, """
        mpgen: 1
        name: NoParams
        inputs:
          x: [batch, 4]
        layers:
          a: {op: ReLU}
          b: {op: Tanh}
        placement:
          a: cuda:0
          b: cuda:1
        train:
          loss: MSELoss
          optimizer: {op: SGD, lr: 0.1}
        """)
    result = build_to(spec, tmp_path, CPU)
    assert "train_no_params.py" in result.files  # the other files are built as ever
    run = subprocess.run([sys.executable, "pp_no_params.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 1
    assert run.stderr.strip() == ("pp_no_params.py: NoParams cannot run as a pipeline: NoParams "
                                  "has no parameters, so there is nothing to train. Train it "
                                  "with train_no_params.py")


TIED_LM = """
mpgen: 1
name: TiedLM

inputs:
  tokens: {shape: [batch, seq], dtype: int64}

layers:
  emb: {op: Embedding, args: [10, 8]}
  fc: {op: Linear, args: [8, 8]}
  act: {op: Tanh}
  head: {op: Linear, args: [8, 10], bias: false, tie: {weight: emb.weight}}

placement:
  emb: cuda:0
  head: cuda:1

train:
  loss: CrossEntropyLoss
  optimizer: {op: AdamW, lr: 0.05, weight_decay: 0.5}
  no_decay: [embeddings]
  batch_size: 4
  dims: {seq: 3}
"""


def _tied_lm(tmp_path, spec: str, batch_size: str) -> None:
    """TiedLM of ``spec`` built in ``tmp_path``, its initial weights
    (init.pt), and 3 steps of its single-process script (single/)."""
    build_to(write_spec(tmp_path, spec), tmp_path, CPU)
    torch.manual_seed(0)
    torch.save(import_generated(tmp_path / "tied_lm.py").TiedLM().state_dict(), tmp_path / "init.pt")
    single = subprocess.run(
        [sys.executable, "train_tied_lm.py", "--seed", "0", "--steps", "3", "--batch-size",
         batch_size, "--log-dir", "single", "--checkpoint", "single"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr


def _merged_tied_lm(tmp_path) -> dict:
    """The pipeline checkpoint pp/ merged into one state dict, its tied copies equal."""
    done = subprocess.run([sys.executable, "pp_tied_lm.py", "--merge", "pp", "merged.pt"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    merged = torch.load(tmp_path / "merged.pt", weights_only=True)
    assert torch.equal(merged["head.weight"], merged["emb.weight"])
    return merged

def test_a_tied_copy_takes_its_owners_weight_decay_group(tmp_path):
    # The embedding owns the weight the head shares: exempt from decay in the
    # model, so the head's copy on the other stage is exempt too. Grouped by its
    # own layer (a Linear), it decayed apart from the embedding's.
    _tied_lm(tmp_path, TIED_LM, "4")
    run = torchrun(2, tmp_path / "pp_tied_lm.py", "--steps", "3", "--batch-size", "4",
                   "--microbatches", "2", "--init", "init.pt", "--checkpoint", "pp")
    assert run.returncode == 0, run.stderr[-3000:]
    assert losses(tmp_path / "pp" / "log.csv") == pytest.approx(
        losses(tmp_path / "single" / "log.csv"), rel=1e-5, abs=1e-7)
    merged = _merged_tied_lm(tmp_path)
    expected = torch.load(tmp_path / "single" / "last.pt", weights_only=True)["model"]["emb.weight"]
    torch.testing.assert_close(merged["emb.weight"], expected, rtol=1e-5, atol=1e-6)


def test_epochs_end_the_run_as_in_the_single_process_script(pipe):
    # 32 samples in batches of 8: an epoch is 4 steps, whichever --steps says.
    single = subprocess.run(
        [sys.executable, "train_pipe_net.py", "--seed", "0", "--data", "data.pt", "--epochs", "2",
         "--steps", "100", "--batch-size", "8", "--log-dir", "single_epochs"],
        cwd=pipe, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    run = torchrun(4, pipe / "pp_pipe_net.py", "--schedule", "gpipe", "--epochs", "2",
                   "--steps", "100", "--batch-size", "8", "--microbatches", "4",
                   "--data", "data.pt", "--init", "init.pt", "--log-dir", "epochs")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 8/8  loss" in run.stdout
    with (pipe / "epochs" / "log.csv").open() as f:
        assert [row["epoch"] for row in csv.DictReader(f)] == ["0"] * 4 + ["1"] * 4
    assert losses(pipe / "epochs" / "log.csv") == pytest.approx(
        losses(pipe / "single_epochs" / "log.csv"), rel=1e-5, abs=1e-7)


# -- pipeline x data parallel, checkpoints and failures ------------------------------

PADDED_LM = """
mpgen: 1
name: PaddedLM

inputs:
  tokens: {shape: [batch, seq], dtype: int64}

layers:
  emb: {op: Embedding, args: [50, 16], in: tokens}
  l1: {op: Linear, args: [16, 32]}
  act: {op: GELU}
  l2: {op: Linear, args: [32, 16]}
  head: {op: Linear, args: [16, 50]}

placement:
  emb: cuda:0
  l2: cuda:1

train:
  loss: CrossEntropyLoss
  optimizer: {op: AdamW, lr: 0.01}
  batch_size: 8
  dims: {seq: 6}
"""


@pytest.fixture(scope="module")
def padded(tmp_path_factory) -> Path:
    """PaddedLM built for the CPU: 64 sequences whose targets end in padding
    (ignore_index) of different lengths, so a micro-batch's own mean would
    weigh its tokens wrongly; the single-process script's 30 steps of 8."""
    out = tmp_path_factory.mktemp("padded")
    build_to(write_spec(out, PADDED_LM), out, CPU)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50, (64, 6), generator=generator)
    target = torch.randint(0, 50, (64, 6), generator=generator)
    for i, n in enumerate(torch.randint(1, 7, (64,), generator=generator).tolist()):
        target[i, n:] = -100
    torch.save({"tokens": tokens, "target": target}, out / "data.pt")
    torch.manual_seed(5)
    torch.save(import_generated(out / "padded_lm.py").PaddedLM().state_dict(), out / "init.pt")
    single = subprocess.run(
        [sys.executable, "train_padded_lm.py", "--data", "data.pt", "--init", "init.pt",
         "--steps", "30", "--batch-size", "8", "--log-dir", "single"],
        cwd=out, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    return out


PADDED = ("--batch-size", "8", "--data", "data.pt", "--init", "init.pt")


@pytest.mark.parametrize("schedule, mode", [("1f1b", "fsdp"), ("gpipe", "ddp")])
def test_two_replicas_of_two_stages_equal_the_single_process_script(padded, schedule, mode):
    run = torchrun(4, padded / "pp_padded_lm.py", "--dp", "2", "--dp-mode", mode, "--steps", "3",
                   "--schedule", schedule, *PADDED, "--log-dir", f"dp_{schedule}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"2 stages on 2 ranks x 2 replicas ({mode})" in run.stdout
    expected = losses(padded / "single" / "log.csv")[:3]
    assert losses(padded / f"dp_{schedule}" / "log.csv") == pytest.approx(expected, rel=1e-5)
    with (padded / f"dp_{schedule}" / "log.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert all(float(row["grad_norm"]) > 0 and float(row["tokens_per_second"]) > 0 for row in rows)


def test_a_save_killed_half_way_is_removed_and_the_last_complete_one_resumes(padded):
    first = torchrun(4, padded / "pp_padded_lm.py", "--dp", "2", "--steps", "3", *PADDED,
                     "--checkpoint", "killed", "--save-every", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    folder = padded / "killed"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step_")) == ["step_3"]
    # What SIGKILL of a rank during the save of step 4 leaves: some shards, no marker.
    partial = folder / ".step_4.partial"
    partial.mkdir()
    for shard in sorted((folder / "step_3").glob("__*.distcp"))[:2]:
        partial.joinpath(shard.name).write_bytes(shard.read_bytes()[:100])
    (folder / "step_4").mkdir()  # a step folder without its marker is never read either
    rest = torchrun(2, padded / "pp_padded_lm.py", "--dp", "1", "--steps", "5", *PADDED,
                    "--checkpoint", "killed", "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "removed killed/.step_4.partial, left by a save that did not finish" in rest.stdout
    assert "resumed from killed/step_3 at step 3 (resharded onto 2 x 1 ranks)" in rest.stdout
    assert losses(folder / "log.csv") == pytest.approx(
        losses(padded / "single" / "log.csv")[:5], rel=1e-5)


def test_resume_without_a_checkpoint_starts_fresh(padded):
    run = torchrun(2, padded / "pp_padded_lm.py", "--steps", "1", *PADDED,
                   "--checkpoint", "fresh", "--resume")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--resume: no complete checkpoint in fresh; starting at step 0" in run.stdout
    assert (padded / "fresh" / "step_1" / "COMPLETE").is_file()


def _workers(parent: int) -> list[int]:
    """The pids of torchrun's worker processes (its children), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended
            continue
        if int(fields[1]) == parent and fields[0] != "Z":  # ppid; not a zombie
            found.append(int(stat.parent.name))
    return sorted(found)


def _rank_of(pid: int) -> int:
    """A worker's global rank, from its environment."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=")[1])


def _logged(log: Path) -> int:
    try:
        return len(losses(log))
    except (OSError, KeyError, ValueError):
        return 0


def _launch(padded: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", *args],
        cwd=padded, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(log: Path, steps: int, job: subprocess.Popen) -> None:
    """Until the run has logged ``steps`` steps: what a test waits for before
    it kills or stops a rank (the ranks are then in the training loop). The
    bound is a last resort, for a run that hangs, on however loaded a machine."""
    deadline = time.monotonic() + 600
    while _logged(log) < steps:
        assert job.poll() is None, job.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run logged too few steps in 600 s"
        time.sleep(0.2)


def test_a_killed_rank_ends_every_rank_naming_it(padded):
    job = _launch(padded, "--nproc-per-node", "4", "pp_padded_lm.py", "--dp", "2",
                  "--steps", "100000", *PADDED, "--log-dir", "dead")
    _wait_for_steps(padded / "dead" / "log.csv", 2, job)
    agent = job.pid  # python -m torch.distributed.run: the agent, the workers' parent
    victim = _workers(agent)[-1]
    rank = _rank_of(victim)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    _, err = job.communicate(timeout=600)
    assert time.monotonic() - killed < 100  # not --timeout's 120 s, which a hung collective waits
    assert job.returncode != 0
    assert not _workers(agent)
    assert re.search(rf"rank \d \(stage \d, replica \d\): rank {rank} stopped or hung; lost contact",
                     err), err[-3000:]


def test_a_restart_by_torchrun_resumes_by_itself(padded):
    # One command line for the first launch and for torchrun's restart after a
    # rank dies: --resume finds the last complete checkpoint (or none).
    job = _launch(padded, "--nproc-per-node", "2", "--max-restarts", "1", "pp_padded_lm.py",
                  "--steps", "30", *PADDED, "--checkpoint", "restarted", "--save-every", "1",
                  "--resume")
    _wait_for_steps(padded / "restarted" / "log.csv", 3, job)
    os.kill(_workers(job.pid)[0], signal.SIGKILL)
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]
    assert "resumed from restarted/step_" in out
    assert losses(padded / "restarted" / "log.csv") == pytest.approx(
        losses(padded / "single" / "log.csv"), rel=1e-5)


def test_two_nodes_restart_together_when_one_nodes_worker_dies(padded):
    # Two torchrun agents ("nodes") of one rank each meet at a c10d rendezvous
    # on this machine. Node 1's worker dies: it restarts with restart count 1,
    # node 0's with 0; both are rendezvous round 1, which keys their store.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", "--max-restarts", "1",
             "pp_padded_lm.py", "--steps", "30", *PADDED, "--checkpoint", "two_nodes",
             "--save-every", "1", "--resume", "--timeout", "60"],
            cwd=padded, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)]
    try:
        _wait_for_steps(padded / "two_nodes" / "log.csv", 3, nodes[1])
        os.kill(_workers(nodes[1].pid)[0], signal.SIGKILL)
        done = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            node.kill() if node.poll() is None else None
    for node, (out, err) in zip(nodes, done):
        assert node.returncode == 0, "\n\n".join(o + e for o, e in done)[-12000:]
    assert "resumed from two_nodes/step_" in done[0][0] + done[1][0]
    assert losses(padded / "two_nodes" / "log.csv") == pytest.approx(
        losses(padded / "single" / "log.csv"), rel=1e-5)


def test_sigterm_saves_after_the_step_on_every_rank(padded):
    job = _launch(padded, "--nproc-per-node", "2", "pp_padded_lm.py", "--steps", "100000",
                  *PADDED, "--checkpoint", "terminated")
    _wait_for_steps(padded / "terminated" / "log.csv", 2, job)
    os.kill(_workers(job.pid)[1], signal.SIGTERM)  # one rank: the others learn it at the step's end
    out, err = job.communicate(timeout=600)
    assert job.returncode != 0
    done = re.search(r"interrupted after step (\d+); saved terminated/step_(\d+)", err)
    assert done and done.group(1) == done.group(2), err[-3000:]
    assert (padded / "terminated" / f"step_{done.group(1)}" / "COMPLETE").is_file()


def test_a_hung_rank_stops_the_others_after_the_timeout(padded):
    job = _launch(padded, "--nproc-per-node", "2", "pp_padded_lm.py", "--steps", "100000",
                  *PADDED, "--log-dir", "hung", "--timeout", "5")
    _wait_for_steps(padded / "hung" / "log.csv", 2, job)
    hung = _workers(job.pid)[0]
    rank = _rank_of(hung)
    os.kill(hung, signal.SIGSTOP)  # alive, answering nothing
    stopped = time.monotonic()
    try:
        _, err = job.communicate(timeout=600)
    finally:
        os.kill(hung, signal.SIGCONT) if _workers(job.pid) else None
    assert job.returncode != 0
    assert time.monotonic() - stopped < 100  # --timeout 5 s, not the default 120 s
    assert f"rank {rank} stopped or hung; lost contact" in err, err[-3000:]


def test_the_committed_cuda_build_on_a_cpu_machine_says_how_to_rebuild():
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs: the CUDA build runs here")
    run = subprocess.run([sys.executable, "pp_simple_model.py", "--steps", "1"],
                         cwd=ROOT / "generated", capture_output=True, text=True, timeout=600)
    assert run.returncode == 1
    assert run.stderr == ("pp_simple_model.py was built for CUDA devices, and local rank 0 has "
                          "none (this machine has no CUDA device). Build a copy for this "
                          "machine and run that one: mpgen build examples/seed.yaml --device-map "
                          "cpu -o build/simple_model-cpu, then python "
                          "build/simple_model-cpu/pp_simple_model.py --steps 1\n")


ACTIVATION_STAGE = """
mpgen: 1
name: ActivationStage

inputs:
  x: [batch, 8]

layers:
  l1: {op: Linear, args: [8, 16]}
  act: {op: Tanh}
  l2: {op: Linear, args: [16, 4]}

placement:
  l1: cuda:0
  act: cuda:1
  l2: cuda:2

train:
  loss: MSELoss
  optimizer: {op: Adam, lr: 0.01}
  batch_size: 8
"""


def test_a_stage_without_parameters_trains_saves_and_resumes_under_the_mesh(tmp_path):
    # The middle stage has nothing to replicate, optimize or save.
    build_to(write_spec(tmp_path, ACTIVATION_STAGE), tmp_path, CPU)
    torch.manual_seed(0)
    model = import_generated(tmp_path / "activation_stage.py").ActivationStage()
    torch.save(model.state_dict(), tmp_path / "init.pt")
    single = subprocess.run(
        [sys.executable, "train_activation_stage.py", "--steps", "5", "--init", "init.pt",
         "--log-dir", "single"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    first = torchrun(6, tmp_path / "pp_activation_stage.py", "--dp", "2", "--steps", "3",
                     "--init", "init.pt", "--checkpoint", "ck")
    assert first.returncode == 0, first.stderr[-3000:]
    rest = torchrun(3, tmp_path / "pp_activation_stage.py", "--steps", "5", "--checkpoint", "ck",
                    "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert losses(tmp_path / "ck" / "log.csv") == pytest.approx(
        losses(tmp_path / "single" / "log.csv"), rel=1e-5)


NORM_NET = """
mpgen: 1
name: NormNet

inputs:
  x: [batch, 8]

layers:
  l1: {op: Linear, args: [8, 16]}
  bn1: {op: BatchNorm1d, args: [16]}
  a1: {op: Tanh}
  l2: {op: Linear, args: [16, 16]}
  bn2: {op: BatchNorm1d, args: [16], momentum: 0.3}
  l3: {op: Linear, args: [16, 4]}

placement:
  l1: cuda:0
  l2: cuda:1

pipeline: {microbatches: 1, schedule: gpipe, sync_bn: true}

train:
  loss: MSELoss
  optimizer: {op: SGD, lr: 0.1}
  batch_size: 8
"""


@pytest.fixture(scope="module")
def norm(tmp_path_factory) -> Path:
    """NormNet (two BatchNorms on two stages), its data, initial weights and
    the single-process script's 3 steps of 8."""
    out = tmp_path_factory.mktemp("norm")
    build_to(write_spec(out, NORM_NET), out, CPU)
    generator = torch.Generator().manual_seed(2)
    torch.save({"x": torch.randn(32, 8, generator=generator) * 3 + 1,
                "target": torch.randn(32, 4, generator=generator)}, out / "data.pt")
    torch.manual_seed(0)
    torch.save(import_generated(out / "norm_net.py").NormNet().state_dict(), out / "init.pt")
    single = subprocess.run(
        [sys.executable, "train_norm_net.py", "--data", "data.pt", "--init", "init.pt",
         "--steps", "3", "--batch-size", "8", "--log-dir", "single", "--checkpoint", "single"],
        cwd=out, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    return out


def _merged(folder: Path, name: str) -> dict:
    done = subprocess.run([sys.executable, "pp_norm_net.py", "--merge", name, f"{name}.pt"],
                          cwd=folder, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return torch.load(folder / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_sync_bn_over_replicas_equals_the_single_process_script(norm, mode):
    # The spec's default --sync-bn, one micro-batch per replica: each BatchNorm
    # normalises by both replicas' samples together, as the script does by its batch.
    assert import_generated(norm / "pp_norm_net.py").STAGES.sync_bn is True
    name = f"sync_{mode}"
    run = torchrun(4, norm / "pp_norm_net.py", "--dp", "2", "--dp-mode", mode, "--steps", "3",
                   "--batch-size", "8", "--data", "data.pt", "--init", "init.pt",
                   "--checkpoint", name)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "BatchNorm" not in run.stdout  # nothing differs from the script: nothing to say
    assert losses(norm / name / "log.csv") == pytest.approx(
        losses(norm / "single" / "log.csv"), rel=1e-5, abs=1e-7)
    state = _merged(norm, name)
    single = torch.load(norm / "single" / "last.pt", weights_only=True)["model"]
    assert set(state) == set(single)
    for key, value in single.items():  # the running stats and num_batches_tracked too
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)


def test_without_sync_bn_the_replicas_running_stats_are_averaged(norm):
    # Each replica normalises by its own samples (the losses differ from the
    # script's); after each step the running stats become the replicas' mean.
    # After one step the first BatchNorm's input is the script's, so its running
    # mean is the script's (a mean of two equal halves); num_batches_tracked
    # counts micro-batches.
    single = subprocess.run(
        [sys.executable, "train_norm_net.py", "--data", "data.pt", "--init", "init.pt",
         "--steps", "1", "--batch-size", "8", "--log-dir", "single_1", "--checkpoint", "single_1"],
        cwd=norm, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    run = torchrun(4, norm / "pp_norm_net.py", "--dp", "2", "--dp-mode", "ddp", "--no-sync-bn",
                   "--steps", "1", "--batch-size", "8", "--data", "data.pt", "--init", "init.pt",
                   "--checkpoint", "apart", "--microbatches", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"\(stage 0, replica 0\): 1 BatchNorm layer\(s\) normalise each of 1 "
                     r"micro-batches by its own statistics on its replica, where NormNet's "
                     r"single-process script uses the whole batch's", run.stdout), run.stdout
    state = _merged(norm, "apart")
    expected = torch.load(norm / "single_1" / "last.pt", weights_only=True)["model"]
    torch.testing.assert_close(state["bn1.running_mean"], expected["bn1.running_mean"],
                               rtol=1e-5, atol=1e-6)
    assert not torch.allclose(state["bn1.running_var"], expected["bn1.running_var"])
    assert state["bn1.num_batches_tracked"].item() == 1
    again = torchrun(4, norm / "pp_norm_net.py", "--dp", "2", "--no-sync-bn", "--steps", "3",
                     "--batch-size", "8", "--data", "data.pt", "--init", "init.pt",
                     "--checkpoint", "micro", "--microbatches", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert _merged(norm, "micro")["bn2.num_batches_tracked"].item() == 6


def test_the_build_notes_what_batch_norm_becomes_in_the_pipeline(tmp_path):
    from mpgen.commands import build

    spec = write_spec(tmp_path, NORM_NET.replace(
        "pipeline: {microbatches: 1, schedule: gpipe, sync_bn: true}", ""))
    notes = build.compiled(build_to(spec, tmp_path / "out", CPU), CPU).notes
    [note] = [n for n in notes if "BatchNorm" in n]
    assert re.match(r"\S+\.yaml:\d+:\d+: note: pp_norm_net\.py runs this BatchNorm and "
                    r"1 more on micro-batches \(2 or more per replica", note), note
    assert "num_batches_tracked counts micro-batches" in note
    assert "run --microbatches 1 (docs/pipelining.md, BatchNorm)" in note and "\n" not in note
    replicas = write_spec(tmp_path, NORM_NET.replace(
        "pipeline: {microbatches: 1, schedule: gpipe, sync_bn: true}",
        "pipeline: {microbatches: 1, schedule: gpipe, dp: 2}"), "replicas.yaml")
    [note] = build.compiled(build_to(replicas, tmp_path / "replicas", CPU), CPU).notes
    assert "on its replica" in note and "run --microbatches 1 and --sync-bn" in note
    exact = write_spec(tmp_path, NORM_NET, "exact.yaml")  # one micro-batch, synced: nothing to say
    assert not build.compiled(build_to(exact, tmp_path / "exact", CPU), CPU).notes


def test_zbv_ddp_replicas_keep_the_tied_copies_on_one_rank_equal(tmp_path):
    # Four stages in a V on two ranks: rank 0 holds the embedding (stage 0) and
    # the head tied to it (stage 3). Under DDP their gradients were not averaged
    # over the replicas, the copies drifted apart and --merge wrote both.
    spec = TIED_LM.replace("placement:\n  emb: cuda:0\n  head: cuda:1\n",
                           "placement:\n  emb: cuda:0\n  fc: cuda:1\n  act: cuda:2\n"
                           "  head: cuda:3\n")
    _tied_lm(tmp_path, spec, "8")
    run = torchrun(4, tmp_path / "pp_tied_lm.py", "--schedule", "zbv", "--dp", "2",
                   "--dp-mode", "ddp", "--steps", "3", "--batch-size", "8", "--microbatches", "4",
                   "--init", "init.pt", "--checkpoint", "pp")
    assert run.returncode == 0, run.stderr[-3000:]
    assert losses(tmp_path / "pp" / "log.csv") == pytest.approx(
        losses(tmp_path / "single" / "log.csv"), rel=1e-5, abs=1e-7)
    merged = _merged_tied_lm(tmp_path)
    expected = torch.load(tmp_path / "single" / "last.pt", weights_only=True)["model"]
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-6)
