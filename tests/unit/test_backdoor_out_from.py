"""``benchmarks/backdoor.py``'s "poisoner out from round" (session 29): a round whose plan names the poisoner counts as
one it is in, also when that plan leaves an honest peer out (the rows' peer count is then no more than the honest
peers'). The rows are those of pair b of session 29 (``/tmp/s29/bd/b``: the excluded poisoner led round 13 and
left h0 out) and of a run whose h0 was planned out for speed from round 1."""

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


def _backdoor():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "backdoor.py"
    spec = importlib.util.spec_from_file_location("backdoor_benchmark", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(peers_by_round: dict[int, int]) -> list[dict]:
    return [{"round": r, "peers": n} for r, n in sorted(peers_by_round.items())]


def test_a_round_the_poisoner_leads_with_an_honest_peer_left_out_counts_as_in():
    out_from = _backdoor().out_from
    # pair b (session 29), peers per round as the honest rows wrote them; h0 sat out round 13 (no row)
    h0 = _rows({**{r: 4 for r in range(8)}, 8: 3, 9: 4, 10: 3, 11: 3, 12: 3, 14: 3})
    h12 = _rows({**{r: 4 for r in range(8)}, 8: 3, 9: 4, 10: 3, 11: 3, 12: 3, 13: 3, 14: 3})
    honest = {"h0": h0, "h1": h12, "h2": h12}
    a0 = _rows({**{r: 4 for r in range(8)}, 9: 4, 13: 3})  # the rounds whose plans named the poisoner
    assert out_from(honest, 3) == 10  # the count alone: round 13's 3 peers hid the poisoner
    assert out_from(honest, 3, {"a0": a0}) == 14
    # never out: it led the last round (pair e: out of rounds 6-13, in 14)
    assert out_from(honest, 3, {"a0": _rows({0: 4, 14: 4})}) is None


def test_an_honest_peer_planned_out_does_not_make_the_poisoner_out():
    out_from = _backdoor().out_from
    # h0 planned out (speed) from round 1: 3 peers a round, the poisoner among them in rounds 1-4, 6 and 14
    honest = {"h1": _rows({0: 4, **{r: 3 for r in range(1, 5)}, **{r: 2 for r in range(5, 14)}, 14: 3})}
    a0 = _rows({0: 4, 1: 3, 2: 3, 3: 3, 4: 3, 6: 3, 14: 3})
    assert out_from(honest, 3) == 1
    assert out_from(honest, 3, {"a0": a0}) is None
    assert out_from(honest, 3, {"a0": a0[:-1]}) == 7  # had it not led round 14


def test_clean_only_runs_the_honest_swarm_alone(tmp_path, capsys):
    """Session 31 (issue 28's 100 honest rounds): ``--clean-only`` runs one clean swarm per config, no poisoned one,
    and records it; it excludes ``--no-clean``."""
    mod = _backdoor()
    ran = []

    def fake_run(workdir, label, attack, n_honest, n_att, a):
        ran.append((label, attack, n_honest, n_att, a.rounds))
        return {"label": label, "attack": attack, "error": "not run (test)"}

    mod.run = fake_run
    assert mod.main(["--clean-only", "--configs", "0of4,1of7", "--rounds", "100", "--workdir", str(tmp_path)]) == 0
    assert ran == [("clean-4", None, 4, 0, 100), ("clean-7", None, 7, 0, 100)]
    assert [json.loads(x)["label"] for x in (tmp_path / "results.jsonl").read_text().splitlines()] == [
        "clean-4",
        "clean-7",
    ]
    with pytest.raises(SystemExit):
        mod.main(["--clean-only", "--no-clean"])
    assert "exclude each other" in capsys.readouterr().err
