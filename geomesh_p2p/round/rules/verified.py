"""Verified work in the round rules (:class:`VerifiedWork`, :mod:`geomesh_p2p.trust.verify`): each round's
start weights and signed contributions are kept, a drawn contributor is re-checked in the verifier's
background worker (never skipped for time: issue 28), and peers the evidence excludes are neither planned nor
followed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import types
from typing import Any, Callable, Iterable, Optional

import torch

from geomesh_p2p.model.memory import release_freed_memory
from geomesh_p2p.plan.schema import max_accused
from geomesh_p2p.round.rules import verified_accountable
from geomesh_p2p.round.rules.state import RoundState
from geomesh_p2p.trust import agreement, verify

log = logging.getLogger("geomesh_p2p.node.peer.round")

__all__ = ["VerifiedWork"]

#: The longest the round's advisory agreement measurement waits for the round's row (:meth:`VerifiedWork.round_done`)
#: before it runs anyway (a round that ends without a row: a failure, a re-sync).
AGREEMENT_WAIT_S = 60.0

#: The longest a stopping peer waits for the last round's tending task before its closing line
#: (:meth:`VerifiedWork.settle`): the agreement measurement takes well under a second at ``gpt2-124m`` (session 44)
SETTLE_S = 5.0


def _version_key(theta: torch.Tensor) -> tuple[int, int]:
    """``theta``'s storage and in-place version: equal while nothing wrote it (every write of the global state is an
    in-place torch op: the outer step, a load, a re-sync's copy)."""
    return theta.data_ptr(), theta._version


