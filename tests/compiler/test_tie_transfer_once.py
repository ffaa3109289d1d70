"""A tied parameter, or a Parameter layer, read on another device by several
layers crosses to that device once per forward (docs/spec.md, "Tied
parameters"; NOTE [Tied parameters across devices] in placement/transfers.py):
one ``.to()`` in the generated model serves every reader there, one copy per
stage in the micro-batched forward and in pp_<name>.py, and gradients reach
the one parameter as they do in the unsplit model."""

from __future__ import annotations

import csv
import re
import subprocess
import sys

import pytest
import torch

from helpers import build_to, import_generated, write_spec
from mpgen.testing import virtual_devices

#: wte on cuda:0; a Parameter and the tied weight each read by two layers on cuda:1.
TWO_HEADS = """
mpgen: 1
name: TwoHeads
inputs:
  idx: {shape: [batch, 8], dtype: int64}
layers:
  wte: {op: Embedding, args: [50, 16], in: idx}
  scale: {op: Parameter, shape: [16], init: {normal: {std: 1.0}}}
  h1: {op: torch.mul, in: [wte, scale]}
  head1: {op: Linear, args: [16, 50], bias: false, tie: {weight: wte.weight}, in: h1}
  h2: {op: torch.mul, in: [wte, scale]}
  h3: {op: torch.tanh, in: h2}
  head2: {op: Linear, args: [16, 50], bias: false, tie: {weight: wte.weight}, in: h3}
  out: {op: torch.add, in: [head1, head2]}
placement:
  wte: cuda:0
  h1: cuda:1
"""

#: The readers on cuda:1 in three sections apart, one of them a run of a
#: repeated block that reads the Parameter too.
APART = """
mpgen: 1
name: Apart
inputs:
  idx: {shape: [batch, 8], dtype: int64}
blocks:
  Scaled:
    params: [dim]
    inputs: [x, s]
    layers:
      fc: {op: Linear, args: [$dim, $dim], in: x}
      m: {op: torch.mul, in: [fc, s]}
layers:
  wte: {op: Embedding, args: [50, 16], in: idx}
  scale: {op: Parameter, shape: [16], init: {normal: {std: 1.0}}}
  h: {op: Scaled, args: [16], in: [wte, scale], repeat: 4}
  a: {op: torch.mul, in: [h, scale]}
  head1: {op: Linear, args: [16, 50], bias: false, tie: {weight: wte.weight}, in: a}
  b: {op: torch.tanh, in: a}
  head2: {op: Linear, args: [16, 50], bias: false, tie: {weight: wte.weight}, in: b}
  out: {op: torch.add, in: [head1, head2]}
placement:
  wte: cuda:0
  h.1: cuda:1
  h.2: cuda:0
  h.3: cuda:1
  head1: cuda:1
  b: cuda:0
  head2: cuda:1
"""

#: Two heads tied to the embedding of a block instance that placement splits.
SPLIT = """
mpgen: 1
name: SplitTied
inputs:
  idx: {shape: [batch, 8], dtype: int64}
blocks:
  Body:
    inputs: [ids]
    layers:
      embed: {op: Embedding, args: [50, 16], in: ids}
      mix: {op: Linear, args: [16, 16]}
      norm: {op: LayerNorm, args: [16]}
layers:
  body: {op: Body}
  head1: {op: Linear, args: [16, 50], bias: false, tie: {weight: body.embed.weight}}
  h: {op: torch.tanh, in: body}
  head2: {op: Linear, args: [16, 50], bias: false, tie: {weight: body.embed.weight}}
  out: {op: torch.add, in: [head1, head2]}
placement:
  body.embed: cuda:0
  body.norm: cuda:1
  head1: cuda:1
"""

#: Ties inside a block (a library's model held in a user's class), the
#: instance split and the model's output: the heads' copy crosses once.
INNER = """
mpgen: 1
name: InnerTie
inputs:
  idx: {shape: [batch, 8], dtype: int64}
blocks:
  LM:
    inputs: [ids]
    layers:
      wte: {op: Embedding, args: [50, 16], in: ids}
      mix: {op: Linear, args: [16, 16]}
      head1: {op: Linear, args: [16, 50], bias: false, tie: {weight: wte.weight}}
      t: {op: torch.tanh, in: mix}
      head2: {op: Linear, args: [16, 50], bias: false, tie: {weight: wte.weight}}
      out: {op: torch.add, in: [head1, head2]}
layers:
  lm: {op: LM}
placement:
  lm.wte: cuda:0
  lm.head1: cuda:1
  lm.t: cuda:1
  lm.head2: cuda:1
  lm.out: cuda:1
"""


def _build(tmp_path, text: str, name: str, extra: str = ""):
    """Build ``text`` as the model ``name`` (its files' stem) into a folder of its own."""
    folder = tmp_path / name
    for module in [m for m in sys.modules if m.endswith(name)]:
        sys.modules.pop(module)  # an earlier test's build of the same spec
    text = re.sub(r"^name: .*$", "name: " + name.title().replace("_", ""), text, flags=re.M)
    result = build_to(write_spec(tmp_path, text + extra, f"{name}.yaml"), folder)
    assert f"{name}.py" in result.files
    return result, folder


