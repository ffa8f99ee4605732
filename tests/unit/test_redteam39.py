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

from geomesh_p2p.trust.standing import Standing
from tests.rules_util import make_rules

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
