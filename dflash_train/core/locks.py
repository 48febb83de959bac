"""Advisory locks: one process (and the workers it starts) owns a run folder, a regeneration
output or a cache folder at a time.

Owns `hold` (a second owner is refused at once with one line naming the holder's pid and host)
and `wait_for` (a second owner waits, told once who it waits for). Both are `filelock` locks
(flock on the lock file): the kernel drops a lock whose process dies, so the lock of a killed
run is free for the next one, and no age or heartbeat has to be guessed. The holder writes its
pid, host, start time and command line into the lock file once it holds it (filelock's
`on_acquired`), which is what a refused process reads to say who holds it. A lock file stays in
place when released (a waiter may hold it open); `discard_if_created` removes one that a refused
command created, so that the refusal changes nothing on disk.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock, Timeout

from dflash_train.core.errors import InputError

# The filesystem has no flock (some network mounts): the work goes on unlocked, said once.
NO_LOCKING = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)


class Busy(InputError):
    """Another process holds the lock of what this command would write (exit 2)."""


_COMMAND: list[str] = []  # the arguments of the `dflash-train` command this process runs (cli.main)


def remember_command(args: list[str]) -> None:
    """The arguments this process's `dflash-train` command was given (cli.main)."""
    _COMMAND[:] = [str(a) for a in args]


def command_line() -> str:
    """This process's command as a user would type it again: `dflash-train ARGS` (`python -m
    dflash_train` is the same command); under torchrun, the same launch of `-m dflash_train ARGS`."""
    if not _COMMAND:
        argv = list(sys.argv)
        return shlex.join(["dflash-train", *argv[1:]] if argv and Path(argv[0]).name in
                          ("dflash-train", "__main__.py") else argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"the same torchrun launch of -m dflash_train {shlex.join(_COMMAND)}"
    return shlex.join(["dflash-train", *_COMMAND])


def _write_holder(fd: int) -> None:
    """filelock's on_acquired: who holds the lock, written into the lock file it holds open."""
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "command": command_line()}
    data = (json.dumps(holder) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def holder(lock_file: Path) -> str:
    """Who holds `lock_file`, in words: its pid, host, since when and its command; what is
    known when the file is not (yet) readable."""
    try:
        info = json.loads(Path(lock_file).read_text())
        return (f"pid {info['pid']} on host {info['host']} (since {info['since']}: "
                f"{info.get('command') or 'an unknown command'})")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (which has not written its pid yet)"


def _lock(lock_file: Path) -> FileLock:
    # One instance per path in a process (is_singleton): a function that holds a folder's lock
    # may call one that takes it again.
    return FileLock(str(lock_file), is_singleton=True, on_acquired=_write_holder)


@contextlib.contextmanager
def _held(lock_file: Path, when_busy: Callable[[FileLock], None],
          unlocked: Callable[[OSError], None]) -> Iterator[None]:
    """`lock_file`'s lock held while the block runs; `when_busy(lock)` runs when another process
    holds it (it raises, or acquires the lock by waiting). On a filesystem without locks the
    block runs unlocked, after `unlocked(error)`."""
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    lock = _lock(lock_file)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        when_busy(lock)
    except OSError as err:
        if err.errno not in NO_LOCKING:
            raise
        unlocked(err)
        yield
        return
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def hold(lock_file: Path, what: str, fix: str, log: Callable[[str], None] = print) -> Iterator[None]:
    """Hold `lock_file` while the block runs; when another process holds it, Busy at once:
    `{what} is in use by pid P on host H (...): {fix}`. A lock whose holder died is taken."""

    def refuse(lock: FileLock) -> None:
        raise Busy(f"{what} is in use by {holder(Path(lock_file))}: {fix}") from None

    def say_unlocked(err: OSError) -> None:
        log(f"{what}: this filesystem has no file locks ({err.strerror}); make sure no other process writes it")

    with _held(lock_file, refuse, say_unlocked):
        yield


@contextlib.contextmanager
def wait_for(lock_file: Path, what: str, log: Callable[[str], None] = print) -> Iterator[None]:
    """Hold `lock_file` while the block runs, waiting for another holder to finish first (said
    once, with who it is): for a cache that processes started at once build once."""

    def wait(lock: FileLock) -> None:
        log(f"{what} is being built by {holder(Path(lock_file))}; waiting for it")
        lock.acquire()

    with _held(lock_file, wait, lambda err: None):
        yield


@contextlib.contextmanager
def discard_if_created(lock_file: Path, folder: Path | None = None) -> Iterator[None]:
    """Around a command that may refuse (a UserError) after taking its lock: when the block
    raises one and the lock file (and `folder`, the folder the lock created) did not exist
    before, they are removed again, so that the refusal leaves the disk as it was."""
    lock_file = Path(lock_file)
    had_lock = lock_file.exists()
    had_folder = folder is None or Path(folder).exists()
    try:
        yield
    except InputError:
        if not had_lock:
            lock_file.unlink(missing_ok=True)
        if not had_folder:
            with contextlib.suppress(OSError):
                Path(folder).rmdir()  # only when empty
        raise
