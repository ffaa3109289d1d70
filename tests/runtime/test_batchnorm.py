"""batchnorm.py: SyncedBatchNorm against one BatchNorm over the whole batch
(two ranks on gloo, spawned), its conversion, and the running stats' mean."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from mpgen.runtime import batchnorm

pytestmark = pytest.mark.slow  # spawns two processes


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 6 samples, 3 channels of 4 positions, and the gradient of its output."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 4, generator=generator) * 2 + 1
    return x, torch.randn(6, 3, 4, generator=generator)


def _norm() -> nn.Module:
    torch.manual_seed(1)
    module = nn.Sequential(nn.BatchNorm1d(3, momentum=0.2))
    with torch.no_grad():
        module[0].weight.uniform_(0.5, 1.5)
        module[0].bias.uniform_(-1, 1)
    return module


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        module = batchnorm.SyncedBatchNorm.convert(_norm(), dist.group.WORLD)
        x, grad = (t.chunk(2)[rank] for t in _batch())
        x.requires_grad_(True)
        for _ in range(2):  # two steps: the running stats move twice
            x.grad = None
            module.zero_grad()
            y = module(x)
            y.backward(grad)
        norm = module[0]
        dist.all_reduce(norm.weight.grad)  # the replicas' gradients, summed (their loss is one)
        dist.all_reduce(norm.bias.grad)
        torch.save({"y": y.detach(), "dx": x.grad, "dw": norm.weight.grad, "db": norm.bias.grad,
                    "state": module.state_dict(), "type": type(norm).__name__},
                   f"{out}/rank_{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_synced_batch_norm_over_two_ranks_is_one_batch_norm_over_the_batch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, (port, str(tmp_path)), nprocs=2, start_method="spawn")
    found = [torch.load(tmp_path / f"rank_{r}.pt", weights_only=True) for r in range(2)]
    module = _norm()
    x, grad = _batch()
    x.requires_grad_(True)
    for _ in range(2):
        x.grad = None
        module.zero_grad()
        y = module(x)
        y.backward(grad)
    assert found[0]["type"] == "SyncedBatchNorm"
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([f["y"] for f in found]), y.detach(), **close)
    torch.testing.assert_close(torch.cat([f["dx"] for f in found]), x.grad, **close)
    for f in found:
        torch.testing.assert_close(f["dw"], module[0].weight.grad, **close)
        torch.testing.assert_close(f["db"], module[0].bias.grad, **close)
        assert f["state"].keys() == module.state_dict().keys()  # the same keys
        for key, value in module.state_dict().items():  # running stats, num_batches_tracked
            torch.testing.assert_close(f["state"][key], value, **close)


def test_conversion_keeps_the_parameters_and_buffers():
    module = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.BatchNorm1d(3)), nn.BatchNorm2d(3))
    weight, mean = module[1][0].weight, module[2].running_mean
    module.eval()
    converted = batchnorm.SyncedBatchNorm.convert(module, None)
    assert isinstance(converted[1][0], batchnorm.SyncedBatchNorm)
    assert isinstance(converted[2], batchnorm.SyncedBatchNorm)
    assert converted[1][0].weight is weight and converted[2].running_mean is mean
    assert not converted[2].training
    assert batchnorm.batch_norms([converted]) == [converted[1][0], converted[2]]
    x = torch.randn(4, 3, 2, 2)
    torch.testing.assert_close(converted[2](x), nn.functional.batch_norm(
        x, mean, module[2].running_var, module[2].weight, module[2].bias, False, 0.1, 1e-5))
