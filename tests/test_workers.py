"""workers.parallel_map: results in item order whatever the finishing order, and a worker that
dies without a word ends the job instead of hanging it."""

from __future__ import annotations

import os
import time

import pytest
import torch

from dflash_train.core.errors import BAD_INPUT, FAILED, InputError
from dflash_train.data.workers import WorkerError, parallel_map, worker_devices


def _setup(device, offset):
    return offset


def _work(offset, item):
    if item == "die":
        os._exit(3)  # like a kill -9 or the OOM killer: no exception, no message
    if item == "mistake":
        raise InputError("--thing x: not a thing")
    if item == "bug":
        raise KeyError("oops")
    time.sleep(0.3 if item == 0 else 0.0)  # the first item finishes last
    return item + offset, os.getpid()


def test_results_come_back_in_order_and_a_dead_worker_fails_the_job():
    results = list(parallel_map(_setup, (100,), _work, range(6), num_workers=2, device=torch.device("cpu")))
    assert [value for value, _ in results] == [100, 101, 102, 103, 104, 105]
    assert os.getpid() not in {pid for _, pid in results}
    started = time.perf_counter()
    with pytest.raises(WorkerError, match="exit code 3"):
        list(parallel_map(_setup, (0,), _work, [1, "die", 2, 3], num_workers=2, device=torch.device("cpu")))
    assert time.perf_counter() - started < 60


def test_a_user_mistake_in_a_worker_keeps_its_words_and_exit_code_and_a_bug_its_traceback():
    with pytest.raises(WorkerError) as mistake:
        list(parallel_map(_setup, (0,), _work, ["mistake"], num_workers=1, device=torch.device("cpu")))
    assert str(mistake.value) == "worker 0 on cpu: --thing x: not a thing" and mistake.value.exit_code == BAD_INPUT
    with pytest.raises(WorkerError) as bug:
        list(parallel_map(_setup, (0,), _work, ["bug"], num_workers=1, device=torch.device("cpu")))
    assert "Traceback" in str(bug.value) and "KeyError: 'oops'" in str(bug.value) and bug.value.exit_code == FAILED


def test_devices_round_robin_over_gpus_only_for_plain_cuda():
    assert worker_devices(torch.device("cpu"), 3) == [torch.device("cpu")] * 3
    assert worker_devices(torch.device("cuda", 1), 2) == [torch.device("cuda", 1)] * 2
    count = max(1, torch.cuda.device_count())
    assert worker_devices(torch.device("cuda"), 3) == [torch.device("cuda", w % count) for w in range(3)]
