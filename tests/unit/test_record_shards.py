"""Which shard a peer record lives in (``geomesh_p2p.schema.shards``), the run-config field, and a light
follower's sample drawn a shard at a time (issue 25)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest

from geomesh_p2p.config.models import RunConfig
from geomesh_p2p.round.light import draw_in_shards
from geomesh_p2p.schema.shards import check_shards, record_shard, records_key, shards_of

pytestmark = pytest.mark.timeout(30)

IDS = [f"12D3KooWpeer{i:05d}" for i in range(4096)]


def test_a_shard_is_the_top_bits_of_the_peer_ids_hash_and_doubling_splits_each_shard_in_two():
    top = int.from_bytes(hashlib.sha256(IDS[7].encode()).digest()[:8], "big")
    assert record_shard(IDS[7], 1) == 0
    assert record_shard(IDS[7], 16) == top >> 60
    assert record_shard(IDS[7], 256) == top >> 56
    for p in IDS[:512]:
        for s in (1, 2, 4, 8, 16, 32, 64, 128):
            assert record_shard(p, 2 * s) // 2 == record_shard(p, s)
    # 4,096 fixed ids over 16 shards: every shard holds some 256 +- 6 sd (the hash spreads them)
    counts = Counter(record_shard(p, 16) for p in IDS)
    assert sorted(counts) == list(range(16))
    assert 160 < min(counts.values()) <= max(counts.values()) < 352, counts


def test_shard_keys_and_counts_that_are_refused():
    assert records_key("run", 0, 1) == "run/peers"  # the layout of every release before 0.6.0
    assert records_key("run", 5, 8) == "run/peers/8/5"
    assert shards_of(["a", "b", "c"], 1) == {0: ["a", "b", "c"]}
    for bad in (0, 3, 6, 512, -4):
        with pytest.raises(ValueError, match=f"power of two from 1 to 256, not {bad}"):
            check_shards(bad)
    with pytest.raises(ValueError, match="shard 8 is not in 0..7"):
        records_key("run", 8, 8)
    with pytest.raises(ValueError, match="record_shards must be a power of two"):
        RunConfig(record_shards=12)


def test_the_config_hash_at_one_shard_is_the_hash_of_the_releases_before():
    cfg = RunConfig()
    d = cfg.model_dump()
    for k in RunConfig.patch_fields:  # patch fields, at their defaults
        del d[k]
    assert cfg.config_hash() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    assert RunConfig(record_shards=16).config_hash() != cfg.config_hash()
    # group_size (issue 26): 0 keeps the hash of the releases before; a grouped run's differs
    assert RunConfig(mode="reencode", group_size=3).config_hash() != RunConfig(mode="reencode").config_hash()
    # 0.12: auto (None) is the default and hashes as left out; one group asked for (0) is a setting of its own
    assert RunConfig(group_size=None).config_hash() == cfg.config_hash() != RunConfig(group_size=0).config_hash()


def test_a_light_followers_sample_is_drawn_a_shard_at_a_time():
    peers = IDS[:256]
    for _ in range(50):
        one = draw_in_shards(peers, 8, 4)  # ~64 a shard: one shard holds the whole sample
        assert len(one) == len(set(one)) == 8
        assert len({record_shard(p, 4) for p in one}) == 1
        spread = draw_in_shards(peers[:20], 8, 16)  # ~1.25 a shard: shard after shard until 8
        assert len(spread) == len(set(spread)) == 8
        # whole shards are taken before the next is started: at most the last one touched is partly drawn
        members = Counter(record_shard(p, 16) for p in peers[:20])
        touched = Counter(record_shard(p, 16) for p in spread)
        assert sum(touched[s] < members[s] for s in touched) <= 1, (touched, members)
    assert sorted(draw_in_shards(peers[:5], 8, 4)) == sorted(peers[:5])  # fewer than k: all of them
    assert len(set(draw_in_shards(peers, 8, 1))) == 8


def test_the_clis_refuse_a_shard_count_that_is_no_power_of_two_in_one_line(capsys):
    from bootstrap.cli import _check, parse as boot_parse
    from peer.cli import main

    assert _check(boot_parse(["--record-shards", "16"])) is None
    with pytest.raises(SystemExit) as ei:
        boot_parse(["--record-shards", "6"])
    assert ei.value.code == 2
    assert "--record-shards 6: must be a power of two from 1 to 256, not 6" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        main(["status", "--bootstrap", "127.0.0.1:1", "--record-shards", "3"])
    assert ei.value.code == 2
    assert "argument --record-shards: must be a power of two from 1 to 256, not 3" in capsys.readouterr().err
    assert main(["join", "--record-shards", "12", "--pow-bits", "0"]) == 2
    assert "record_shards must be a power of two from 1 to 256, not 12" in capsys.readouterr().err