def _say_early_failed(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:  # before_outer_step writes them again
        log.debug("verified work: the start weights written early failed: %r", task.exception())


def _claimed_steps(contributions, plan) -> dict[str, int]:
    """The inner steps each contributor's token claim implies at its planned batch (``tokens // (batch x
    seq_len)``, from any of its sign packets); contributors the plan does not name are left out."""
    out: dict[str, int] = {}
    if plan is None:
        return out
    for p, parts in contributions.items():
        try:
            asg = plan.assignment(p)
        except KeyError:  # not in the plan: nothing to say
            continue
        per_step = max(1, int(asg.batch_size) * int(plan.seq_len))
        toks = [int(getattr(pk, "tokens", 0)) for pk in parts.values()]
        if toks:
            out[p] = max(toks) // per_step
    return out


class VerifiedWork:
    """This peer's verified work.

    Args:
        state: this peer's :class:`RoundState` (``me``).
        make_verifier: builds the :class:`~geomesh_p2p.trust.verify.WorkVerifier` (a whole-model copy) on first
            use; None: verified work is off until ``verifier`` is set.
        theta: the global weights [P] fp32 CPU (read when a round's start weights are kept).
        collective: the node's collective (the signed contributions it received).
        verifier: a verifier to use from the start (tests).
    """

    def __init__(
        self,
        state: RoundState,
        make_verifier: Optional[Callable[[], verify.WorkVerifier]] = None,
        *,
        theta: Optional[Callable[[], torch.Tensor]] = None,
        collective: Optional[Callable[[], Any]] = None,
        verifier: Optional[verify.WorkVerifier] = None,
    ):
        self.state = state
        self._make_verifier = make_verifier
        self._theta = theta
        self._collective = collective
        self.verifier = verifier
        self.task: Optional[asyncio.Future] = None
        #: the micro-batch of the last round this peer trained: its re-checks' batch while it is planned out
        self._micro_batch: Optional[int] = None
        #: (round, its relative agreement test) of the newest round measured (advisory, issue 28)
        self.agreement: Optional[tuple[int, agreement.AgreementTest]] = None
        #: (round, each contributor's support, the inner steps its claim implies) of that round (the record)
        self.support: Optional[tuple[int, dict[str, float], dict[str, int]]] = None
        # the verdicts while no verifier is built (a --resume's, in force from the first plan); handed over
        self._book = verify.Verdicts(state.me or "")
        #: accountable mode: contributions to check fetched so far (wanted, fetched, refused, bytes received)
        self.fetch_counts: dict[str, int] = {}
        self._fetches: set[asyncio.Future] = set()  # accountable mode's fetch tasks in flight (kept referenced)
        #: (round, θ's version key when it was read, the write task) of the start weights written early (:meth:`after_commit`)
        self._early: Optional[tuple[int, tuple[int, int], asyncio.Future]] = None
        self._done_round = -1  # the newest round whose row is out (round_done)
        #: called in the early write's thread before it writes (:meth:`after_commit`): the node waits there for the
        #: outer update's spill, which the next steps wait for, so the two writes do not share the core in that
        #: gap (issue 27, session 45)
        self.before_early_write: Callable[[], object] = lambda: None
        self._round_done_ev: Optional[asyncio.Event] = None
        self._ending: Optional[asyncio.Future] = None  # the task applying ended jobs (_apply_ended)
        self._ending_again = False  # a job ended while it ran: it goes round once more
        self._cancelled = False  # cancel() ran (shutdown): an ended job's hook starts nothing more (red team 47)

    def verdicts(self) -> verify.Verdicts:
        """The verdicts in force: the verifier's, or those held until it is built."""
        return self.verifier if self.verifier is not None else self._book

    def to_meta(self) -> dict:
        """This peer's verified-work verdicts for the checkpoint (:meth:`~geomesh_p2p.trust.verify.Verdicts.to_meta`)."""
        return self.verdicts().to_meta()

    def restore(self, meta) -> None:
        """Take the verdicts of :meth:`to_meta` (``--resume``); in force at once."""
        self.verdicts().restore(meta)

    def _global_theta(self) -> torch.Tensor:
        if self._theta is None:
            raise RuntimeError("verified work has no global weights to keep (built without them)")
        return self._theta()

    def _new_verifier(self) -> verify.WorkVerifier:
        if self._make_verifier is None:
            raise RuntimeError("verified work cannot build a verifier (built without a factory)")
        wv = self._make_verifier()
        wv.restore(self._book.to_meta())  # what was held (restored) before it existed
        return wv

    async def before_outer_step(self, r, plan, assignment, ar) -> None:
        """Verified work keeps round ``r``'s start weights (the global weights, before the outer step moves
        them): written to the verifier's file in a worker thread, with no copy on the heap
        (:meth:`~geomesh_p2p.trust.verify.WorkVerifier.keep_round`; already there when :meth:`after_commit` wrote
        them early and they did not change since), and queues this peer's check of the round
        in the verifier's background worker; then tends the checks (:meth:`verify_round`). Nothing in
        reencode mode (no contributions); in accountable mode from the results' commitments
        (:mod:`.verified_accountable`). Never raises."""
        if getattr(plan, "mode", None) == "accountable":
            await self._accountable(r, plan, assignment, ar)
            return
        written = await self._take_early(r)
        if not getattr(ar, "contributions", None):
            if written:
                self._drop_unkept(r)
            return  # reencode mode (or nothing received): no contributions to check
        try:
            await asyncio.to_thread(self._keep, r, plan, ar, written)
        except Exception as e:  # a full disk, say: this round goes unchecked, the round itself goes on
            log.warning("round %d: verified work skipped: its start weights could not be kept: %s", r, e)
            if written:
                self._drop_unkept(r)
            return
        try:
            await asyncio.to_thread(self._queue_check, r, plan, assignment)
        except Exception as e:  # the round goes on; the evidence of the others is still read and re-checked
            log.warning("round %d: verified work: this round's check could not be queued: %s", r, e)
        self.verify_round(r, plan, assignment, ar)

    async def _accountable(self, r, plan, assignment, ar) -> None:
        """Accountable mode: keep round ``r`` with its committed inputs now, then fetch, check and queue what this
        peer's check and screens need in a task of its own (:mod:`.verified_accountable`). Never raises."""
        try:
            if not await verified_accountable.keep(self, r, plan, ar):
                return
        except Exception as e:  # a full disk, say: this round goes unchecked, the round itself goes on
            log.warning("round %d: verified work skipped: the round could not be kept: %s", r, e)
            return
        # not the round's result itself: its aggregate ([P] fp32) must not live as long as the fetches (issue 27)
        light = types.SimpleNamespace(contributions={}, aggregate=None, part_ranges=list(ar.part_ranges))
        task = asyncio.ensure_future(verified_accountable.fetch_and_queue(self, r, plan, assignment, light))
        self._fetches.add(task)

        def done(t: asyncio.Future) -> None:
            self._fetches.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("round %d: verified work: fetching contributions failed: %s", r, t.exception())

        task.add_done_callback(done)

    def _keep(self, r: int, plan, ar, written: bool = False) -> None:
        """Blocking: build the verifier on first use (its private copy of the model, a whole-model deepcopy)
        and keep round ``r`` (its start weights written to a file, unless ``written`` already: :meth:`after_commit`)."""
        if self.verifier is None:
            self.verifier = self._new_verifier()
        theta = None if written else self._global_theta()
        self.verifier.keep_round(r, theta=theta, plan=plan, part_ranges=ar.part_ranges, packets=ar.contributions)

    def after_commit(self, r: int, plan) -> None:
        """Round ``r``'s start weights (the state just committed) stay as they are until round ``r``'s outer step:
        write them to the verifier's file now, in a worker thread, while this peer announces, checks the digest,
        plans and trains. Written by :meth:`before_outer_step`, between the exchange and the outer step, those
        ``4P`` bytes took 0.5-1.6 s of every ``gpt2-124m`` round (issue 27, session 38). :meth:`before_outer_step`
        of round ``r`` takes the file when the weights did not change since (their in-place version: a re-sync
        loads others), else writes them again; a file no round took is deleted. Nothing before the verifier
        exists (built when the first round is kept), in accountable mode (it keeps its rounds itself), for a round
        kept already, or without a running event loop. ``plan``: the plan of the round just stepped."""
        wv = self.verifier
        if wv is None or self._theta is None or getattr(plan, "mode", None) == "accountable":
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._drop_early()
        if wv.is_kept(r):  # never rewritten under a check that may read it
            return
        theta = self._global_theta()
        key = _version_key(theta)
        wait = self.before_early_write

        def write() -> int:
            wait()
            return wv.kept_weights.put(r, theta)

        task = asyncio.ensure_future(asyncio.to_thread(write))
        task.add_done_callback(_say_early_failed)
        self._early = (r, key, task)

    async def _take_early(self, r: int) -> bool:
        """Whether round ``r``'s start weights were written early (:meth:`after_commit`) and still are the global
        weights (waits for that write; a cancelled wait leaves it running). An early write of another round is
        deleted unless that round is kept."""
        early = self._early
        if early is None:
            return False
        er, key, task = early
        await asyncio.wait({task})
        self._early = None
        ok = not task.cancelled() and task.exception() is None
        if er != r:
            self._drop_early_file(er, task)
            return False
        return ok and key == _version_key(self._global_theta())

    def _drop_early(self) -> None:
        """Forget the early write nobody took (its file deleted once written, unless its round is kept)."""
        early, self._early = self._early, None
        if early is not None:
            self._drop_early_file(early[0], early[2])

    def _drop_early_file(self, r: int, task: asyncio.Future) -> None:
        if task.done():
            self._drop_unkept(r)
        else:
            task.add_done_callback(lambda _t: self._drop_unkept(r))

    def _drop_unkept(self, r: int) -> None:
        """Delete round ``r``'s start weights written early when the verifier does not keep the round."""
        wv = self.verifier
        if wv is not None and not wv.is_kept(r):
            wv.kept_weights.drop(r)

    def _queue_check(self, r: int, plan, a) -> None:
        """Blocking: queue this peer's screens of the round's newcomers (:meth:`~geomesh_p2p.trust.verify.WorkVerifier.
        queue_screens`, run first) and its sampled check of kept round ``r`` in the verifier's background worker, the
        accused's signed contributions taken now, while the collective holds them. Never skipped for time: it
        runs in the background of the next rounds (issue 28); ``due`` is when the first version gave up on it
        (the share ``time_share`` of the window after the exchange), past which it counts as late."""
        wv = self.verifier
        if wv is None:
            return
        collective = self._collective() if self._collective is not None else None
        due = time.time() + max(1.0, wv.cfg.time_share * float(plan.window_s))

        def signed_of(part: int, sender: str) -> Optional[bytes]:
            return verify.signed_contribution(collective, r, part, sender)

        # the newcomers' screens first (the worker runs them before any sampled check), then the sampled check
        wv.queue_screens(r, due=due, signed_of=signed_of)
        wv.queue_check(r, micro_batch=a.micro_batch, due=due, signed_of=signed_of)

    async def settle(self, timeout_s: float = SETTLE_S) -> None:
        """Wait up to ``timeout_s`` seconds for the tending task in flight (the last round's agreement line and
        checks' results), so a peer's closing "done" line is its last (fresh-user trial 44: the last round's
        "contributions" line came after it). Never raises; what is still running then is :meth:`cancel`'s."""
        t = self.task
        if t is not None and not t.done():
            await asyncio.wait({t}, timeout=timeout_s)

    def cancel(self) -> None:
        """Stop the event loop's side in flight (shutdown): the tending task and accountable mode's fetches. The
        checks in the worker thread stop in :meth:`close`; a job ending in between applies nothing (its result
        stays in the queue, as on a closed loop)."""
        self._cancelled = True
        for t in [self.task, self._ending, *self._fetches]:
            if t is not None and not t.done():
                t.cancel()
        self._early = None  # its thread ends on its own; close() deletes the file with the others

    def close(self) -> None:
        """Stop the background checks and delete the kept start weights' files (blocking: call it off the event
        loop). Safe to call twice."""
        if self.verifier is not None:
            self.verifier.close()

    def counts(self) -> Optional[dict]:
        """What this peer's background checks did so far (:meth:`~geomesh_p2p.trust.verify.WorkVerifier.counts`:
        drawn, queued, done, late, dropped, failed, waiting, busy and paced seconds) and, under ``"agreement"``,
        the newest round's relative agreement test (advisory); None before any round was kept (verified work
        off, or reencode mode)."""
        if self.verifier is None:
            return None
        out = self.verifier.counts()
        if self.fetch_counts:
            out["fetch"] = dict(self.fetch_counts)
        if self.agreement is not None:
            r, test = self.agreement
            out["agreement"] = {"round": r, **test.as_dict()}
            if self.support is not None and self.support[0] == r:
                out["agreement"]["support"] = {p[:10]: round(v, 4) for p, v in self.support[1].items()}
                out["agreement"]["claimed_steps"] = {p[:10]: h for p, h in self.support[2].items()}
        return out

    def verify_round(self, r: int, plan, a, ar) -> None:
        """The event loop's side of verified work after round ``r`` was kept (:meth:`before_outer_step`): apply
        the background checks that ended (verdicts, evidence published), read the evidence published about the
        kept rounds and queue re-checks of it (:meth:`~geomesh_p2p.trust.verify.WorkVerifier.tend`). No compute
        here: the checks run in the verifier's worker thread, paced to ``VerifyConfig.duty`` of the wall time.
        At most one tending task runs at a time (one still reading the DHT leaves this round's to the next:
        the results wait in the queue). Never raises: a failure here must not cost the round."""
        try:
            wv = self.verifier
            if wv is None or (not ar.contributions and getattr(plan, "mode", None) != "accountable"):
                return
            self._wire_ended(wv)
            running = self.task
            if running is not None and not running.done():
                log.debug("round %d: verified work: the previous round's evidence is still being read", r)
                return
            self._micro_batch = a.micro_batch
            self._own_task(self._tend(wv, r, a, ar, plan), r)
        except Exception as e:
            log.warning("round %d: verified work skipped: %s", r, e)

    def round_done(self, r: int) -> None:
        """Round ``r``'s row is out (its outer step, digest and digest check are over): its advisory agreement
        measurement (:meth:`_tend`), held until then, runs now."""
        self._done_round = max(self._done_round, int(r))
        if self._round_done_ev is not None:
            self._round_done_ev.set()

    async def _after_round(self, r: int) -> None:
        """Until :meth:`round_done` of round ``r`` or later, at most :data:`AGREEMENT_WAIT_S` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + AGREEMENT_WAIT_S
        while self._done_round < r:
            ev = self._round_done_ev = self._round_done_ev or asyncio.Event()
            ev.clear()
            try:
                await asyncio.wait_for(ev.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return

    def planned_out(self, r: int) -> None:
        """Round ``r`` runs without this peer (planned out, or refusing the plan): the background checks that ended
        are applied and the evidence published about the kept rounds is read and re-checked all the same
        (:meth:`~geomesh_p2p.trust.verify.WorkVerifier.tend`, at the micro-batch of the last round this peer
        trained), one tending task at a time as :meth:`verify_round`. Before session 27 only a round this peer
        applied tended them: a peer planned out for rounds neither published the verdicts its worker reached nor
        learnt the swarm's, and as a leader it planned a peer everyone else had excluded back in (the gap session
        26 closed for accountable proofs, :meth:`Accountability.read_in_background`). Never raises."""
        try:
            wv = self.verifier
            running = self.task
            if wv is not None:
                self._wire_ended(wv)
            if wv is None or (running is not None and not running.done()):
                return
            self._own_task(wv.tend(r, micro_batch=self._micro_batch), r)
        except Exception as e:  # the wait for the round's end must go on
            log.warning("round %d: verified work not tended: %s", r, e)

    def _wire_ended(self, wv) -> None:
        """Apply a background job's verdict as soon as the job ends (session 47): the queue's ``on_done`` wakes the event
        loop, which runs :meth:`~geomesh_p2p.trust.verify.WorkVerifier.apply_ended` (one task at a time; a job that
        ends meanwhile is applied by that task's next turn). Before, a verdict waited for the next round's tending,
        which runs after that round's row (behind the agreement test) or not at all while the previous one still
        reads the DHT, so the plan after the job's end was often agreed without it. Idempotent."""
        q = getattr(wv, "queue", None)
        if q is None or getattr(q, "on_done", None) is not None:
            return
        loop = asyncio.get_running_loop()

        def ended() -> None:  # in the worker thread
            try:
                loop.call_soon_threadsafe(self._apply_ended)
            except RuntimeError:  # the loop is closed (shutdown): the result stays in the queue
                pass

        q.on_done = ended

    def _apply_ended(self) -> None:
        """On the event loop: apply the jobs that ended (:meth:`_wire_ended`). Nothing after :meth:`cancel`: the worker
        runs on until :meth:`close` joins it, and a task started then would outlive the shutdown's cancel (red team 47)."""
        wv = self.verifier
        if wv is None or self._cancelled:
            return
        if self._ending is not None and not self._ending.done():
            self._ending_again = True
            return

        async def apply() -> None:
            self._ending_again = True
            while self._ending_again:
                self._ending_again = False
                await wv.apply_ended()

        self._ending = asyncio.ensure_future(apply())

        def failed(t: asyncio.Future) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.warning("verified work: applying an ended check failed: %s", t.exception())

        self._ending.add_done_callback(failed)

    def _own_task(self, coro, r: int) -> None:
        """Own ``coro`` as :attr:`task` (cancelled by :meth:`cancel`); its exception, if any, is one WARNING
        (``round r: verified work failed: ...``), never left unretrieved."""
        self.task = asyncio.ensure_future(coro)

        def failed(t: asyncio.Future) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.warning("round %d: verified work failed: %s", r, t.exception())

        self.task.add_done_callback(failed)

    async def _tend(self, wv: verify.WorkVerifier, r: int, a, ar, plan=None) -> None:
        """The checks' results (:meth:`~geomesh_p2p.trust.verify.WorkVerifier.tend`), then the round's relative
        agreement test (:mod:`geomesh_p2p.trust.agreement`; advisory: recorded in the row and logged, nothing
        dropped or excluded on it). Off the round's path: a task of its own. The aggregate's signs are taken first
        (two bitmaps, a sixteenth of its bytes: :func:`~geomesh_p2p.trust.agreement.signs_of`) and the aggregate let
        go at once: it is the buffer of the next round's gradients (issue 27, session 39:
        :class:`~geomesh_p2p.model.grad_buffer.FlatGradBuffer`), which the next steps take again only when nobody
        else holds it (session 42: held until the row, every round's steps took a fresh ``[P]``). The contributions
        are decoded once the round's row is out (:meth:`round_done`; issue 27: into the next round)."""
        aggregate = getattr(ar, "aggregate", None)
        contributions, ranges = ar.contributions, ar.part_ranges
        del ar
        found = support = None
        if aggregate is not None and ranges and contributions:
            # The aggregate's signs at once, beside the outer step (one pass, 0.18 s at P = 89M), and the aggregate
            # let go: it is the buffer of the next round's gradients, and held past the row it made the next
            # steps take a fresh [P] (+340 MiB at gpt2-124m, every round: session 42).
            signs = await asyncio.to_thread(agreement.signs_of, aggregate)
            aggregate = None
            # After the round's row: decoding every contribution took ~0.5 s of CPU beside the outer step and the
            # digest, on the core they run on (issue 27, session 38).
            await self._after_round(r)
            found = await asyncio.to_thread(agreement.sign_agreements, contributions, signs, ranges)
            del signs
            support = await asyncio.to_thread(agreement.supports, contributions, ranges)
            await asyncio.to_thread(release_freed_memory)  # their slices, beside the next steps (session 41)
        aggregate = None
        steps = _claimed_steps(contributions, plan)
        await wv.tend(r, micro_batch=a.micro_batch)
        if found is None:
            return
        test = agreement.relative_threshold(found)
        self.agreement = (r, test)
        self.support = (r, support or {}, steps)
        # Per contributor, for the record (docs/security.md "Stealthy attacks": measured from these lines): its
        # plain agreement, its support (what the aggregation's support filter decides on, per part) and the
        # inner steps its token claim implies at its planned batch.
        measured = ", ".join(
            f"{p[:10]} {found[p]:.3f} / {support[p]:.3f} / {steps.get(p, '?')}"
            for p in sorted(found)
            if support and p in support
        )
        # nothing measured (1-2 contributors: no support to speak of) is no news: DEBUG ("contributions: none
        # measured" every round read as noise to a fresh user, session 34)
        log.log(
            logging.INFO if measured else logging.DEBUG,
            "round %d: contributions (agreement / support / claimed steps): %s",
            r,
            measured or "none measured",
        )
        if test.outliers:
            # DEBUG: it flags the honest peer holding the fewest steps in most rounds (agreement grows with the steps a
            # contribution holds; agreement.py), which a volunteer read as being taken for an attacker (session 35);
            # the row keeps the figures (extra["verify"]["agreement"])
            log.debug(
                "round %d: sign agreement with the aggregate below the round's relative threshold %.3f (median "
                "%.3f, MAD %.3f): %s (advisory: nothing is dropped on it)",
                r,
                test.threshold,
                test.median,
                test.mad,
                ", ".join(f"{p[:10]} {found[p]:.3f}" for p in test.outliers),
            )

    def plan_problem(self, plan) -> Optional[str]:
        """Why this peer refuses ``plan`` for verified work's sake (an excluded peer that leads would plan
        itself back in): :meth:`geomesh_p2p.trust.verify.WorkVerifier.plan_problem`. None: no objection."""
        return self.verdicts().plan_problem(plan, me=self.state.me)

    def accused(self, plan) -> list[str]:
        """The participants ``plan`` (this peer's, as leader) names accused (``RoundPlan.accused``): those against
        which this peer read published hard evidence it has not settled yet
        (:meth:`~geomesh_p2p.trust.verify_fetch.EvidenceExchange.pending_accused`), most accusers first, at most
        :func:`~geomesh_p2p.plan.schema.max_accused`; sorted PeerIDs, ``[]`` without a verifier. They lead nothing in
        the next round (``round.planning.next_leaders``); this plan itself still names them (a verdict this peer does
        not hold yet excludes nobody from its plans)."""
        if self.verifier is None:
            return []
        ids = [p for p in plan.participants() if p not in (plan.leader, self.state.me)]
        found = self.verifier.pending_accused(ids)
        top = sorted(found, key=lambda p: (-found[p], p))[: max_accused(len(plan.participants()))]
        return sorted(top)

    def members(self, members):
        """The planner's input without the peers that verified work excluded (their evidence re-checked
        here, :meth:`geomesh_p2p.trust.verify.WorkVerifier.filter`); this peer itself always stays."""
        return self.verdicts().filter(members, keep=self.state.me)

    def member_ids(self, peer_ids: Iterable[str]) -> list[str]:
        """:meth:`members` of PeerIDs (the peers that verified work excluded left out; this peer itself stays)."""
        v = self.verdicts()
        return [p for p in peer_ids if v.kept(p, keep=self.state.me)]