def _moves(code: str, source: str) -> list[str]:
    """The devices forward moves ``self.<source>`` to, one entry per ``.to()``."""
    return re.findall(rf'self\.{re.escape(source)}\.to\("([^"]+)"\)', code)


@pytest.mark.parametrize("text, name, source", [
    (TWO_HEADS, "two_heads", "wte.weight"),
    (APART, "apart", "wte.weight"),
    (SPLIT, "split_tied", "body.embed.weight"),
    (INNER, "inner_tie", "lm.wte.weight"),
])
def test_the_tied_weight_moves_once_per_device(tmp_path, text, name, source):
    result, _ = _build(tmp_path, text, name)
    graph = result.graph
    code = result.files[f"{name}.py"]
    assert _moves(code, source) == ["cuda:1"], code
    moved = [t for t in graph.plan.transfers if str(t.value) == source]
    assert [(t.src, t.dst) for t in moved] == [("cuda:0", "cuda:1")]
    # every tied reader is called with that one copy
    flat = "".join(code.split()).replace("'", '"')
    assert flat.count(f'{{"weight":{moved[0].dst_var}}}') == 2, code
    # the report lists the move once and says the two heads share it
    report = result.files[f"{name}.placement.md"]
    assert len(re.findall(rf"^\| `{re.escape(source)}` \| `cuda:0` \| `cuda:1` \|", report,
                          re.M)) == 1, report
    heads = "lm." if name == "inner_tie" else ""
    assert (f"Tied: `{heads}head1.weight` and `{heads}head2.weight` are `{source}`" in report
            and "read one copy moved there in forward" in report), report


@pytest.mark.parametrize("text, name", [(TWO_HEADS, "two_heads"), (APART, "apart")])
def test_a_parameter_read_by_several_layers_moves_once(tmp_path, text, name):
    result, _ = _build(tmp_path, text, name)
    moved = [(t.src, t.dst) for t in result.graph.plan.transfers if str(t.value) == "scale"]
    assert moved == [("cuda:0", "cuda:1")]
    assert len(re.findall(r'= scale\.to\("cuda:1"\)', result.files[f"{name}.py"])) == 1


def _run(model_class, idx, merge: bool):
    """Output, every gradient by name, and the forward transfers of one step."""
    with virtual_devices(cuda=2, merge=merge) as vd:
        torch.manual_seed(0)
        model = model_class()
        out = model(idx.to("cuda:0"))
        forward = [t for t in vd.transfers if t.phase == "forward"]
        out.sum().backward()
        grads = {name: p.grad.cpu() for name, p in model.named_parameters()}
        return out.cpu(), grads, forward


@pytest.mark.parametrize("text, name", [(TWO_HEADS, "two_heads"), (APART, "apart"),
                                        (SPLIT, "split_tied"), (INNER, "inner_tie")])
def test_outputs_and_gradients_equal_the_unsplit_model(tmp_path, text, name):
    result, folder = _build(tmp_path, text, name)
    model_class = getattr(import_generated(folder / f"{name}.py"), result.graph.name)
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    out, grads, forward = _run(model_class, idx, merge=False)
    expected, expected_grads, _ = _run(model_class, idx, merge=True)
    assert torch.equal(out, expected)
    assert grads.keys() == expected_grads.keys()
    for key, grad in grads.items():  # sums of several uses: in another order, maybe
        torch.testing.assert_close(grad, expected_grads[key], rtol=1e-5, atol=1e-5)
    # the tied weight ([50, 16] float32), moved in forward: once, to cuda:1
    weights = [t for t in forward if t.nbytes == 50 * 16 * 4 and t.src == "cuda:0"]
    assert [(t.src, t.dst) for t in weights] == [("cuda:0", "cuda:1")], forward


def test_the_micro_batched_forward_moves_it_once_per_stage(tmp_path):
    """Each stage method makes the copy its steps read, not a copy passed on
    through the stages between (the same in pp_<name>.py's stages)."""
    result, folder = _build(tmp_path, APART, "apart_mb", "pipeline: {microbatches: 2}\n")
    code = result.files["apart_mb.py"]
    stages = code.split("    def stage_")[1:]
    readers = [s for s in stages if "functional_call(self.head" in s]
    assert len(readers) == 2
    for stage in readers:
        assert _moves(stage, "wte.weight") == ["cuda:1"], stage
    assert all("wte_weight" not in s.split("return")[-1] for s in stages), code
    model_class = getattr(import_generated(folder / "apart_mb.py"), result.graph.name)
    idx = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    out, grads, _ = _run(model_class, idx, merge=False)
    expected, expected_grads, _ = _run(model_class, idx, merge=True)
    torch.testing.assert_close(out, expected)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[key])


