"""Activation checkpointing: ``checkpoint: true`` on a layer or block
instance, and ``pipeline.checkpoint: [DEVICE]`` for every layer placed on a
device. The generated forward wraps those units in
``torch.utils.checkpoint``; the cost model and the report count what they
keep (their inputs) instead of their activations."""

from __future__ import annotations

import torch

from helpers import build_to, import_generated, write_spec
from mpgen.compiler.driver import compile_spec
from mpgen.testing import virtual_devices

SPEC = """
mpgen: 1
name: Net
inputs: {x: [batch, 32]}
blocks:
  MLP:
    params: [dim]
    layers:
      up: {op: Linear, args: [$dim, "=4 * $dim"]}
      act: {op: GELU}
      down: {op: Linear, args: ["=4 * $dim", $dim]}
layers:
  stem: {op: Linear, args: [32, 32]}
  mlp: {op: MLP, args: [32]%s}
  h: {op: Linear, args: [32, 32], repeat: 4}
  head: {op: Linear, args: [32, 4]}
placement: {stem: cuda:0, mlp: cuda:0, h.0-1: cuda:0, h.2-3: cuda:1, head: cuda:1}
train: {batch_size: 16}
%s
"""


def build(tmp_path, name: str, checkpoint: bool = False, pipeline: str = "",
          device_map=None):
    text = SPEC % (", checkpoint: true" if checkpoint else "", pipeline)
    spec = write_spec(tmp_path, text, f"{name}.yaml")
    result = build_to(spec, tmp_path / name, device_map)
    return result, import_generated(tmp_path / name / "net.py").Net


def saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes autograd saves for backward in one forward (each storage once,
    parameters not counted), and the output."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    return sum(seen.values()), out


def test_a_checkpointed_block_saves_fewer_activations_with_the_same_results(tmp_path):
    _, plain_cls = build(tmp_path, "plain", device_map={"*": "cpu"})
    result, ckpt_cls = build(tmp_path, "ckpt", checkpoint=True, device_map={"*": "cpu"})
    assert ("mlp = torch.utils.checkpoint.checkpoint(self.mlp, stem, use_reentrant=False)"
            in result.files["net.py"])
    torch.manual_seed(0)
    plain = plain_cls()
    ckpt = ckpt_cls()
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(16, 32)
    plain_saved, plain_out = saved_bytes(plain, x)
    ckpt_saved, ckpt_out = saved_bytes(ckpt, x)
    # The block's hidden [16, 128] activations (the GELU's input and the
    # second Linear's input) are recomputed instead of kept.
    assert plain_saved - ckpt_saved >= 2 * 16 * 128 * 4
    torch.testing.assert_close(ckpt_out, plain_out)
    plain_out.sum().backward()
    ckpt_out.sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=lambda m: f"{name}: {m}")


def test_the_cost_model_keeps_only_the_inputs_of_a_checkpointed_unit(tmp_path):
    plain = compile_spec(write_spec(tmp_path, SPEC % ("", ""), "plain.yaml")).costs
    ckpt = compile_spec(write_spec(tmp_path, SPEC % (", checkpoint: true", ""),
                                   "ckpt.yaml")).costs
    before = next(u for u in plain.units if u.name == "mlp")
    after = next(u for u in ckpt.units if u.name == "mlp")
    assert not before.checkpointed and after.checkpointed
    # NOTE [Cost formulas]: it keeps its input, the stem's [16, 32] output.
    assert after.activation_bytes == after.checkpoint_bytes == 16 * 32 * 4
    assert after.recomputed_bytes == before.activation_bytes - after.activation_bytes
    assert after.activation_bytes < before.activation_bytes
    assert sum(u.activation_bytes for u in ckpt.units) < sum(
        u.activation_bytes for u in plain.units)
    # Every other unit is costed as before.
    others = [(a.name, a.activation_bytes) for a in plain.units if a.name != "mlp"]
    assert others == [(b.name, b.activation_bytes) for b in ckpt.units if b.name != "mlp"]


def test_pipeline_checkpoint_recomputes_every_module_on_its_devices(tmp_path):
    result, cls = build(tmp_path, "dev", pipeline="pipeline: {microbatches: 2, "
                                                   "checkpoint: [cuda:1]}")
    code = result.files["net.py"]
    # h.0-1 on cuda:0 run plainly, h.2-3 and the head on cuda:1 through checkpoint.
    assert "for layer in self.h[0:2]:\n            h = layer(h)" in code
    assert ("for layer in self.h[2:4]:\n            # [batch, 32]\n"
            "            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)"
            in code)
    assert "torch.utils.checkpoint.checkpoint(self.head, h, use_reentrant=False)" in code
    checkpointed = [u.name for u in result.graph.costs.units if u.checkpointed]
    assert checkpointed == ["h.2", "h.3", "head"]
    report = result.files["net.placement.md"]
    assert "## Pipeline and activation checkpointing" in report
    assert "| `h.2` | `cuda:1` | `pipeline.checkpoint` |" in report
    with virtual_devices(cuda=2):
        torch.manual_seed(0)
        model = cls()
        out = model(torch.randn(4, 32))
        out.sum().backward()
        assert all(p.grad is not None for p in model.parameters())
    # pp_net.py's stage of cuda:1 recomputes the same modules (its rank's memory
    # is what the plan and the report say); cuda:0's runs them plainly.
    pp = result.files["pp_net.py"]
    stage0, stage1 = pp.split("class Stage1")[0], pp.split("class Stage1")[1]
    assert "checkpoint(" not in stage0.split("class Stage0")[1]
    assert "h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)" in stage1
    assert "torch.utils.checkpoint.checkpoint(self.head, h, use_reentrant=False)" in stage1


def test_a_device_checkpoint_follows_the_spec_devices_under_a_device_map(tmp_path):
    # Both devices on the CPU: one stage, but only cuda:1's units recompute.
    result, cls = build(tmp_path, "mapped", pipeline="pipeline: {microbatches: 2, "
                                                      "checkpoint: [cuda:1]}",
                        device_map={"*": "cpu"})
    code = result.files["net.py"]
    assert "for layer in self.h[0:2]:\n            h = layer(h)" in code
    assert "torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)" in code
    out = cls()(torch.randn(3, 32))
    assert out.shape == (3, 4)


def test_a_spec_without_checkpoints_has_no_checkpoint_section(tmp_path):
    result, _ = build(tmp_path, "none", device_map={"*": "cpu"})
    assert "torch.utils.checkpoint" not in result.files["net.py"]
    assert "activation checkpointing" not in result.files["net.placement.md"]
