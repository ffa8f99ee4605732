"""Liveness is progress, not a heartbeat (issue 29 #5).

A peer whose checkpoint write hung (a stalled NFS mount) kept its record fresh: the announcer is a task of
its own, so the others kept planning it, it failed its parts round after round, and the status page listed
it as live. :class:`ProgressWatchdog` answers the announcer's question "may I refresh the record?"
(:attr:`~geomesh_p2p.dht.announce.PeerAnnouncer.live`) from the round loop's progress instead: once the
loop has not advanced (a phase entered, a backoff pause, a state download's bytes) for :meth:`bound_s`,
the announcer stops refreshing with one WARNING saying why, and the record expires within its lifetime.

The bound follows the run's timing: a plan's deadlines lie at most :func:`plan_horizon_s` of the window
ahead (followers refuse farther ones), and the longest wait without progress outside a plan is a
checkpoint write (:meth:`~geomesh_p2p.node.checkpoints.Checkpointer.timeout_s`); :data:`STALL_SLACK_S` more
covers the evaluation, the digest check and the announcement of a round's end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from geomesh_p2p.round.context import Phase
from geomesh_p2p.round.rules.planning import plan_horizon_s

if TYPE_CHECKING:
    from geomesh_p2p.node.peer import PeerNode
    from geomesh_p2p.round.driver import RoundDriver

__all__ = ["ProgressWatchdog", "STALL_MIN_S", "STALL_SLACK_S", "stall_bound_s"]

#: The loop may go this long without progress at least (seconds) ...
STALL_MIN_S = 60.0
#: ... plus this much over the longest wait it has (the evaluation, the digest check, the end's announcement).
STALL_SLACK_S = 60.0


def stall_bound_s(window_s: Optional[float], checkpoint_timeout_s: float) -> float:
    """Seconds the round loop may go without progress before the peer stops announcing: ``max(STALL_MIN_S,
    plan_horizon_s(window_s), checkpoint_timeout_s) + STALL_SLACK_S`` (204 s at a 6 s window; 420 s at
    ``--window-s auto``, the default, whose windows are at most 0.9 x its 360 s horizon)."""
    return max(STALL_MIN_S, plan_horizon_s(window_s), checkpoint_timeout_s) + STALL_SLACK_S


class ProgressWatchdog:
    """Whether the round loop of a peer advances (:meth:`problem`, the announcer's ``live`` check).

    Args:
        driver: ``() -> RoundDriver or None`` (None before the rounds start: start-up, the initial state and
            evaluation are not watched here).
        bound_s: ``() -> seconds`` the loop may go without progress (:func:`stall_bound_s`).
        sync_progress: ``() -> anything``: the state download's progress; a change counts as progress (a
            download of a large state over a slow link runs for minutes inside one phase).
    """

    def __init__(
        self,
        driver: Callable[[], Optional[RoundDriver]],
        bound_s: Callable[[], float],
        sync_progress: Callable[[], Any] = lambda: None,
    ):
        self._driver, self._bound_s, self._sync_progress = driver, bound_s, sync_progress
        self._sync_seen: Any = None

    @classmethod
    def for_node(cls, node: PeerNode) -> ProgressWatchdog:
        """The watchdog of ``node``'s round driver, state download and checkpoints."""
        return cls(
            lambda: node._round_driver,
            lambda: stall_bound_s(node.run_cfg.window_s, node.checkpoints.timeout_s()),
            node.resync.progress,
        )

    def problem(self) -> Optional[str]:
        """None while the round loop advances; else one sentence: how long it has not, where it is, the bound."""
        d = self._driver()
        if d is None or d.phase in (Phase.IDLE, Phase.DONE):
            return None
        sync = self._sync_progress()
        if sync is not None and sync != self._sync_seen:
            d.progressed_at = d.clock.monotonic()  # bytes of the state arrived: the download advances
        self._sync_seen = sync
        stalled, bound = d.stalled_s(), self._bound_s()
        if stalled <= bound:
            return None
        return (
            f"its round loop has not advanced for {stalled:.0f} s (round {d.state.round}, phase "
            f"{d.phase.value}; the bound is {bound:.0f} s from the run's window and checkpoint timeout)"
        )
