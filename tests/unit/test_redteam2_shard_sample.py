"""Red team 2 (session 19): a leader that concentrates its lies in one record shard vs the light followers'
shard-at-a-time sample (round/light.py::draw_in_shards)."""

from __future__ import annotations

import functools
import random
from types import SimpleNamespace

import pytest

from geomesh_p2p.round import light
from geomesh_p2p.schema.shards import record_shard


@pytest.mark.timeout(60)
def test_lies_about_one_whole_shard_are_caught_about_as_often_as_by_a_uniform_sample(monkeypatch):
    """N = 1,024 participants, S = 16 (the documented setting), light_sample = 8 (the leader + 7 drawn). A leader
    lies about the figures of every participant of one shard (~64 of 1,023, 6 %). A uniform sample of 7 sees a
    lie with probability 1 - (1 - 64/1023)^7 ~ 36 %. The plan check's sample (``plan_sample``) is drawn uniformly,
    whatever the shards: a shard-at-a-time draw (``draw_in_shards``, the digest check's) landed in the lied-about
    shard ~1/16 of the time only (~6 %: the finding; the follower then followed the lying plan ~94 % of the time)."""
    monkeypatch.setattr(light, "_draw", random.Random(7))
    # the same shards, each hashed once: draw_in_shards hashes every peer twice a draw (6.1 million SHA-256 of the
    # same 1,023 ids in 3,000 draws, ~10 CPU-s); record_shard is pure, so the draws and counts are the same
    monkeypatch.setattr(light, "record_shard", functools.lru_cache(maxsize=None)(light.record_shard))
    gen = random.Random(1)
    peers = [f"Qm{gen.getrandbits(128):032x}" for _ in range(1023)]
    shards, k = 16, 7
    lied = {p for p in peers if record_shard(p, shards) == 3}
    uniform = 1 - (1 - len(lied) / len(peers)) ** k
    plan = SimpleNamespace(leader="leader", participants=lambda: ["leader", "me", *peers])
    trials = 3000
    caught = sum(bool(lied.intersection(light.plan_sample(plan, "me", k + 1))) for _ in range(trials))
    assert caught / trials >= 0.8 * uniform, (caught / trials, uniform, len(lied))
    one_shard = sum(bool(lied.intersection(light.draw_in_shards(peers, k, shards))) for _ in range(trials))
    assert one_shard / trials < 0.1 < 0.3 < caught / trials, (one_shard / trials, caught / trials)
