"""A fake process group: torch's ``fake`` backend (``torch.testing._internal.distributed.fake_pg``:
collectives that move nothing), on which one process plays any rank of any world size, so that a
layout's mesh can be built and its model split or sharded on one CPU (the memory estimate, the dry run).
"""
from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def fake_process_group(world: int, rank: int = 0):
    """A fake process group of ``world`` ranks (no communication; this process is rank ``rank``),
    destroyed on exit, with ``sys.excepthook`` as it was. Raises RuntimeError when this process has a
    process group (a fake one lives in its process until destroyed: estimate in a child process)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("this process already has a process group; estimate in a child process")
    excepthook = sys.excepthook  # init_process_group prefixes uncaught tracebacks with the rank, for good
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
