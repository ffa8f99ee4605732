"""Issue 29 #4 (cardano hydra#1010, "additions are also breaking"): versions that mix (docs/compat.md).

Patch versions were declared compatible, but every schema forbade unknown fields: a patch release adding one
field to the plan made older peers refuse the new leader's plans (and a record with one more field was
dropped as malformed). Here records and plans made by a "newer patch" (an extra field, signed by their
owner) are stored over real DHT nodes on 127.0.0.1 and read by this version: accepted, their signature
verified over the exact bytes received (a change to the extra field fails it), while a record of another
MINOR or MAJOR is dropped with the reason and a plan of another schema version is refused.
"""

from __future__ import annotations

import json
import logging
import zlib

import pytest

import geomesh_p2p
from geomesh_p2p.config.models import RunConfig
from geomesh_p2p.dht import live_peers
from geomesh_p2p.dht.announce import peers_key
from geomesh_p2p.dht.chunked import parse_head, split, store_chunked
from geomesh_p2p.dht.records import RecordError, make_record, verify_record
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.plan.agree import PlanStore, plan_key
from geomesh_p2p.plan.wire import encode_body, plan_format
from geomesh_p2p.schema.compat import same_series, series
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.status.swarm import RoundSummaries
from tests.dht_helpers import RUN, start_swarm, stop_all
from tests.plan_util import big_plan

_MAJ, _MIN, _ = (int(x) for x in geomesh_p2p.__version__.split("."))
#: versions relative to this one: a newer patch of its series, the next minor, the next major
PATCH, MINOR, MAJOR = f"{_MAJ}.{_MIN}.99", f"{_MAJ}.{_MIN + 1}.0", f"{_MAJ + 1}.{_MIN}.0"
from tests.records_util import peer_record

pytestmark = pytest.mark.timeout(90)


def _newer_record_bytes(ident: Identity, version: str, **extra) -> bytes:
    """The JSON a peer of ``version`` writes: this version's fields plus ``extra`` ones it added."""
    d = json.loads(peer_record(ident, version=version, address="127.0.0.1:9").to_bytes())
    return json.dumps({**d, **extra}, sort_keys=True).encode()


def _newer_plan_body(plan) -> bytes:
    """The compact body a leader of a newer patch writes: one more plan field and one more assignment column."""
    d = json.loads(zlib.decompress(encode_body(plan)))
    d["exchange_hint"] = {"codec": "sign2", "note": "added in a patch"}
    n = len(d["assignments"]["peer_id"])
    d["assignments"]["gpu_temp_c"] = [61.5] * n
    return zlib.compress(json.dumps(d, separators=(",", ":")).encode(), 9)


def test_the_series_rule():
    assert same_series("0.1.0", "0.1.7") and same_series("1.4.2", "1.4.0")
    assert not same_series("0.1.0", "0.2.0") and not same_series("0.1.0", "1.1.0")
    assert series(geomesh_p2p.__version__) == tuple(geomesh_p2p.__version__.split(".")[:2])


def test_every_wire_model_ignores_a_field_of_a_newer_patch_and_local_configs_still_refuse_one():
    ident = Identity.generate()
    rec = PeerRecord.from_bytes(_newer_record_bytes(ident, PATCH, region="eu-west", sync_hint={"a": 1}))
    assert rec.peer_id == str(ident.peer_id) and rec.version == PATCH and not hasattr(rec, "region")
    summaries = RoundSummaries.model_validate_json(
        json.dumps({"peer_id": "p", "rounds": [], "uptime_s": 12.5}).encode()
    )
    assert summaries.peer_id == "p" and summaries.rounds == []
    with pytest.raises(ValueError, match="extra"):  # a typo in a config file must fail
        RunConfig.model_validate({"inner_lrr": 0.1})
    # a head of a newer patch with one more key parses
    wire = split(b"x" * 150_000, plan_format(60_000))
    head = json.loads(wire.head[len(plan_format().head_prefix) :])
    newer = plan_format().head_prefix + json.dumps({**head, "compression": "zlib"}).encode()
    assert parse_head(newer, plan_format()) == parse_head(wire.head, plan_format()) and len(wire.chunks) == 3


