"""The node's checkpoints (:class:`Checkpointer`; ``--checkpoint-dir`` checked at start by
:func:`check_writable_dir`): a checkpoint of the state this peer holds every N rounds
and at shutdown (labelled with that state's round), never ending a training peer over a failed write.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from geomesh_p2p.exchange.codec.feedback import PushFeedback
from geomesh_p2p.model import state as gstate  # module-qualified: tests replace gstate.save_checkpoint
from geomesh_p2p.round.rules import RoundState
from geomesh_p2p.telemetry import events
from geomesh_p2p.util.errors import UserFacingError

if TYPE_CHECKING:
    from geomesh_p2p.config.models import NodeConfig, RunConfig

log = logging.getLogger("geomesh_p2p.node.peer")

__all__ = ["Checkpointer", "check_writable_dir"]


def check_writable_dir(path: str, flag: str) -> Path:
    """Create ``path`` if needed and check that a file can be written there (then removed).

    Raises:
        UserFacingError: one line naming ``flag`` and the reason (read-only, not a directory, no permission).
    """
    d = Path(path).expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".write-check-"):
            pass
    except OSError as e:
        raise UserFacingError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    return d


def _none() -> None:
    return None


class Checkpointer:
    """Checkpoints of one node.

    Args:
        run_cfg: the run config (saved in the checkpoint's meta).
        cfg: the node config (``checkpoint_dir``, ``checkpoint_keep``).
        state: the node's :class:`RoundState` (round counter, digest, PeerID, standing ledger).
        config_hash: the run config's hash (saved in the meta).
        theta: the global weights [P] fp32 CPU (None before the node took a state).
        outer: the outer optimizer (its ``buf`` is saved; None before the node built it).
        gstate: the global state buffer (the round and digest of the state held), None before it exists.
        feedback: the ``--error-feedback`` residual, saved next to the checkpoint (None: off).

    Attributes:
        skip: no final checkpoint (the node stopped before it held any state of the run).
    """

    def __init__(
        self,
        run_cfg: RunConfig,
        cfg: NodeConfig,
        state: RoundState,
        config_hash: str,
        *,
        theta: Callable[[], Optional[torch.Tensor]],
        outer: Callable[[], Any],
        gstate: Callable[[], Any] = _none,
        feedback: Callable[[], Optional[PushFeedback]] = _none,
    ):
        self.run_cfg = run_cfg
        self.cfg = cfg
        self.state = state
        self.config_hash = config_hash
        self._theta = theta
        self._outer = outer
        self._gstate = gstate
        self._feedback = feedback
        self.skip = False

    async def checkpoint_or_warn(self, final: bool = False) -> Optional[Path]:
        """Write a checkpoint in a worker thread; a failure (disk full, directory gone read-only, ...) is one
        WARNING line: the previous checkpoint stays valid (writes are atomic), training goes on and the next
        checkpoint retries. Awaited before the next round starts, so the state does not change while it is written.
        ``final``: the checkpoint at shutdown (a failure says this peer's last rounds are not on disk)."""
        try:
            return await asyncio.to_thread(self.checkpoint)
        except Exception as e:  # never end a training peer over its checkpoint
            fields: dict[str, Any] = dict(round=self.state.round, final=final, error=type(e).__name__, detail=str(e))
            if final:
                events.emit(
                    log,
                    logging.WARNING,
                    "checkpoint_failed",
                    "round %d: the final checkpoint failed (%s: %s); "
                    "the latest one already in %s stays valid (a --resume starts from it, not from round %d)",
                    self.state.round,
                    type(e).__name__,
                    e,
                    self.cfg.checkpoint_dir,
                    self.state.round,
                    **fields,
                )
            else:
                events.emit(
                    log,
                    logging.WARNING,
                    "checkpoint_failed",
                    "round %d: checkpoint failed (%s: %s); the previous one stays valid, retrying at the next",
                    self.state.round,
                    type(e).__name__,
                    e,
                    **fields,
                )
            return None

    def held_state(self) -> tuple[int, Optional[str]]:
        """(round, digest) of the global state this peer holds (``gstate``): ``self.state.round`` runs ahead of it
        while the peer syncs (planned out, catching up: it already names the round it is going to)."""
        gs = self._gstate()
        if gs is not None and gs.digest is not None:
            return int(gs.round), gs.digest
        return self.state.round, self.state.digest

    async def final_checkpoint(self) -> Optional[Path]:
        """The checkpoint at shutdown, of the state this peer holds and labelled with that state's round
        (:meth:`held_state`), whatever its round counter says: a peer stopped while planned out or
        catching up holds round r's weights with its counter at r + 1 (review F2: written as r + 1, a
        ``--resume`` would have started a fork). A state the swarm later moved past is still a true
        checkpoint of its round: a ``--resume`` catches up from it. None when nothing is written."""
        if self._outer() is None or not self.cfg.checkpoint_dir or self.skip:
            return None
        held, _ = self.held_state()
        if held != self.state.round:
            events.emit(
                log,
                logging.INFO,
                "checkpoint_of_held_round",
                "round %d: this peer was syncing; its final checkpoint is of round %d, the state it holds",
                self.state.round,
                held,
                round=self.state.round,
                held_round=held,
            )
        path = await self.checkpoint_or_warn(final=True)
        if path:
            log.info("checkpoint written: %s (round %d)", path, held)
        return path

    def checkpoint(self) -> Optional[Path]:
        """Write a checkpoint of the state held (worker thread); None when nothing is written. Raises what the
        write raises (OSError: disk full, directory gone)."""
        # No global state taken yet (no digest: _initial_state has not set one): nothing to save. A refused
        # --resume (another run config) wrote the empty state buffer as a round-0 checkpoint into that
        # run's --checkpoint-dir at shutdown before this check.
        theta, outer = self._theta(), self._outer()
        if not self.cfg.checkpoint_dir or theta is None or outer is None or self.state.digest is None:
            return None
        held, digest = self.held_state()  # the weights' own round, not the counter of a peer syncing
        if digest is None:
            return None
        path = gstate.save_checkpoint(
            self.cfg.checkpoint_dir,
            round=held,
            theta=theta,
            momentum=outer.buf,
            keep=self.cfg.checkpoint_keep,
            meta={
                "run_config_hash": self.config_hash,
                "peer_id": self.state.me,
                "run_config": self.run_cfg.model_dump(),
                "standing": self.state.standing.to_meta(),
            },
        )
        fb: Optional[PushFeedback] = self._feedback()
        if fb is not None:  # next to the checkpoint, tagged with its state
            fb.save(self.cfg.checkpoint_dir, state_round=held, digest=digest)
        return path
