"""Storage errors never end a peer (issue 14 #6): the checkpoint directory is checked at start, a failed
write is one warning, the previous checkpoint stays valid and the next write is retried."""

from __future__ import annotations

import asyncio
import errno
import logging
from types import SimpleNamespace

import pytest
import torch

from geomesh_p2p.telemetry import events
from geomesh_p2p.model import state
from geomesh_p2p.util.errors import UserFacingError
from geomesh_p2p.node.checkpoints import Checkpointer
from geomesh_p2p.node.peer import NodeConfig, PeerNode, RunConfig, check_writable_dir
from geomesh_p2p.round.rules import RoundState
from geomesh_p2p.model.optim import OuterNesterov
from geomesh_p2p.trust.standing import Standing

pytestmark = pytest.mark.timeout(60)


def test_an_unusable_checkpoint_dir_fails_at_start_naming_the_flag(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(UserFacingError, match=r"--checkpoint-dir .*a-file/ckpt: cannot write there"):
        check_writable_dir(str(f / "ckpt"), "--checkpoint-dir")
    assert check_writable_dir(str(tmp_path / "new" / "ckpt"), "--checkpoint-dir").is_dir()
    assert list((tmp_path / "new" / "ckpt").iterdir()) == []  # the probe file is gone


def _node(ckpt_dir) -> Checkpointer:
    """The checkpoints of a node at round 3 that took the run's state (one without a digest writes no
    checkpoint); its weights, outer optimizer and state buffer are ``node.held``'s (the tests replace them)."""
    held = SimpleNamespace(
        theta=torch.arange(8, dtype=torch.float32), outer=OuterNesterov(lr=0.7, momentum=0.9), gstate=None
    )
    state = RoundState(me="me", round=3, digest="d" * 64, standing=Standing())
    node = Checkpointer(
        RunConfig(),
        NodeConfig(checkpoint_dir=str(ckpt_dir)),
        state,
        "h",
        theta=lambda: held.theta,
        outer=lambda: held.outer,
        gstate=lambda: held.gstate,
    )
    node.held = held  # type: ignore[attr-defined]
    return node


def test_a_full_disk_is_a_warning_and_the_previous_checkpoint_stays(tmp_path, monkeypatch, caplog):
    node = _node(tmp_path)
    first = asyncio.run(node.checkpoint_or_warn())
    assert first is not None and state.list_checkpoints(tmp_path)[-1][0] == 3

    real = state.save_checkpoint

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state, "save_checkpoint", full)
    node.state.round = 4
    with events.capture("checkpoint_failed") as failed:
        assert asyncio.run(node.checkpoint_or_warn()) is None
    [ev] = failed
    assert (ev["round"], ev["final"], ev["error"], ev["level"]) == (4, False, "OSError", "WARNING")
    assert "No space left" in ev["detail"]
    assert [r for r, _ in state.list_checkpoints(tmp_path)] == [3]  # the previous one is intact
    caplog.clear()
    with caplog.at_level(logging.WARNING), events.capture("checkpoint_failed") as failed:
        assert asyncio.run(node.checkpoint_or_warn(final=True)) is None
    [ev] = failed
    assert (ev["round"], ev["final"], ev["error"]) == (4, True, "OSError")
    # the human line of the final one promises no retry (there is no next checkpoint): users read this wording
    assert "retrying" not in caplog.text and "not from round 4" in caplog.text
    monkeypatch.setattr(state, "save_checkpoint", real)
    node.state.round = 5
    assert asyncio.run(node.checkpoint_or_warn()) is not None  # retried at the next one
    assert [r for r, _ in state.list_checkpoints(tmp_path)] == [3, 5]


def test_parts_that_aggregated_no_token_do_not_move():
    """Issue 14 #8: with momentum, a zero update still moved the weights (eval ppl 515 -> 618 over 8 rounds
    of 0 tokens). Idle ranges keep weights and outer momentum; a round with no token at all changes nothing."""
    from types import SimpleNamespace

    from geomesh_p2p.net.identity import Identity

    theta = torch.linspace(-1, 1, 12)
    plan = SimpleNamespace(owners=lambda: [("a", 0, 6), ("b", 6, 12)])
    node = PeerNode(RunConfig(), NodeConfig(), identity=Identity.generate())
    node.outer, node.theta = OuterNesterov(lr=0.7, momentum=0.9), theta.clone()
    node.outer.buf = torch.full((12,), 0.5)  # momentum from earlier rounds
    with events.capture("idle_parts_unchanged") as idle:
        node.outer_rule.apply(3, plan, torch.full((12,), 0.01), idle=[(6, 12)])
    assert torch.equal(node.theta[6:], theta[6:]) and torch.equal(node.outer.buf[6:], torch.full((6,), 0.5))
    assert not torch.equal(node.theta[:6], theta[:6])  # the part with tokens stepped
    assert [(e["peer"], e["round"], e["idle"], e["idle_elements"], e["elements"]) for e in idle] == [
        (node.me, 3, [[6, 12]], 6, 12)
    ]
    before, buf = node.theta.clone(), node.outer.buf.clone()
    node.outer_rule.apply(4, plan, torch.zeros(12), idle=[(0, 6), (6, 12)])
    assert torch.equal(node.theta, before) and torch.equal(node.outer.buf, buf)


def test_a_peer_stopped_while_syncing_checkpoints_the_round_it_holds(tmp_path):
    """Review F2: a planned-out or catching-up peer's counter already names round r + 1 while it holds
    round r's weights; its final checkpoint is of round r (labelled so), never stale weights as r + 1."""
    from types import SimpleNamespace

    node = _node(tmp_path)
    node.held.gstate = SimpleNamespace(round=3, digest="d" * 64)  # the state held: round 3
    node.state.round = 4  # syncing: wait_out moved the counter on
    with events.capture("checkpoint_of_held_round") as said:
        path = asyncio.run(node.final_checkpoint())
    assert path is not None and [r for r, _ in state.list_checkpoints(tmp_path)] == [3]
    [ev] = said
    assert (ev["round"], ev["held_round"], ev["level"]) == (4, 3, "INFO")
    rnd, theta, _, _ = state.load_latest_checkpoint(tmp_path)
    assert rnd == 3 and torch.equal(theta, node.held.theta)


def test_the_final_checkpoint_of_a_synced_peer_is_written(tmp_path):
    """A peer whose counter and state agree (synced, or left alone on its confirmed state: review F5)
    writes its final checkpoint without a word; without --checkpoint-dir nothing is written."""
    node = _node(tmp_path)
    with events.capture("checkpoint_of_held_round") as said:
        path = asyncio.run(node.final_checkpoint())
    assert said == [] and path is not None
    assert [r for r, _ in state.list_checkpoints(tmp_path)] == [3]
    node.cfg = NodeConfig()
    assert asyncio.run(node.final_checkpoint()) is None
