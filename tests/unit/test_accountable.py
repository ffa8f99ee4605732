"""Accountable mode's pure parts (issue 26): the validator draw, the planner's and simulator's byte and pass
counts, the run config and the part-size bound."""

from __future__ import annotations

import pytest

from geomesh_p2p.config.method import MethodRule, encoded_nbytes
from geomesh_p2p.exchange import CollectiveSpec, PartOwner, accountable, max_part_elements
from geomesh_p2p.exchange.partition import VALIDATION_BYTES
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.node.peer import RunConfig
from geomesh_p2p.plan.planner import EXCHANGE_BASE_PASSES, exchange_passes
from geomesh_p2p.sim.link_time import exchange_bytes
from geomesh_p2p.sim.methods import parse_method

pytestmark = pytest.mark.timeout(60)


def _spec(n=6, **kw) -> CollectiveSpec:
    ids = [Identity.generate().peer_id.to_string() for _ in range(n)]
    owners = [PartOwner(p, f"127.0.0.1:{1000 + k}", k * 2048, (k + 1) * 2048) for k, p in enumerate(ids)]
    return CollectiveSpec("acc", 3, {p: 100 for p in ids}, owners, n * 2048, 10.0, 11.0, mode="accountable", **kw)


def test_validators_are_drawn_among_the_others_and_the_owner_cannot_move_its_own_draw():
    spec = _spec(6, validators_per_part=2)
    hashes = [bytes([k]) * 32 for k in range(6)]
    for j, o in enumerate(spec.owners):
        drawn = accountable.draw_validators(spec, hashes, j, 2)
        assert len(drawn) == 2 and o.peer_id not in drawn and len(set(drawn)) == 2
        assert drawn == accountable.draw_validators(spec, list(hashes), j, 2)  # the same on every peer
        # the part's own result hash is not in its seed: its owner re-signing other bytes changes nothing
        other = list(hashes)
        other[j] = b"\xff" * 32
        assert accountable.draw_validators(spec, other, j, 2) == drawn
    assert len(accountable.draw_validators(spec, hashes, 0, 99)) == 5
    # another part's result changes the draw of the others (the seed commits to every other result)
    seeds = {
        accountable.validator_seed(spec, [bytes([k]) * 32 for k in range(5)] + [bytes([x]) * 32], 0) for x in range(9)
    }
    assert len(seeds) == 9


def test_bytes_model_is_reencode_plus_v_part_inputs_per_part():
    parts = [256, 256, 256, 256]
    s = encoded_nbytes("sign", 256, 64)
    ree = exchange_bytes(parts, contribution="sign", aggregate="sign", mode="reencode", block_size=64)
    acc = exchange_bytes(parts, contribution="sign", aggregate="sign", mode="accountable", block_size=64, validators=1)
    # one part more each way: every owner's own contribution to its part's witness
    assert [a - b for a, b in zip(acc.push_up, ree.push_up)] == [s] * 4
    assert [a - b for a, b in zip(acc.push_down, ree.push_down)] == [s] * 4
    # one validation: 4 inputs but the validator's own (it holds its push: PullInputs omit_caller)
    assert [a - b for a, b in zip(acc.pull_up, ree.pull_up)] == [3 * s] * 4
    assert [a - b for a, b in zip(acc.pull_down, ree.pull_down)] == [3 * s] * 4  # 3 parts x 3 inputs / 3
    acc2 = exchange_bytes(parts, contribution="sign", aggregate="sign", mode="accountable", block_size=64, validators=2)
    assert [a - b for a, b in zip(acc2.pull_up, ree.pull_up)] == [6 * s] * 4
    with pytest.raises(ValueError, match="accountable"):
        exchange_bytes(parts, contribution="sign", aggregate="sign", mode="gossip", block_size=64)


def test_planner_cost_and_run_config():
    rule = MethodRule.of("geomesh", mode="accountable", validators_per_part=2)
    s = encoded_nbytes("sign", 1 << 20, 2048, header=False)
    # + the witness's copy of one part, - each validation's own input (2 validators)
    assert rule.payload_bytes(1 << 20, 64) == 4 * s + s // 64 - 2 * (s // 64)
    assert MethodRule.of("geomesh", mode="reencode").payload_bytes(1 << 20, 64) == 2 * s
    assert exchange_passes(8, "accountable", 1) == EXCHANGE_BASE_PASSES + 2
    assert exchange_passes(8, "accountable", 3) == EXCHANGE_BASE_PASSES + 4
    cfg = RunConfig(mode="accountable", validators_per_part=2)
    assert MethodRule.from_run(cfg).validators_per_part == 2
    # validators_per_part is a patch field: at its default, the config hash is what it was without it
    assert "validators_per_part" in RunConfig.patch_fields
    with pytest.raises(ValueError):
        RunConfig(mode="accountable", validators_per_part=-1)


def test_accountable_parts_keep_a_validators_inputs_bounded():
    kw = dict(push_encoding="sign", aggregate_encoding="sign", block_size=2048, max_message_bytes=128 << 20)
    small = max_part_elements(mode="accountable", n_participants=4, **kw)
    assert small == max_part_elements(mode="reencode", n_participants=4, **kw)  # the pipeline cut binds first
    big = max_part_elements(mode="accountable", n_participants=1024, **kw)
    per = encoded_nbytes("sign", 2048, 2048, header=False) / 2048
    assert big < small and big * per * 1024 <= VALIDATION_BYTES and big % 2048 == 0
    assert _spec(3).to_dict()["validators_per_part"] == 1
    # specs of the other modes keep their spec_id (validators_per_part is not in their canonical JSON)
    p = Identity.generate().peer_id.to_string()
    s1 = CollectiveSpec("a", 1, {p: 1}, [PartOwner(p, "h:1", 0, 8)], 8, 1.0, 2.0)
    s2 = CollectiveSpec("a", 1, {p: 1}, [PartOwner(p, "h:1", 0, 8)], 8, 1.0, 2.0, validators_per_part=3)
    assert s1.spec_id == s2.spec_id


def test_simulator_method_modifier():
    spec = parse_method("geomesh+accountable")
    assert spec.mode == "accountable" and spec.compressed
    assert parse_method("geomesh").mode == "reencode"


def test_the_witness_of_a_part_is_the_next_owner_that_is_another_peer():
    spec = _spec(3)
    pids = [o.peer_id for o in spec.owners]
    assert [accountable.witness_of(spec, j).peer_id for j in range(3)] == [pids[1], pids[2], pids[0]]
    # a peer owning several parts (split_owners) is never its own witness; one owner alone has none
    a, b = pids[0], pids[1]
    owners = [
        PartOwner(a, "127.0.0.1:1", 0, 100),
        PartOwner(a, "127.0.0.1:1", 100, 200),
        PartOwner(b, "127.0.0.1:2", 200, 300),
    ]
    split = CollectiveSpec("acc", 3, {a: 100, b: 100}, owners, 300, 10.0, 11.0, mode="accountable")
    assert [accountable.witness_of(split, j).peer_id for j in range(3)] == [b, b, a]
    alone = CollectiveSpec(
        "acc", 3, {a: 100}, [PartOwner(a, "127.0.0.1:1", 0, 300)], 300, 10.0, 11.0, mode="accountable"
    )
    assert accountable.witness_of(alone, 0) is None
