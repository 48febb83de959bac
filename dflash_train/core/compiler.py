"""torch.compile settings shared by every compiled function of the package: the recompile limit.

A run sees a handful of shapes (bucketed batches, packed rows of one length, bucketed anchor
counts); the limit is raised so that a long run never falls back to eager code late (eager flex
attention would materialise the whole score matrix)."""

from __future__ import annotations

RECOMPILE_LIMIT = 64  # graphs per compiled function


def raise_recompile_limit() -> None:
    """At least RECOMPILE_LIMIT graphs per compiled function (never lowers a higher setting)."""
    # torch._dynamo takes over a second to import: only a process that compiles pays for it.
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
