"""One pool of live `sglang.Engine`s for the whole test run, keyed by configuration.

Several modules start an Engine of the same configuration (most often the no-speculation reference of the
tiny pair, `tiny_pair`): each start costs a scheduler and a detokenizer process, a model load and a warm-up,
about 15 s on a 2-core CPU. `engine_pool.engine(server_args)` returns the live Engine of that configuration,
starting it on first use, so every module after the first reuses it. The key is the whole resolved
`ServerArgs` (every field after SGLang's own defaulting) and the attached BASTION config, so two modules share
an Engine only where SGLang could not tell their Engines apart.

Pooled Engines sleep while idle (`sleep_on_idle`, which changes no output): an idle SGLang scheduler otherwise
polls its sockets on a whole core. At most CAPACITY stay up; the least recently used is shut down to start
another, and all are shut down when the run ends. A test that needs an Engine of its own, shut down at a point
it controls (abort, pressure, restart), starts it itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from bastion_sglang.integration.config import config_of

CAPACITY = 2
"""Live Engines at most: a tiny pair's Engine holds about 1 GB of host memory across its processes."""


def pool_key(server_args: Any) -> str:
    """The configuration an Engine is pooled under: every ServerArgs field (a msgspec Struct) and the
    attached BASTION config."""
    fields = ", ".join(f"{name}={getattr(server_args, name)!r}" for name in server_args.__struct_fields__)
    return f"{fields}; bastion={config_of(server_args)!r}"


class EnginePool:
    """Live Engines by `pool_key`, least recently used first."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self.live: OrderedDict[str, Any] = OrderedDict()
        self.starts = 0

    def engine(self, server_args: Any) -> Any:
        """The live Engine of `server_args`' configuration, started (with sleep_on_idle) if none is up."""
        import sglang

        server_args.sleep_on_idle = True
        key = pool_key(server_args)
        if key in self.live:
            self.live.move_to_end(key)
            engine = self.live[key]
            engine.flush_cache()  # each user starts from an empty prefix cache, as on a fresh Engine
            return engine
        while len(self.live) >= self.capacity:
            _, oldest = self.live.popitem(last=False)
            oldest.shutdown()
        engine = sglang.Engine(server_args=server_args)
        self.starts += 1
        self.live[key] = engine
        return engine

    def close(self) -> None:
        """Shut every live Engine down."""
        while self.live:
            _, engine = self.live.popitem(last=False)
            engine.shutdown()


@pytest.fixture(scope="session")
def engine_pool() -> Iterator[EnginePool]:
    pool = EnginePool()
    try:
        yield pool
    finally:
        pool.close()


@contextmanager
def started(server_args: Any, pool: EnginePool | None) -> Iterator[Any]:
    """An Engine of `server_args`: the pool's, left up for the next user, or (pool None) one of its own,
    shut down on leaving."""
    if pool is not None:
        yield pool.engine(server_args)
        return
    import sglang

    engine = sglang.Engine(server_args=server_args)
    try:
        yield engine
    finally:
        engine.shutdown()
