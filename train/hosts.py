"""The processes of a multi-host run: starting them together, and checking at start that
they agree (settings, data) and share the directories they write checkpoints into."""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from train.config import TrainConfig
from train.errors import TrainingError

# jax's own deadline for the processes to meet, past `--ddp_timeout`: it ends the
# process with a C++ abort and a stack, so jflash's one line comes first.
_ABORT_MARGIN_S = 10
# The shared-directory probe: reads of the file process 0 wrote, and the wait between.
_PROBE_READS, _PROBE_WAIT_S = 10, 0.3


def initialize_distributed(cfg: TrainConfig) -> None:
    """Multi-host through jax's own engine: flags, or the usual cluster variables. The
    processes have `--ddp_timeout` seconds to meet; past it every waiting process ends
    with one line saying what it waited for (exit status 2)."""
    p = cfg.parallel
    if p.coordinator_address or (p.num_processes or 0) > 1:
        _check_flags(p)
        where = {
            "coordinator_address": p.coordinator_address,
            "num_processes": p.num_processes,
            "process_id": p.process_id,
        }
    elif "JAX_COORDINATOR_ADDRESS" in os.environ or "SLURM_JOB_ID" in os.environ:
        where = {}
    else:
        return
    timer = threading.Timer(p.ddp_timeout, _not_met, args=(cfg,))
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(**where, initialization_timeout=p.ddp_timeout + _ABORT_MARGIN_S)
    finally:
        timer.cancel()


def _check_flags(p) -> None:
    """One line naming the flag where the three that place a process in a multi-host
    run do not fit together (jax's own words name none)."""
    if not p.coordinator_address:
        raise TrainingError(
            f"--num_processes={p.num_processes} needs --coordinator_address (process 0's "
            "host:port) and each process's --process_id"
        )
    if p.num_processes is None or p.process_id is None:
        missing = [
            f
            for f, v in (("--num_processes", p.num_processes), ("--process_id", p.process_id))
            if v is None
        ]
        raise TrainingError(
            f"--coordinator_address={p.coordinator_address!r} needs {' and '.join(missing)}"
            " (every process the same --num_processes, each its own --process_id)"
        )
    if p.num_processes < 1 or not 0 <= p.process_id < p.num_processes:
        raise TrainingError(
            f"--process_id={p.process_id} must be in [0, --num_processes={p.num_processes})"
        )


def _not_met(cfg: TrainConfig) -> None:
    """`initialize_distributed`'s deadline: one line, then the process ends (jax's own
    deadline would abort it with a C++ stack a little later)."""
    p = cfg.parallel
    who = (
        f"process {p.process_id} of {p.num_processes}"
        if p.num_processes is not None and p.process_id is not None
        else "this process"
    )
    at = p.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "the coordinator")
    print(
        f"error: {who} waited --ddp_timeout={p.ddp_timeout} s at {at} and the run's "
        "processes did not all meet: is every process started, with the same "
        "--coordinator_address (process 0's host:port, reachable from this host) and "
        "--num_processes, and each its own --process_id?",
        file=sys.stderr,
        flush=True,
    )
    os._exit(2)


def gather(value: Any) -> list[Any]:
    """`value` (JSON) of every process, in process order; `[value]` with one process."""
    if jax.process_count() == 1:
        return [value]
    text = json.dumps(value, sort_keys=True, default=str).encode()
    sizes = multihost_utils.process_allgather(np.array([len(text)], np.int32)).reshape(-1)
    mine = np.zeros(int(sizes.max()), np.uint8)
    mine[: len(text)] = np.frombuffer(text, np.uint8)
    every = multihost_utils.process_allgather(mine).reshape(len(sizes), -1)
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(every, sizes, strict=True)]


