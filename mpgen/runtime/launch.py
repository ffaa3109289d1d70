"""Starting and ending a pipeline run's processes: this rank's device, the
rendezvous store of a torchrun attempt, the checkpoint folder before a run,
and the one line a rank that lost the others ends with.

# NOTE: [A lost rank]
# When a collective or a send fails, every rank still running writes
# mpgen/running/RANK in the attempt's store (torchrun's, which outlives its
# workers) and waits a few seconds for the others' word. A rank that has
# not said so may only be slower to notice (a loaded machine, a longer
# collective): it is named gone only if its heartbeat (mpgen/beat/RANK, one
# more every BEAT seconds from a thread of its own) did not move during
# that wait and a confirmation round as long. A killed rank, or one stopped
# (SIGSTOP), beats no more; a live one keeps beating while it waits, and
# lets the SIGTERM torchrun's agent sends every worker when one ends wait
# until it has named the lost ranks (else it would be named among them):
# from the moment the failure is raised (holding_sigterm()), since the
# agent's SIGTERM may come while the error is still on its way to lost().
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import sys
import threading
import time
from datetime import timedelta
from os import environ

import torch
import torch.distributed as dist

from . import mesh, sharded
from .data import one_line
from .loop import device_map, gpus_here, run_elsewhere
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
        mapping = device_map(training.devices, count)
        stop(
            f"{stages.script} was built for CUDA devices, and local rank {local} has none "
            f"(this machine has {gpus_here(count)}). "
            f"{run_elsewhere(training, mapping, stages.script, None)}"
        )
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    return device


#: The store of this attempt, where each rank's heartbeat is counted (None:
#: not under torchrun's agent; lost() then waits for the ranks' word alone).
ATTEMPT: list = [None]

#: Seconds between two of a rank's heartbeats.
BEAT = 0.5
#: Set when the heartbeat thread is to end; the thread, once started.
_STOPPING = threading.Event()
_BEATING: list = []


def attempt_store(wait: timedelta) -> dict:
    """The store of this attempt, where torchrun's agent shares its own with
    the workers: keys under the attempt every node agrees on (attempt()),
    so that workers restarted by --max-restarts do not read the addresses
    the killed ones left there (pytorch/pytorch#135712: init_process_group
    then connects to them and fails). A thread counts this rank's
    heartbeats there (NOTE [A lost rank]). Elsewhere: none,
    init_process_group's own."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    shared = dist.TCPStore(
        environ["MASTER_ADDR"],
        int(environ["MASTER_PORT"]),
        is_master=False,
        timeout=wait,
    )
    rank = int(environ["RANK"])
    store = dist.PrefixStore(f"mpgen/{attempt(shared, rank)}", shared)
    ATTEMPT[0] = store
    thread = threading.Thread(target=beat, args=(store, rank), daemon=True)
    thread.start()
    _BEATING.append(thread)
    atexit.register(stop_beating)
    return {"store": store, "rank": rank, "world_size": int(environ["WORLD_SIZE"])}


def attempt(store, rank: int) -> str:
    """This attempt's name, the same on every node: how many times this rank
    has started in the job (a counter in the store, which outlives the
    workers). TORCHELASTIC_RESTART_COUNT is not the same on every node: a
    node whose worker failed restarts with count 1, the others (restarted
    because a node rejoined) with 0. Every rendezvous round starts every
    rank once, so the counters agree, provided every rank of each earlier
    round got this far (a worker killed before it leaves its rank one
    behind: the ranks then wait --timeout and stop, as before)."""
    return f"attempt_{store.add(f'mpgen/starts/{rank}', 1)}"


def beat(store, rank: int) -> None:
    """This rank's heartbeat: one more every BEAT seconds while the process
    runs (a daemon thread; collectives release the GIL while they wait),
    until stop_beating() or the store is gone."""
    key = f"mpgen/beat/{rank}"
    while not _STOPPING.is_set():
        try:
            store.add(key, 1)
        except Exception:  # the job's store went
            return
        _STOPPING.wait(BEAT)


def stop_beating() -> None:
    """End the heartbeat thread and wait for it, before the process group
    goes and the interpreter ends: a thread still inside the store's C++
    client when they do aborts the process ("terminate called without an
    active exception")."""
    _STOPPING.set()
    for thread in _BEATING:
        thread.join(timeout=10)
    _BEATING.clear()


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


@contextlib.contextmanager
def holding_sigterm():
    """SIGTERM as before, except while an exception is being handled (the
    training loop's failure on its way to lost(), then the exit): then it
    is ignored, so that torchrun's agent, which sends it to every worker
    once one ends, does not kill a live rank before it has named the lost
    ones (NOTE [A lost rank]). The loop's own handler still saves on it."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame) -> None:
        if sys.exc_info()[1] is not None:  # failing: lost() names the ranks, then exits
            return
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default: end now, by the signal
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def lost(grid: mesh.Mesh, error: BaseException, wait: float = 3.0) -> None:
    """A collective or a send failed: another rank stopped, or hangs past
    --timeout. Every rank that is still running says so in the job's store
    and names the ranks that are really gone, in one line (NOTE [A lost rank])."""
    text = one_line(error)
    words = ("connection", "timed out", "timeout", "closed", "peer", "gloo", "nccl")
    if not any(word in text.lower() for word in words):
        raise error
    gone = ""
    # torchrun's agent sends SIGTERM to every worker once it sees one end, and
    # kills them 30 s later: a rank still asking would otherwise die mid-wait,
    # stop beating, and be named gone by another (the wait is a few seconds).
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        missing = silent(grid.rank, dist.get_world_size(), wait)
        if missing:
            gone = f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} stopped or hung; "
    except Exception:  # the store went with the job: name no rank
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    sys.exit(
        f"{grid.where()}: {gone or 'another rank stopped or hung; '}lost contact ({text[:160]}); "
        "relaunch with --resume to continue from the last complete checkpoint"
    )


def silent(rank: int, world: int, wait: float) -> list[int]:
    """The ranks that are gone: neither said they are running within
    ``wait`` seconds nor beat while this rank waited for them and then for
    a confirmation round of as long again (NOTE [A lost rank])."""
    store = ATTEMPT[0] or dist.distributed_c10d._get_default_store()
    store.set(f"mpgen/running/{rank}", "1")
    running = [f"mpgen/running/{r}" for r in range(world)]
    beats = [f"mpgen/beat/{r}" for r in range(world)]
    counts = [store.add(key, 0) for key in beats]  # where each rank's beat is now
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not store.check(running):
        time.sleep(0.1)
    missing = [r for r in range(world) if not store.check([running[r]])]
    if not missing or ATTEMPT[0] is None:  # no heartbeats to ask
        return missing
    deadline = time.monotonic() + max(wait, 4 * BEAT)  # the confirmation round
    while missing and time.monotonic() < deadline:
        missing = [
            r
            for r in missing
            if not store.check([running[r]]) and store.add(beats[r], 0) == counts[r]
        ]
        time.sleep(0.1)
    return missing
