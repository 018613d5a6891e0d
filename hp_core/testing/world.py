"""A reusable multi-process world: real gloo process groups on CPU.

Spawning processes and importing torch costs seconds, so a ``World`` is spawned once
and then runs many tasks. A task is a picklable module-level function; it runs on
every rank at once and its per-rank return values come back as a list. A failing rank
raises ``WorldTaskError`` carrying every rank's traceback; a hang becomes
``WorldTimeoutError`` and the world is torn down (the next ``get_world`` call spawns a
fresh one), so a bug never stalls a test session.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = [
    "World",
    "WorldError",
    "WorldTaskError",
    "WorldTimeoutError",
    "get_world",
    "shutdown_worlds",
]

DEFAULT_TIMEOUT = float(os.environ.get("HP_WORLD_TIMEOUT", "120"))


class WorldError(RuntimeError):
    """The world could not start, or is no longer usable."""


class WorldTaskError(WorldError):
    """A task raised on one or more ranks; the message holds each failing rank's traceback."""

    def __init__(
        self, fn_name: str, failures: dict[int, str], exceptions: dict[int, BaseException | None]
    ):
        self.failures = failures
        self.exceptions = exceptions
        parts = [f"task {fn_name} failed on rank(s) {sorted(failures)}:"]
        for rank in sorted(failures):
            parts.append(f"--- rank {rank} ---\n{failures[rank].rstrip()}")
        super().__init__("\n".join(parts))


class WorldTimeoutError(WorldError):
    """A task did not finish on every rank in time (a hang or a deadlock)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int, world_size: int, port: int, sys_path: list[str], tasks: Any, results: Any
) -> None:
    sys.path[:] = sys_path
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT),
        )
    except Exception:
        results.put((rank, -1, False, traceback.format_exc(), None))
        return
    results.put((rank, -1, True, None, None))
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, fn, args, kwargs = item
        try:
            value = fn(*args, **kwargs)
            import pickle

            try:
                pickle.dumps(value)
            except Exception as e:
                raise TypeError(
                    f"task result of type {type(value).__name__} cannot be sent back (not "
                    f"picklable): {e}"
                ) from None
            results.put((rank, task_id, True, value, None))
        except BaseException as e:  # report everything, including assertion failures
            exc: BaseException | None = e
            try:
                import pickle

                pickle.dumps(e)
            except Exception:
                exc = None
            results.put((rank, task_id, False, traceback.format_exc(), exc))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


class World:
    """``world_size`` spawned ranks, each with a gloo default process group."""

    def __init__(self, world_size: int, *, start_timeout: float = 120.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, list(sys.path), self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._next_id = 0
        self.alive = True
        ready: dict[int, Any] = {}
        deadline = time.monotonic() + start_timeout
        while len(ready) < world_size:
            rank, _tid, ok, payload, _ = self._get(deadline, "start")
            if not ok:
                self.close()
                raise WorldError(f"rank {rank} failed to join the gloo process group:\n{payload}")
            ready[rank] = True

    def _get(self, deadline: float, what: str) -> tuple[Any, ...]:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                raise WorldTimeoutError(
                    f"world of {self.world_size}: {what} did not finish in time; the ranks were "
                    "stopped (a collective that not every rank reached is the usual cause)."
                )
            try:
                return self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    self.close()
                    raise WorldError(
                        f"world of {self.world_size}: rank(s) {dead} died (exit codes {codes}) "
                        f"during {what}."
                    ) from None

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        failure_grace: float = 10.0,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        Once a rank has failed, the others get ``failure_grace`` seconds to finish (they may be
        stuck in a collective the failed rank never reached); then the world is torn down.
        """
        if not self.alive:
            raise WorldError("this world was closed; use get_world() for a fresh one")
        task_id = self._next_id
        self._next_id += 1
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        name = getattr(fn, "__qualname__", repr(fn))
        deadline = time.monotonic() + (timeout if timeout is not None else DEFAULT_TIMEOUT)
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        exceptions: dict[int, BaseException | None] = {}
        while len(values) + len(failures) < self.world_size:
            if failures:
                # Other ranks may be stuck in a collective the failing rank never reached.
                deadline = min(deadline, time.monotonic() + failure_grace)
            try:
                rank, tid, ok, payload, exc = self._get(deadline, f"task {name}")
            except WorldTimeoutError:
                if failures:  # the world was closed: the surviving ranks are stuck
                    raise WorldTaskError(name, failures, exceptions) from None
                raise
            if tid != task_id:
                continue
            if ok:
                values[rank] = payload
            else:
                failures[rank] = payload
                exceptions[rank] = exc
        if failures:
            raise WorldTaskError(name, failures, exceptions)
        return [values[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop every rank (politely, then by force)."""
        if not getattr(self, "alive", False):
            return
        self.alive = False
        for q in self._tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)


_WORLDS: dict[int, World] = {}


def get_world(world_size: int) -> World:
    """The shared world of this size for this process, spawned on first use."""
    w = _WORLDS.get(world_size)
    if w is None or not w.alive:
        w = World(world_size)
        _WORLDS[world_size] = w
    return w


def shutdown_worlds() -> None:
    """Close every shared world (registered at exit)."""
    for w in list(_WORLDS.values()):
        w.close()
    _WORLDS.clear()


atexit.register(shutdown_worlds)
