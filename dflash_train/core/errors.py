"""The command line's error contract: the errors a user is told about in words, their exit codes,
and the cheap checks of output paths that commands run before anything heavy.

Every command ends in one of five ways (cli.main is the one place that turns these errors into
`dflash-train CMD: ...` lines on stderr and an exit status):
- 0: done.
- 2 (`BAD_INPUT`): something the user gave is wrong: an option or config value, a path, a
  file's content, a folder that is not what it must be (a model, a drafter, a checkpoint of
  this run), a device that is not there. The message names the thing and the fix; nothing
  heavy has run when the check needs nothing heavy.
- 1 (`FAILED`): the work failed on the way with nothing wrong in what was given: a server that
  does not answer, a worker process that died, a run that stopped itself (too many bad steps),
  a file operation the system refused (a full disk).
- 3 (`PEER_LOST`): another rank of a torchrun job died or stopped answering.
- 130 (`INTERRUPTED`): Ctrl-C anywhere, or a signal that stopped `data regenerate` (or the
  embedded default on a GPU) before its end; what was finished is kept and the same command
  resumes. (`train` stopped by a signal saves a checkpoint and exits 0: its resume is the rerun.)
A Python traceback (exit 1) is a bug of ours, never a user's mistake.

The project's error types derive from `UserError` and keep the built-in type they are
(`ValueError` for bad input, `RuntimeError` for failures), so code that catches those still
does. `InputError` is the plain bad-input error; `MissingPath` is also a FileNotFoundError.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

FAILED = 1
BAD_INPUT = 2
PEER_LOST = 3
INTERRUPTED = 130


class UserError(Exception):
    """An error said to the user in words, without a traceback; exits with `exit_code`."""

    exit_code = BAD_INPUT


class InputError(UserError, ValueError):
    """A value, path or file content that the user must fix (exit 2)."""


class MissingPath(InputError, FileNotFoundError):
    """A path that does not exist or lacks the file it must hold (exit 2)."""


def problems_of(*checks: Callable[[], object]) -> list[str]:
    """The messages of the UserErrors that `checks` raise, each called once, so that a command
    reports every problem at once (a config error's problems one by one)."""
    problems = []
    for check in checks:
        try:
            check()
        except UserError as err:
            problems += getattr(err, "problems", None) or [str(err)]
    return problems


def folder_problem(path: str | os.PathLike) -> str | None:
    """What stops this process from creating folder `path` (or writing in it, when it exists), in
    words; None when nothing does. Tried for real in the nearest existing folder (a probe folder
    made there and removed): permission bits tell neither what root may do nor a read-only
    mount. Nothing is created or left behind."""
    path = Path(path).expanduser()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dflash-train-probe-", dir=existing))
    except OSError as err:
        return f"cannot write in {existing} ({err.strerror or err})"
    return None


def output_file_problem(path: str | os.PathLike) -> str | None:
    """What stops this process from writing file `path` (its folder created if needed); None
    when nothing does."""
    path = Path(path).expanduser()
    if path.is_dir():
        return f"{path} is a folder; give a file name"
    return folder_problem(path.parent)