def test_the_pipeline_program_keeps_one_copy_per_stage(tmp_path):
    """pp_<name>.py: the two heads on stage 1 share one copy of wte.weight
    (one entry of TIES), whose gradient is the sum of both uses: the
    owner's gradient in the single-process model."""
    result, folder = _build(tmp_path, TWO_HEADS, "two_heads_pp")
    pp = result.files["pp_two_heads_pp.py"]
    assert "self.head2.weight = self.head1.weight" in pp
    assert 'ties=(((0, "wte.weight"), (1, "head1.weight")),)' in pp
    inner, _ = _build(tmp_path, INNER, "inner_tie_pp")
    assert "self.lm.head2.weight = self.lm.head1.weight" in inner.files["pp_inner_tie_pp.py"]
    module = import_generated(folder / "pp_two_heads_pp.py")
    model = getattr(import_generated(folder / "two_heads_pp.py"), result.graph.name)
    first, last = (stage() for stage in module.STAGES.stages)
    assert last.head2.weight is last.head1.weight
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    with virtual_devices(cuda=2, merge=True):
        torch.manual_seed(0)
        reference = model()
        state = {k: v.cpu() for k, v in reference.state_dict().items()}
        expected = reference(idx.to("cuda:0"))
        expected.sum().backward()
        expected = expected.cpu()
        grads = {k: p.grad.cpu() for k, p in reference.named_parameters()}
    for stage in (first, last):
        stage.load_state_dict({k: state[k] for k in stage.state_dict()}, strict=True)
    (out,) = last(*first(idx))
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    # the runtime sums the copies' gradients (sync_ties): here one copy per stage
    torch.testing.assert_close(first.wte.weight.grad + last.head1.weight.grad,
                               grads["wte.weight"])
    torch.testing.assert_close(first.scale.grad, grads["scale"])


TWO_HEADS_LM = """
mpgen: 1
name: TwoHeadsLM
inputs:
  tokens: {shape: [batch, seq], dtype: int64}
layers:
  emb: {op: Embedding, args: [10, 8]}
  fc: {op: Linear, args: [8, 8]}
  act: {op: Tanh}
  head1: {op: Linear, args: [8, 10], bias: false, tie: {weight: emb.weight}}
  mixed: {op: torch.tanh, in: act}
  head2: {op: Linear, args: [8, 10], bias: false, tie: {weight: emb.weight}}
  logits: {op: torch.add, in: [head1, head2]}
placement:
  emb: cuda:0
  head1: cuda:1
train:
  loss: CrossEntropyLoss
  optimizer: {op: AdamW, lr: 0.05, weight_decay: 0.5}
  no_decay: [embeddings]
  batch_size: 4
  dims: {seq: 3}
"""


def _losses(log) -> list[float]:
    with log.open() as f:
        return [float(row["loss"]) for row in csv.DictReader(f) if row["loss"]]


@pytest.mark.slow
def test_the_pipeline_program_trains_as_the_single_process_script(tmp_path):
    """Under torchrun: the stage's one copy, shared by both heads, trains as
    the one parameter does in train_<name>.py, and --merge gives every key."""
    build_to(write_spec(tmp_path, TWO_HEADS_LM), tmp_path, {"*": "cpu"})
    sys.modules.pop("two_heads_lm", None)
    torch.manual_seed(0)  # as train_two_heads_lm.py --seed 0 does before building the model
    model = import_generated(tmp_path / "two_heads_lm.py").TwoHeadsLM()
    torch.save(model.state_dict(), tmp_path / "init.pt")
    python = [sys.executable]
    single = subprocess.run(
        [*python, "train_two_heads_lm.py", "--seed", "0", "--steps", "3", "--batch-size", "4",
         "--log-dir", "single", "--checkpoint", "single"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr
    run = subprocess.run(
        [*python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "pp_two_heads_lm.py", "--steps", "3", "--batch-size", "4", "--microbatches", "2",
         "--init", "init.pt", "--checkpoint", "pp"],
        cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stderr[-3000:]
    assert _losses(tmp_path / "pp" / "log.csv") == pytest.approx(
        _losses(tmp_path / "single" / "log.csv"), rel=1e-5, abs=1e-7)
    done = subprocess.run([*python, "pp_two_heads_lm.py", "--merge", "pp", "merged.pt"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    merged = torch.load(tmp_path / "merged.pt", weights_only=True)
    assert set(merged) == set(model.state_dict())
    assert torch.equal(merged["head1.weight"], merged["emb.weight"])
    assert torch.equal(merged["head2.weight"], merged["emb.weight"])
    expected = torch.load(tmp_path / "single" / "last.pt", weights_only=True)["model"]
    torch.testing.assert_close(merged["emb.weight"], expected["emb.weight"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("text, name", [(APART, "apart_suite"), (INNER, "inner_suite")])
def test_the_generated_checks_pass_on_virtual_devices(tmp_path, text, name):
    """test_<name>.py's own checks, among them that forward makes exactly the
    planned transfers and that a training step peaks as the memory plan says."""
    from run_generated import run_suite_on_virtual_devices

    _build(tmp_path, text, name)
    ran = run_suite_on_virtual_devices(tmp_path / name / f"test_{name}.py")
    assert "test_forward_makes_exactly_the_planned_transfers" in ran
    assert "test_a_training_step_peaks_as_planned" in ran
