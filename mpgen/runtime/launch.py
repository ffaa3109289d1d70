"""Starting and ending a pipeline run's processes: this rank's device, the
rendezvous store of a torchrun attempt, the checkpoint folder before a run,
and the one line a rank that lost the others ends with."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from os import environ

import torch
import torch.distributed as dist

from . import mesh, sharded
from .data import one_line
from .loop import device_map
from .mesh import stop
from .spec import Stages


def check_devices(stages: Stages) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK for a CUDA build (stopping with
    the rebuild hint where this machine has too few), else the CPU."""
    if stages.training.device_type != "cuda":
        return torch.device("cpu")
    local, count = int(environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local >= count:
        training = stages.training
        stop(
            f"{stages.script} was built for CUDA devices, and local rank {local} has none "
            f"(this machine has {count}). Rebuild it for this machine: mpgen build {training.spec} "
            f"--device-map {device_map(training.devices, count)}"
        )
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    return device


def attempt_store(wait: timedelta) -> dict:
    """The store of this attempt, where torchrun's agent shares its own with
    the workers: keys under the restart count, so that workers restarted by
    --max-restarts do not read the addresses the killed ones left there
    (pytorch/pytorch#135712: init_process_group then connects to them and
    fails). Elsewhere: none, init_process_group's own."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    shared = dist.TCPStore(
        environ["MASTER_ADDR"],
        int(environ["MASTER_PORT"]),
        is_master=False,
        timeout=wait,
    )
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"mpgen/attempt_{attempt}", shared)
    return {
        "store": store,
        "rank": int(environ["RANK"]),
        "world_size": int(environ["WORLD_SIZE"]),
    }


def prepare(folder: str) -> None:
    """Before anything is saved: check every rank sees --checkpoint's folder,
    and remove what killed saves left there (NOTE [Coordinated checkpoints])."""
    if not sharded.check_shared(folder):
        stop(
            f"--checkpoint {folder}: some ranks do not see rank 0's files there; a pipeline's "
            "checkpoints need a folder every node shares"
        )
    if dist.get_rank() == 0:
        for path in sharded.leftovers(folder):
            sharded.remove(path)
            print(f"removed {path}, left by a save that did not finish")
    dist.barrier()


def lost(grid: mesh.Mesh, error: BaseException, wait: float = 3.0) -> None:
    """A collective or a send failed: another rank stopped, or hangs past
    --timeout. Every rank that is still running says so in the job's store
    (torchrun's, which outlives its workers) and names the ranks that did
    not, in one line."""
    text = one_line(error)
    words = ("connection", "timed out", "timeout", "closed", "peer", "gloo", "nccl")
    if not any(word in text.lower() for word in words):
        raise error
    gone = ""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"mpgen/running/{grid.rank}", "1")
        world = dist.get_world_size()
        keys = [f"mpgen/running/{r}" for r in range(world)]
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not store.check(keys):
            time.sleep(0.1)
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if missing:
            gone = f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} stopped or hung; "
    except Exception:  # the store went with the job: name no rank
        pass
    sys.exit(
        f"{grid.where()}: {gone or 'another rank stopped or hung; '}lost contact ({text[:160]}); "
        "relaunch with --resume to continue from the last complete checkpoint"
    )
