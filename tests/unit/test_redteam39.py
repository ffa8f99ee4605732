"""Red team (session 39) of the checkpoint's unseen rates (``Reprofiler.restore_delivered``) and of the light
ranking (``light.is_light`` over ``RoundPolicy.may_lead_ids``).

* An edited checkpoint whose delivered or unseen map held a JSON integer past a float's range (``1`` and 400 zeros)
  ended ``--resume`` in an ``OverflowError`` traceback (``math.isfinite`` of the int), and so did a standing round of
  ``Infinity`` (``int(inf)`` in ``Standing.from_meta``): both maps are now ignored as any other malformed one.
* A peer whose ledger missed rounds of its window and credited fewer than the standing threshold (restarted without
  its checkpoint, or resumed after a long gap) found nobody established in its own ledger; ``split``'s bootstrap then
  took every participant for established, a probation newcomer ranked first held the only full-view slot in its
  view, and it ran light, while every other participant (whose full ledgers leave the newcomer out) ranked it first
  and ran light too: nobody published for a whole plan attempt. Such a peer now takes the full path.
"""

from __future__ import annotations

import json

import pytest
import torch

from geomesh_p2p.model import state as gstate
from geomesh_p2p.plan.agree import leader_order
from geomesh_p2p.round import light
from geomesh_p2p.trust.standing import Standing
from tests.records_util import peer_record
from tests.rules_util import light_driver, make_rules

pytestmark = pytest.mark.timeout(60)

BIG = "1" + "0" * 400  # a JSON integer no float holds


@pytest.mark.parametrize("key", ["tps", "unseen"])
def test_an_integer_rate_past_a_float_is_ignored_not_a_traceback(key):
    """The text of an edited checkpoint, read as ``load_latest_checkpoint`` reads it (``json.loads``)."""
    text = '{"round": 4, "tps": {"aaaaaaaaaa": 10.0}, "unseen": {"bbbbbbbbbb": 2.0}}'
    meta = json.loads(text.replace("10.0" if key == "tps" else "2.0", BIG))
    rules = make_rules(me="m" * 10, round=5)
    got = rules.profile.restore_delivered(meta, 5)
    if key == "tps":  # the whole evidence goes, as for any malformed delivered map
        assert got is False and rules.profile.supported_tps is None
    else:  # the unseen map alone goes; the delivered rates stay
        assert got is True
        assert rules.profile.supported_tps == (4, {"aaaaaaaaaa": 10.0})
        assert rules.profile.unseen_tps is None


def test_a_standing_round_of_infinity_gives_an_empty_ledger_not_a_traceback():
    meta = json.loads('{"window": 32, "rounds": [[Infinity, ["abc"]], [3, ["abc"]]]}')
    s = Standing.from_meta(meta)
    assert s.credited_rounds() == [] and s.weight("abc") == 0


@pytest.mark.parametrize(
    "field, value, said", [("meta", [1, 2], "its meta is not a JSON object"), ("round", 2.5, "round")]
)
def test_an_edited_json_field_names_the_json_file(tmp_path, field, value, said):
    """An edited record's ``meta`` or ``round`` is refused in one line naming the JSON file that holds it (it named
    the weights file)."""
    path = gstate.save_checkpoint(tmp_path, round=3, theta=torch.zeros(4), momentum=torch.zeros(4), meta={})
    rec = json.loads(path.read_text())
    rec[field] = value
    path.write_text(json.dumps(rec))
    with pytest.raises(gstate.CheckpointError) as e:
        gstate.load_latest_checkpoint(tmp_path)
    assert str(e.value).startswith(f"corrupt checkpoint metadata {path}: ") and said in str(e.value)


# --- the light ranking of a peer whose ledger is too short ---------------------------------------------------------

R = 20  # the round asked about: threshold 3, a window of 32 (every round 0..R-1 in it)
IDS = [f"peer{i:02d}" for i in range(5)]
LEADER, NEWCOMER = IDS[0], IDS[4]  # round R - 1's leader; a newcomer on probation in round R - 1's plan
TOOK = IDS[1:]


def _run_id() -> str:
    """A run id whose round-R leader order puts the newcomer first among the participants that may take over."""
    return next(f"run{k}" for k in range(1000) if leader_order(f"run{k}", R, TOOK)[0] == NEWCOMER)


RUN = _run_id()
FIRST = leader_order(RUN, R, [p for p in TOOK if p != NEWCOMER])[0]  # the full path's first candidate everywhere


def _ledgers() -> tuple[Standing, Standing]:
    """(the ledger of a peer that ran all along: everyone credited rounds 0..R-1, the newcomer R-2 and R-1 only,
    the ledger of a peer that restarted without its checkpoint two rounds ago: R-2 and R-1, everyone)."""
    full, short = Standing(), Standing()
    for r in range(R):
        full.credit(r, [p for p in IDS if p != NEWCOMER or r >= R - 2])
    for r in (R - 2, R - 1):
        short.credit(r, IDS)
    return full, short


def _drv(me: str, standing: Standing):
    """A driver stand-in at round R (tests/unit/test_light_bars.py's): it applied and confirmed round R - 1."""
    rules = make_rules(me=me, round=R, standing=standing)
    drv = light_driver(rules, me=me, ids=IDS, leader=LEADER, run_id=RUN)
    return drv, rules


def test_the_full_paths_first_candidate_with_a_short_ledger_is_no_light_follower():
    full, short = _ledgers()
    ledger = {p: short if p in (FIRST, NEWCOMER) else full for p in TOOK}
    # the full path (records read, their attestations fill the rounds a short ledger missed): every peer's first
    # candidate is FIRST, the newcomer is nobody's
    recs = {p: peer_record(p, round=R, standing=ledger.get(p, full).attestations(exclude=p, own=True)) for p in IDS}
    for me in TOOK:
        _, rules = _drv(me, ledger[me])
        _, cands = rules.leader_candidates([recs[p] for p in TOOK], recs)
        assert NEWCOMER not in cands and leader_order(RUN, R, cands)[0] == FIRST, me
    lights = {me: light.is_light(_drv(me, ledger[me])[0]) for me in TOOK}
    # before: FIRST ranked among every participant (its ledger establishes nobody: split's bootstrap), the newcomer
    # first; it ran light, and so did every peer with a full ledger (FIRST holds their only full-view slot)
    assert lights[FIRST] is False
    assert all(lights[p] for p in TOOK if p not in (FIRST, NEWCOMER))
    # and the newcomer, whose ledger is as short, takes the full path too (its full path defers to FIRST)
    assert lights[NEWCOMER] is False


def test_a_ledger_that_credited_the_threshold_ranks_as_before():
    """Three credited rounds (the threshold): the ledger alone establishes the peers that delivered in them, as the
    others' ledgers do, and the ranking is the session-39 one."""
    full, short = _ledgers()
    short.credit(R - 3, [p for p in IDS if p != NEWCOMER])
    drv, _ = _drv(FIRST, short)
    assert light.lead_order(drv, drv._last_plan, R) == leader_order(RUN, R, [p for p in TOOK if p != NEWCOMER])
    assert light.is_light(drv) is False
    other = next(p for p in TOOK if p not in (FIRST, NEWCOMER))
    assert light.is_light(_drv(other, short)[0]) is True