def same_on_every_process(values: dict[str, Any], what: str) -> None:
    """Refuses, on every process at once (TrainingError), `values` that differ between
    the processes of a multi-host run: each process gathers every process's (JSON) and
    names what differs. A run whose hosts were given other flags or other data would
    train a mix of them under process 0's record, or hang in a collective."""
    views = gather(values)
    differ = [k for k in sorted(views[0]) if any(v.get(k) != views[0][k] for v in views)]
    if differ:
        shown = "; ".join(
            f"{k}: " + ", ".join(f"process {i} has {v.get(k)!r}" for i, v in enumerate(views))
            for k in differ[:3]
        )
        raise TrainingError(
            f"the processes were given different {what} ({shown}): every process of a run "
            "takes the same flags (but --process_id) and reads the same data"
        )


def _probe(folder: str) -> tuple[str, list[dict[str, Any]], str | None]:
    """Process 0 writes a file with a random name where `folder` is (or the nearest
    folder above it that exists), every process looks for it at the same place in its
    own view of the path (a relative path resolves in each process's working
    directory), and process 0 removes it. `(process 0's folder, each process's
    {"sees", "path", "wrote"}, what process 0 could not write or None)`."""
    path = os.path.abspath(folder)
    probe, up = path, 0
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe, up = os.path.dirname(probe), up + 1
    is_main = jax.process_index() == 0
    token = secrets.token_hex(8) if is_main else ""
    first = gather({"up": up, "token": token, "where": probe})[0]
    where = path
    for _ in range(first["up"]):
        where = os.path.dirname(where)
    marker = os.path.join(where, f".jflash-shared-{first['token']}")
    wrote = None
    if is_main:
        try:
            with open(marker, "x") as f:
                f.write(first["token"])
        except OSError as e:
            wrote = f"{marker}: {e.strerror}"
    multihost_utils.sync_global_devices("jflash: shared directory probe written")
    sees = False
    for _ in range(_PROBE_READS):  # a network filesystem may show a new file late
        try:
            with open(marker) as f:
                sees = f.read() == first["token"]
        except OSError:
            pass
        if sees:
            break
        time.sleep(_PROBE_WAIT_S)
    views = gather({"sees": sees, "path": path, "wrote": wrote})
    if is_main and wrote is None:
        os.remove(marker)
    return first["where"], views, views[0]["wrote"]


def shared(folder: str) -> bool:
    """Whether `folder` is one directory to every process of the run (True with one
    process; False where process 0 cannot write there)."""
    if jax.process_count() == 1:
        return True
    _, views, wrote = _probe(folder)
    return wrote is None and all(v["sees"] for v in views)


def check_shared(folder: str, flag: str, why: str) -> None:
    """Refuses, on every process at once (TrainingError), a directory (`flag`'s value)
    that is not one directory to all the processes of a multi-host run (`why`: what
    they do there): a checkpoint saved on each host's own disk waits forever for the
    others' parts. See `_probe`."""
    if jax.process_count() == 1:
        return
    where, views, wrote = _probe(folder)
    if wrote is not None:
        raise TrainingError(f"{flag}={folder!r}: process 0 could not write {wrote}")
    blind = [i for i, v in enumerate(views) if not v["sees"]]
    if blind:
        paths = "; ".join(f"process {i}: {v['path']}" for i, v in enumerate(views[:4]))
        raise TrainingError(
            f"{flag}={folder!r} is not one directory shared by the run's processes: "
            f"{'process' if len(blind) == 1 else 'processes'} "
            f"{', '.join(map(str, blind[:8]))} cannot see a file process 0 wrote in "
            f"{where} ({paths}). {why}: give a path on a filesystem every host mounts"
        )


def first_on_process_0[T](
    fn: Callable[[], T], what: str, others: Callable[[], T] | None = None
) -> T:
    """`fn()` on process 0, then, once it has returned, on the other processes (what
    process 0 makes, the others find made; `others()` there where given); an error on
    process 0 is raised on every process (TrainingError on the others, naming `what`),
    so none waits alone."""
    if jax.process_count() == 1:
        return fn()
    is_main = jax.process_index() == 0
    error = result = None
    if is_main:
        try:
            result = fn()
        except Exception as e:  # every process learns of it, then process 0 raises it
            error = e
    failed = bool(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
    if error is not None:
        raise error
    if failed:
        raise TrainingError(f"{what} failed on process 0 (its output says why)")
    return result if is_main else (others or fn)()
