"""Storage errors never end a peer (issue 14 #6): the checkpoint directory is checked at start, a failed
write is one warning, the previous checkpoint stays valid and the next write is retried."""

from __future__ import annotations

import asyncio
import errno
import logging

import pytest
import torch

from geomesh_p2p import state
from geomesh_p2p.errors import UserFacingError
from geomesh_p2p.node import NodeConfig, PeerNode, RunConfig, check_writable_dir
from geomesh_p2p.optim import OuterNesterov
from geomesh_p2p.standing import Standing

pytestmark = pytest.mark.timeout(60)


def test_an_unusable_checkpoint_dir_fails_at_start_naming_the_flag(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(UserFacingError, match=r"--checkpoint-dir .*a-file/ckpt: cannot write there"):
        check_writable_dir(str(f / "ckpt"), "--checkpoint-dir")
    assert check_writable_dir(str(tmp_path / "new" / "ckpt"), "--checkpoint-dir").is_dir()
    assert list((tmp_path / "new" / "ckpt").iterdir()) == []  # the probe file is gone


def _node(ckpt_dir) -> PeerNode:
    node = PeerNode.__new__(PeerNode)
    node.run_cfg, node.cfg = RunConfig(), NodeConfig(checkpoint_dir=str(ckpt_dir))
    node.round, node.me, node.config_hash = 3, "me", "h"
    node.theta = torch.arange(8, dtype=torch.float32)
    node.outer = OuterNesterov(lr=0.7, momentum=0.9)
    node.standing = Standing()
    return node


def test_a_full_disk_is_a_warning_and_the_previous_checkpoint_stays(tmp_path, monkeypatch, caplog):
    node = _node(tmp_path)
    first = asyncio.run(node._checkpoint_or_warn())
    assert first is not None and state.list_checkpoints(tmp_path)[-1][0] == 3

    real = state.save_checkpoint

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state, "save_checkpoint", full)
    node.round = 4
    with caplog.at_level(logging.WARNING):
        assert asyncio.run(node._checkpoint_or_warn()) is None
    assert "round 4: checkpoint failed (OSError" in caplog.text and "No space left" in caplog.text
    assert [r for r, _ in state.list_checkpoints(tmp_path)] == [3]  # the previous one is intact
    monkeypatch.setattr(state, "save_checkpoint", real)
    node.round = 5
    assert asyncio.run(node._checkpoint_or_warn()) is not None  # retried at the next one
    assert [r for r, _ in state.list_checkpoints(tmp_path)] == [3, 5]
