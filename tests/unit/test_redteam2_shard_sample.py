"""Red team 2 (session 19): a leader that concentrates its lies in one record shard vs the light followers'
shard-at-a-time sample (round/light.py::draw_in_shards)."""

from __future__ import annotations

import random

import pytest

from geomesh_p2p.round import light
from geomesh_p2p.schema.shards import record_shard


@pytest.mark.timeout(60)
def test_lies_about_one_whole_shard_are_caught_about_as_often_as_by_a_uniform_sample(monkeypatch):
    """N = 1,024 participants, S = 16 (the documented setting), light_sample = 8 (the leader + 7 drawn). A leader
    lies about the figures of every participant of one shard (~64 of 1,023, 6 %). A uniform sample of 7 sees a
    lie with probability 1 - (1 - 64/1023)^7 ~ 36 %; a sample drawn a shard at a time lands in the lied-about
    shard with probability ~1/16 only (~6 %): the follower follows the lying plan ~94 % of the time."""
    monkeypatch.setattr(light, "_draw", random.Random(7))
    gen = random.Random(1)
    peers = [f"Qm{gen.getrandbits(128):032x}" for _ in range(1023)]
    shards, k = 16, 7
    lied = {p for p in peers if record_shard(p, shards) == 3}
    uniform = 1 - (1 - len(lied) / len(peers)) ** k
    trials = 3000
    caught = sum(bool(lied.intersection(light.draw_in_shards(peers, k, shards))) for _ in range(trials))
    assert caught / trials >= 0.8 * uniform, (caught / trials, uniform, len(lied))
