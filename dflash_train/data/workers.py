"""Worker processes: the items of one job spread over N processes, results back in item order.

Owns the process-level parallelism that evaluation and regeneration share. Batch-1 decoding of
a small target is bound by the host (Python and kernel launches), so one process leaves a GPU
mostly idle; more processes fill it, where more threads would fight over the interpreter lock
(the kernel launches of threads of one process take turns on it). Each worker is a spawned
process that builds its state once with `setup(device, *setup_args)` (typically: load its own
copy of the target on its device), then takes items from one shared queue and sends back
`work(state, item)`. The parent yields the results in item order whatever order the workers
finish in, so what a job writes does not depend on the number of workers. An exception in a
worker ends the job with that worker's traceback (a UserError: with its message and exit
status, as in the parent); a worker that dies without one (killed, out
of memory, segfault) ends it too, naming its exit code. Nothing waits forever on a dead worker.

`setup` and `work` must be module-level functions (spawn pickles them by name).
"""

from __future__ import annotations

import os
import queue
import traceback
from typing import Any, Callable, Iterable, Iterator

import torch

from dflash_train.core.errors import FAILED, UserError

POLL_S = 1.0  # how often the parent checks for dead workers while it waits for results


class WorkerError(UserError, RuntimeError):
    """A worker process failed; the message carries its traceback or exit code, or, for a
    mistake of the user's that the worker found (a UserError), its message and exit code."""

    def __init__(self, message: str, exit_code: int = FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def worker_devices(device: torch.device, num_workers: int) -> list[torch.device]:
    """The device of each worker: on `cuda` without an index, round-robin over the visible
    GPUs; otherwise every worker on `device`."""
    if device.type == "cuda" and device.index is None:
        count = max(1, torch.cuda.device_count())
        return [torch.device("cuda", w % count) for w in range(num_workers)]
    return [device] * num_workers


def _worker(rank: int, device: torch.device, threads: int, setup: Callable, setup_args: tuple,
            work: Callable, tasks, results) -> None:
    try:
        torch.set_num_threads(threads)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        state = setup(device, *setup_args)
        while (task := tasks.get()) is not None:
            index, item = task
            results.put((index, work(state, item), None))
    except UserError as err:  # said in words, like in the parent: no traceback
        results.put((None, None, (f"worker {rank} on {device}: {err}", err.exit_code)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent, then we exit
        results.put((None, None, (f"worker {rank} on {device} failed:\n{traceback.format_exc()}", FAILED)))


def parallel_map(setup: Callable, setup_args: tuple, work: Callable, items: Iterable[Any], *,
                 num_workers: int, device: torch.device) -> Iterator[Any]:
    """Yield `work(state, item)` for every item, in item order, computed by `num_workers`
    spawned processes (fewer when there are fewer items). Each worker gets an equal share of
    this machine's cores as torch threads. Closing the iterator early stops the workers."""
    items = list(items)
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if not items:
        return
    num_workers = min(num_workers, len(items))
    context = torch.multiprocessing.get_context("spawn")
    tasks, results = context.Queue(), context.Queue()
    for index, item in enumerate(items):
        tasks.put((index, item))
    for _ in range(num_workers):
        tasks.put(None)  # one stop sign per worker, behind every item
    threads = max(1, (os.cpu_count() or 1) // num_workers)
    processes = [
        context.Process(target=_worker, args=(rank, dev, threads, setup, setup_args, work, tasks, results),
                        daemon=True)
        for rank, dev in enumerate(worker_devices(device, num_workers))
    ]
    for process in processes:
        process.start()
    done: dict[int, Any] = {}
    next_index = 0
    try:
        while next_index < len(items):
            try:
                index, value, error = results.get(timeout=POLL_S)
            except queue.Empty:
                dead = [(rank, p.exitcode) for rank, p in enumerate(processes) if p.exitcode not in (None, 0)]
                if dead:
                    raise WorkerError(", ".join(f"worker {rank} died with exit code {code}" for rank, code in dead)
                                      + f" after {next_index} of {len(items)} items; no result came back from it")
                if all(p.exitcode == 0 for p in processes) and results.empty():
                    raise WorkerError(f"every worker exited but {len(items) - next_index} results never came back")
                continue
            if error is not None:
                raise WorkerError(*error)
            done[index] = value
            while next_index in done:
                yield done.pop(next_index)
                next_index += 1
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join()
        for channel in (tasks, results):
            channel.cancel_join_thread()  # unread items (after a failure) must not block our exit
            channel.close()
