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
    for r in range(3):
        d = {n: next((x["digest"] for x in swarm.rows(n) if x["round"] == r), None) for n in names}
        assert None not in d.values() and len(set(d.values())) == 1, f"round {r}: {d}"
    for n in names:
        assert all(x["peers"] == 2 for x in swarm.rows(n))
        with safe_open(str(tmp_path / f"ck{n[1]}" / RESIDUAL_FILE), framework="pt") as f:
            meta, res = f.metadata(), f.get_tensor("residual")
        assert meta["round"] == "3" and meta["digest"] == swarm.rows(n)[-1]["digest"], meta
        assert res.dtype == torch.float32 and res.abs().sum() > 0
