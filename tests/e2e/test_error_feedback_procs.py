"""The process-level tests of ``tests/unit/test_error_feedback.py`` (they start OS processes)."""

from __future__ import annotations

import pytest
import torch
from geomesh_p2p.exchange.codec.feedback import RESIDUAL_FILE


# ------------------------------------------------------------------ two peer processes
@pytest.mark.timeout(420)
def test_two_peers_with_error_feedback_keep_equal_digests_and_checkpoint_the_residual(swarm, tmp_path):
    """geomesh-peer join --error-feedback: 2 peers train 3 rounds with equal digests every round; each
    checkpoints a non-zero residual tagged with the state of its last checkpoint."""
    from safetensors import safe_open

    names = ["p0", "p1"]
    common = ["--rounds", "3", "--min-peers", "2", "--error-feedback", "--checkpoint-every", "1"]
    swarm.start_peers(names, *common, each=lambda i, n: ["--checkpoint-dir", str(tmp_path / f"ck{i}")])
    assert swarm.wait_exit(names, 360) == {"p0": 0, "p1": 0}
    # both peers in every round's plan, or one planned out of a round by the no-part penalty of a push the load made
    # late (it re-syncs; the rows then count a plan of 1): rows count their plan, a forked or skipped round fails
    assert swarm.plan_problems(names, range(3)) == [], {n: swarm.rows(n) for n in names}
    assert any(x["peers"] == 2 for x in swarm.rows("p0")), swarm.rows("p0")  # the two trained together
    for r in range(3):
        d = {n: x["digest"] for n in names for x in swarm.rows(n) if x["round"] == r}
        assert len(set(d.values())) == 1, f"round {r}: {d}"
    for n in names:
        with safe_open(str(tmp_path / f"ck{n[1]}" / RESIDUAL_FILE), framework="pt") as f:
            meta, res = f.metadata(), f.get_tensor("residual")
        assert meta["round"] == "3" and meta["digest"] == swarm.rows(n)[-1]["digest"], meta
        assert res.dtype == torch.float32 and res.abs().sum() > 0
