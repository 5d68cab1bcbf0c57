"""The Engine pool's key (tests/engine_pool.py): modules share an Engine only where every ServerArgs field and
the attached BASTION config agree, so no test gets an Engine configured for another."""

from __future__ import annotations

from pathlib import Path

from engine_pool import pool_key
from engine_support import engine_server_args

from bastion_sglang.registration import make_config


def test_equal_configurations_share_a_key_and_any_difference_splits_it(tiny_pair: tuple[Path, Path]) -> None:
    reference = pool_key(engine_server_args(tiny_pair, None))
    assert pool_key(engine_server_args(tiny_pair, None)) == reference
    chain = pool_key(engine_server_args(tiny_pair, make_config(policy="chain")))
    assert chain == pool_key(engine_server_args(tiny_pair, make_config(policy="chain")))
    different = [
        pool_key(engine_server_args(tiny_pair, None, disable_overlap_schedule=True)),
        pool_key(engine_server_args(tiny_pair, None, page_size=16)),
        pool_key(engine_server_args((tiny_pair[0].parent / "other", tiny_pair[1]), None)),
        chain,
        pool_key(engine_server_args(tiny_pair, make_config(policy="fixed:8"))),
        pool_key(engine_server_args(tiny_pair, make_config(policy="chain", topk=2))),
    ]
    assert len({reference, *different}) == len(different) + 1