def test_a_run_config_field_a_patch_adds_keeps_the_hash_at_its_default():
    class NextPatch(RunConfig):  # what the next patch release's RunConfig would be
        patch_fields = RunConfig.patch_fields | frozenset({"warmup_hint"})
        warmup_hint: int = 0

    assert NextPatch().config_hash() == RunConfig().config_hash()  # peers of both patches train together
    assert NextPatch(warmup_hint=5).config_hash() != RunConfig().config_hash()  # set: the older cannot honour it


def test_the_signature_covers_the_extra_field_as_received():
    owner = Identity.generate()
    value = _newer_record_bytes(owner, PATCH, region="eu-west")
    now = swarm_time()
    rec = make_record(peers_key(RUN), value, now + 60, subkey=str(owner.peer_id), owner=owner, run_id=RUN)
    assert verify_record(rec, run_id=RUN, now=now).value == value
    rec.value = value.replace(b"eu-west", b"eu-east")  # a relay changes only the field this version ignores
    with pytest.raises(RecordError, match="signature"):
        verify_record(rec, run_id=RUN, now=now)


async def test_records_and_plans_of_a_newer_patch_are_accepted_over_the_dht_and_other_minors_are_not(caplog):
    nodes = await start_swarm(3)
    try:
        mine = peer_record(nodes[0].transport.identity, version=geomesh_p2p.__version__)
        newer, minor, major = Identity.generate(), Identity.generate(), Identity.generate()
        now = swarm_time()
        stored = {}
        for ident, version in ((newer, PATCH), (minor, MINOR), (major, MAJOR)):
            value = _newer_record_bytes(ident, version, region="eu-west")
            stored[str(ident.peer_id)] = value
            assert await nodes[1].store(peers_key(RUN), value, now + 60, subkey=str(ident.peer_id), owner=ident)

        with caplog.at_level(logging.INFO, logger="geomesh_p2p.dht.announce"):
            got = await live_peers(nodes[2], RUN, expected_version=geomesh_p2p.__version__, mine=mine)
        # the newer patch's record: accepted; the other MINOR and MAJOR: dropped, saying why
        assert [(r.peer_id, r.version) for r in got] == [(str(newer.peer_id), PATCH)]
        raw = await nodes[2].get(peers_key(RUN))
        assert raw[str(newer.peer_id)].value == stored[str(newer.peer_id)]  # byte for byte what was signed
        dropped = sorted(r.getMessage() for r in caplog.records if "incompatible" in r.getMessage())
        assert len(dropped) == 2, dropped
        assert any(f"version {geomesh_p2p.__version__} vs {MINOR}" in m for m in dropped) and any(
            f"version {geomesh_p2p.__version__} vs {MAJOR}" in m for m in dropped
        )

        # a leader of a newer patch publishes its plan with one more field and one more column, signed
        leader = newer
        plan = big_plan(40, run_id=RUN, round=6, leader=str(leader.peer_id))
        body = _newer_plan_body(plan)
        out = await store_chunked(
            nodes[0],
            plan_key(RUN, 6),
            split(body, plan_format(2_000)),  # several chunks, each signed by the leader
            subkey=str(leader.peer_id),
            owner=leader,
            expiration_time=swarm_time() + 120,
        )
        assert out.ok and out.chunks >= 2
        read = await PlanStore(nodes[2], Identity.generate(), RUN).read(6)
        assert read == [plan]  # this version follows it: every field it knows is the leader's

        # a plan of another schema version (a MINOR change) is still refused, with the reason
        d = json.loads(zlib.decompress(encode_body(plan)))
        d.update(schema_version=2, round=7)
        bumped = zlib.compress(json.dumps(d).encode(), 9)
        lid = str(leader.peer_id)
        assert (
            await store_chunked(
                nodes[0],
                plan_key(RUN, 7),
                split(bumped, plan_format()),
                subkey=lid,
                owner=leader,
                expiration_time=swarm_time() + 120,
            )
        ).ok
        with caplog.at_level(logging.WARNING, logger="geomesh_p2p.plan.agree"):
            assert await PlanStore(nodes[2], Identity.generate(), RUN).read(7) == []
        assert any("schema_version 2 is not the supported 1" in r.getMessage() for r in caplog.records)
    finally:
        await stop_all(nodes)
