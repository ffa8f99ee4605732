"""Verified work (issue 11; DESIGN.md "Untrusted volunteers", item 3): peers re-compute a sampled
contributor's batches and check that its signed contribution carries their trace.

Batches are a pure function ``dataset.sample_batch(seed, peer, round, step, batch, seq_len)``, so any peer can
recompute what a contributor trained on. What it cannot recompute is the contributor's trajectory: the inner AdamW
state persists across rounds on each peer (DiLoCo), so the first inner step of a round already moves mostly along the
peer's old momentum, and no other peer holds that momentum. Re-running "the first k inner steps" and comparing signs
(the first idea) was therefore measured and replaced by a test that needs no optimizer state:

* **What is recomputed.** The gradient, at the round's start weights, of ``k`` of the contributor's
  batches (steps sampled at random from the steps its token claim implies), and of ``m`` *control*
  batches nobody trains on (stream :data:`CONTROL_STREAM`). Gradient signs equal the signs of a fresh
  AdamW's first step, need no learning rate or optimizer state, and cost one forward/backward each.
* **What is compared**, on 2^18 elements sampled over the whole contribution (every part; one part
  alone can be all embedding rows of rare tokens, where every update follows weight decay and nothing
  was measured), with ``c`` its decoded signs: ``plain``, the sign agreement of ``c`` with the sum of
  the normalised batch gradients; and ``trace``, the ``|d|``-weighted sign agreement of ``c`` with
  ``d``, the sum of the batch gradients with what every update shares projected out: the span of the
  control gradients and of the checking peer's *own* contribution. ``trace`` is 0.5 for a
  contribution that holds no trace of the contributor's own batches (another peer's data, a copy of
  another update, a stale or random update), above 0.5 for an honest one, below for a flipped one.
  Only the checker's own contribution enters the basis: with the others' contributions the test
  is a little sharper, but a free rider could then send a near-copy of an honest peer's update and
  erase that peer's trace (near-copies cannot be told apart and left out: in parts dominated by
  weight decay honest updates agree on > 90% of signs).
* **Scale.** AdamW moves an element by at most ~1.17 x lr per step (beta1 0.9, beta2 0.95) plus weight
  decay, so a block scale above ``steps x lr x (1.5 + wd x max|theta|)`` was not trained: it fails.
  All-zero scales with a token claim fail too.

Measured with ``python benchmarks/verify_agreement.py --adamw`` (tiny preset, KJV, seq_len 64, batch 8;
4 peers, each with its own persistent AdamW, train sign-compressed rounds of 20 steps; at rounds 1, 4,
8, 13, 19 contributor A's contribution is built for H = 5..40 from its real optimizer state and checked
as here with 10 draws of its k steps, 4 controls, the checker's own round delta as the basis):
``trace`` min / mean / max, the share of checks below 0.515, then the lowest ``plain``.

=============  ========================  ========================  ========================  ========================
candidate      H=5 (k=4)                 H=10 (k=4)                H=20 (k=5)                H=40 (k=10)
=============  ========================  ========================  ========================  ========================
honest         .591/.696/.781 0% .669    .551/.655/.762 0% .640    .531/.620/.708 0% .635    .529/.603/.677 0% .632
honest bf16    the same to 0.001         the same                  the same                  the same
wrong data     .513/.543/.583 6% .597    .502/.535/.571 14% .598   .508/.524/.549 24% .589   .499/.524/.549 26% .592
stale, own     .481/.496/.510 100% .560  .474/.500/.540 88% .558   .467/.498/.523 96% .554   .463/.500/.528 84% .552
stale, global  .477/.493/.511 100% .582  .458/.494/.532 94% .577   .452/.494/.518 96% .570   .456/.494/.523 94% .568
flipped        .219/.304/.409 100% .202  .238/.345/.449 100% .237  .292/.380/.469 100% .238  .323/.397/.471 100% .250
noise          .495/.501/.506 100% .494  .494/.500/.506 100% .494  .494/.498/.504 100% .494  .493/.498/.505 100% .494
first 2 only   .539/.623/.720 0%         .458/.570/.718 12%        .487/.568/.700 12%        .477/.553/.665 14%
first H/2      .539/.623/.720 0%         .535/.623/.723 0%         .510/.604/.711 2%         .517/.583/.668 0%
=============  ========================  ========================  ========================  ========================

("wrong data": A's own optimizer state trained on another peer's batches, like a free rider copying a
peer's update; "stale, own": A's previous round delta; "stale, global": the previous global update,
the adversary's ``stale``; "first 2 only / first H/2": only those steps trained, rescaled to the honest
magnitude; "honest bf16": the contributor under CPU bf16 autocast, a proxy for a GPU contributor
checked by a CPU peer; for noise the ``plain`` column is the highest.) Float noise: gradient signs of
fp32 and bf16 autocast agree on 99.81-99.93% of the elements (|g|-weighted 99.999%), 1 and 2 threads on
100%, and the statistics move by <= 0.001. CPU/GPU kernels could not be measured here: the thresholds
keep >= 0.014 (trace) and >= 0.08 (plain) from the lowest honest value for them. With the three other
peers' contributions as the basis (``--basis others``; an earlier version of the script) wrong data fell
below 0.515 in 40-80% of the checks, honest no lower than 0.525. At seq_len 32, batch 4 (the attack
suite's setting; rounds 1, 6, 13, 5 draws, H = 5 / 20 / 40): honest trace >= 0.585 / 0.555 / 0.537 and
plain >= 0.677, wrong data below 0.515 in 33% of the checks, stale (own / global) in 67-80%, flipped and
noise always failed. The first idea, a fresh AdamW re-run of k = 1, 2,
4 steps compared by sign with the contribution, gave honest 0.61-0.81 against wrong data 0.60-0.79 and
stale 0.57-0.74 over the same rounds: no threshold separates them.

Decisions (:func:`judge`): fail ("hard") on zero scales, a scale above the bound, ``plain`` < 0.52
(flipped, random) or ``trace`` < 0.50; "marginal" when ``trace`` < 0.515 or ``plain`` < 0.55 (hard below
0.55 until session 35, when an honest contribution checked on 2 of its 4 parts measured 0.544; ``plain`` counts
only the elements some batch moved, see :func:`~.verify_check.work_statistics`). Honest contributions never
fell below 0.529 (the honest block scale peaked at 0.92 x H x lr right after warm-up, 0.3-0.5 later).
The trace tests apply to 5..64 steps (k >= steps/4, the measured range); above 64 steps only the scale
and plain tests run (with k = 4); under 5 steps nothing is checked. Zero and out-of-bound scales are
decided before any computation.

Cost and coverage. A check costs ``k + m`` forward/backward passes of the contributor's batch (9 at H = 20: 45% of one
contributor-round). Each peer checks with probability ``p = min(1, share x (H_v x B_v) / ((k + m) x B_t))`` per round
(``share`` = :attr:`VerifyConfig.share`, 0.05 by default since session 19, 0.1 before: the other half went to sampled
screens of established contributors, :func:`~.verify_task.sampled_candidates`), so it draws at most ``share`` of its
own compute on average; each contributor is then checked by ~``share x H / (k + m)`` peers per round (0.11 per peer at
H = 20). A drawn check is never skipped for time (issue 28; the first version skipped those that would not end before
the next round's start, 21 of 28 in a clean 4-peer run): it queues in a background worker (:mod:`.verify_queue`) paced
to ``duty`` (0.15) of the wall time, in the background of the next rounds' inner steps, and its verdict is applied
when it ends (:meth:`WorkVerifier.tend`), for the round it checked; the round's start weights stay kept until then.
Its latency is ``(k + m) x B_t / (H_v x B_v) / duty`` rounds: ~1.3 rounds at H = 100, 3 at H = 20, ~11 at H = 5.
Caught: zeros (free riders that send nothing), flipped, noise, scaled above the bound (~2x honest magnitudes right
after warm-up, 3x later) -- hard, excluded after one confirmed check; stale updates (hard in ~50%, marginal in 84-100%
of the checks); updates computed on other data or copied from another peer (marginal in 6-26% of the checks: excluded
after two confirmed marginal checks in different rounds, so only a persistent one, after many rounds). Not caught: a
peer that trains a fair share of its batches honestly and fakes the rest (at most in proportion to what it skips,
"first ... only" above), scaling within the bound (the aggregation's clip is the defence there), anything in a round
where nobody checks it, a contribution of a peer planned fewer than ``min_steps`` steps (never drawn: the thresholds
are not measured there; one planned more that claims fewer counts 0 tokens since session 32:
:func:`geomesh_p2p.round.rules.spec.screen_token_floor`; session 46: the gain test's 1,792 tokens from round 2 on
where planned, ``verify_task.claim_floor_steps``, and no draw takes a claim counting 0), and everything in reencode
mode (nobody but the owner sees a contribution). In accountable mode the draws read the part results' commitments and
a check fetches the accused's contributions to at most 2 of its parts, checked against them (:mod:`.verify_commit`,
session 19). A late verdict can be re-checked only by peers that still keep its round (``recheck_rounds`` = 12, 3
before session 16, when at small H it usually stayed a verdict held alone).

Who checks whom. Verifier ``v`` signs ``(run, round, start digest)`` with its Ed25519 key; the SHA-256 of that
signature decides whether it checks this round, whom, which steps and elements. Nobody else can predict it (no
contributor knows in advance whether or where it is checked), and anyone can check it afterwards with ``v``'s public
key. The seed is fixed before the contributions are signed (the start digest), but only ``v`` can compute it, so an
attacker can neither predict nor dodge it: which contributions are eligible depends only on what every participant
received. (A dishonest verifier can make other valid signatures and so pick whom it accuses; that gains it nothing,
see below.)

Evidence and exclusion. A failing check is signed by the verifier and stored in the DHT under
``<run>/evidence/<round>``, subkey = the verifier's PeerID (only it can write there): round, accused, the selection
signature, the task, the values measured and the SHA-256 of each of the accused's packets (chunked past one DHT value,
:mod:`.evidence`); beside it (:func:`contributions_key`, one value per part that fits a DHT value) the accused's own
signed contributions, which need no other signature. Every peer that holds the round's start weights and contributions
(the participants, for :attr:`VerifyConfig.recheck_rounds` rounds) re-checks it by re-running the computation with its
own contribution as the basis, and excludes the accused from the plans it makes when its own measurement fails too
(one hard failure, or marginal failures in two different rounds). Re-checking, not counting accusers, because a lying
verifier must gain nothing: a verifier may only accuse the peer its own signature drew (so at most one accusation per
verifier and round); its claim is recomputed, never trusted; a hard accusation that the re-check passes by a wide
margin excludes the accuser. "At least two accusers" would let two Sybils exclude any honest peer. Followers also
refuse a plan led by a peer they excluded, or naming one excluded more than two rounds earlier
(:meth:`WorkVerifier.plan_problem`): an excluded peer that leads would plan itself back in. Not for a verdict a peer
holds alone (only its own checks failed the accused, :attr:`WorkVerifier.lone`): the statistic depends on the
checker's basis, so the others may all pass what it failed, and refusing their plans split it off the swarm (issue
28). It keeps following, leaves the accused out of the plans it leads, and the exclusion counts in full once another
verifier's evidence, re-checked here, fails the accused too. Exclusions are saved with the checkpoint and restored by
``--resume`` (:class:`Verdicts`); evidence expires after :attr:`VerifyConfig.evidence_ttl_s` and needs the round's
weights to be re-checked.

Where: what a check draws (:mod:`.verify_task`), the check itself (:mod:`.verify_check`), the evidence a failed check
publishes (:mod:`.evidence`); here, the node's side (:class:`WorkVerifier`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, TypedDict

import torch

from geomesh_p2p.net.identity import Identity
from geomesh_p2p.telemetry.logonce import LogOnce
from geomesh_p2p.trust.check_model import hollow_copy, release_
from geomesh_p2p.trust.kept_weights import KeptWeights
from geomesh_p2p.trust.verdicts import MAX_RESTORED, Verdicts
from geomesh_p2p.trust.evidence import (
    MAX_VALUE_BYTES,
    Evidence,
    EvidenceError,
    EvidenceReader,
    signed_contribution,
)
from geomesh_p2p.trust.verify_commit import Committed, materialize, narrow, overlay
from geomesh_p2p.trust.verify_fetch import EvidenceExchange
from geomesh_p2p.trust.verify_held import HeldContributions
from geomesh_p2p.trust.verify_queue import CheckJob, CheckQueue, Pacer
from geomesh_p2p.trust.verify_screen import Kept, Measured, Prepared, Screening, pack_packets, unpack_packets
from geomesh_p2p.trust.verify_check import (
    FAIL,
    MARGINAL,
    PASS,
    Verdict,
    VerifyTimeout,
    WorkStats,
    check_contribution,
    packet_digest,
)
from geomesh_p2p.trust.verify_task import (
    SCREEN,
    VerifyConfig,
    VerifyTask,
    derive_task,
    screen_candidates,
    selection_message,
)

if TYPE_CHECKING:  # typing.Unpack for **kwargs is Python 3.12 (PEP 692); only type checkers read it
    from typing_extensions import Unpack

log = logging.getLogger(__name__)


__all__ = ["WorkVerifier", "CheckOptions", "signed_contribution", "Verdicts", "MAX_RESTORED"]


class CheckOptions(TypedDict, total=False):
    """The keyword options of :meth:`WorkVerifier.check_round`, which :meth:`WorkVerifier.run_round`
    passes on (see check_round for their meaning; an option left out is None)."""

    micro_batch: Optional[int]
    deadline: Optional[float]
    signed_of: Optional[Callable[[int, str], Optional[bytes]]]


class WorkVerifier(Verdicts, Screening, EvidenceExchange, HeldContributions):
    """One per node: keeps the last rounds' start weights and contributions, runs this node's checks,
    publishes and re-checks evidence, and keeps the set of excluded peers (:meth:`filter`).

    ``model``: a private copy of the model (on the node's device); ``dataset``: the run's data;
    ``seed``: the run's batch seed; ``lr`` / ``weight_decay``: the inner optimizer's peak lr and decay
    (for the scale bound); ``dht``: anything with the DHTNode ``store`` / ``get`` coroutines (None: no
    publishing or reading); ``kept_dir``: where the private directory of the kept start weights is made
    (None: the system's temp folder; :class:`~geomesh_p2p.trust.kept_weights.KeptWeights`). Call
    :meth:`close` when done (it deletes those files)."""

    def __init__(
        self,
        cfg: VerifyConfig,
        *,
        identity: Identity,
        run_id: str,
        model,
        dataset,
        seed: int,
        lr: float,
        weight_decay: float,
        amp: bool = False,
        dht=None,
        kept_dir: Optional[str] = None,
    ):
        super().__init__(str(identity.peer_id))
        self.cfg = cfg
        self.identity = identity
        self.run_id = run_id
        self.model = model
        self.dataset = dataset
        self.seed = int(seed)
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.amp = bool(amp)
        self.dht = dht
        self._kept: "OrderedDict[int, Kept]" = OrderedDict()
        # the kept rounds' start weights live in files, not on the heap (4P bytes of RSS each otherwise)
        self._weights = KeptWeights(kept_dir)
        self._compute = threading.Lock()
        self._seen: set[str] = set()
        self._pending: "OrderedDict[str, bytes]" = OrderedDict()  # sha256 of the head -> signed evidence
        self._reader: Optional[EvidenceReader] = None  # for self.dht (which a test may swap)
        self._log_once = LogOnce(log, capacity=1024)
        #: (round, task, stats, verdict) of this node's own checks, newest last (bounded)
        self.history: list[tuple[int, VerifyTask, WorkStats, Verdict]] = []
        #: the background worker of :meth:`queue_check` / :meth:`queue_screens` / :meth:`tend` (its thread starts
        #: with the first job; screens in a lane of their own, run first)
        params = next(iter(model.parameters()), None) if model is not None else None
        on_cpu = params is None or params.device.type == "cpu"
        stop = threading.Event()  # a CPU device is paced by the worker's CPU time (Pacer: not the waits for a core)
        pacer = Pacer(
            cfg.duty, stop, cpu_clock=time.thread_time if on_cpu else None, cpu_threads=torch.get_num_threads()
        )
        self.queue: CheckQueue = CheckQueue(
            cfg.duty, cfg.max_pending, max_screens=cfg.max_screens, pacer=pacer, stop=stop
        )
        self._init_screening()
        self._pending_ev: dict[str, Evidence] = {}  # evidence pending a re-check, as opened by fetch
        #: the newest round :meth:`tend` was called for (a verdict reached later counts its plan grace from it)
        self.now_round = 0
        self._queued: set[str] = set()  # evidence (sha256 of its head) whose re-check is queued
        self._pending_round: dict[str, int] = {}  # evidence -> the kept round it was read for
        self._last_keep: Optional[float] = None  # monotonic time of the last keep_round (the round's length)
        self._round_gaps: list[float] = []  # seconds between the last kept rounds (at most 5)

    @classmethod
    def for_node(cls, node, cfg: Optional[VerifyConfig] = None) -> "WorkVerifier":
        """A verifier wired to a :class:`~geomesh_p2p.node.peer.PeerNode` (a private copy of its model: on the CPU
        a hollow one, whose parameters are views of the checked round's kept weights only while a check runs,
        :mod:`.check_model`; on a GPU a whole copy in device memory)."""
        rc = node.run_cfg
        hollow = all(p.device.type == "cpu" and p.dtype == torch.float32 for p in node.model.parameters())
        model = hollow_copy(node.model) if hollow else copy.deepcopy(node.model)
        wv = cls(
            cfg or VerifyConfig(),
            identity=node.identity,
            run_id=rc.run_id,
            model=model,
            dataset=node.dataset,
            seed=rc.seed,
            lr=rc.inner_lr,
            weight_decay=0.1,
            amp=bool(node.cfg.amp) and node.device.type == "cuda",
            dht=getattr(node, "dht", None),
        )
        # a CPU peer's check passes take turns with its inner steps (issue 27, session 39: model/turns.py)
        wv.queue.pacer.turns = getattr(getattr(node, "trainer", None), "turns", None) if hollow else None
        return wv

    # -- bookkeeping ----------------------------------------------------------------------------------
    def keep_round(
        self,
        round: int,
        *,
        theta: Optional[torch.Tensor],
        plan,
        part_ranges: Sequence[tuple[int, int]],
        packets: Mapping[str, Mapping[int, Any]],
        committed: Optional[Mapping[str, Mapping[int, Committed]]] = None,
    ) -> None:
        """Remember ``round``'s start weights, plan and received contributions (blocking: call it off the
        event loop). Accountable mode: ``committed`` (sender -> part -> :class:`~.verify_commit.Committed`, every
        applied part result's inputs) stands in for the contributions not held here; ``packets`` are this peer's
        own (a check's basis) and those fetched later (:meth:`hold`). ``theta`` (fp32 CPU ``[P]``) is written to
        a file of the verifier's private directory (``4P`` bytes; the caller may change ``theta`` once this
        returns; None: written already by ``kept_weights.put``) and read back, bitwise, when a check needs it; the oldest rounds past
        ``cfg.keep_rounds`` are dropped, files included, unless a check or re-check in the background queue still
        needs them (:meth:`queue_check`).

        Raises:
            ValueError: ``theta`` is not fp32 on the CPU.
            OSError: the file could not be written (the round is not kept).
        """
        r = int(round)
        self._set_burst(plan)
        if theta is not None:  # None: written already (kept_weights.put of this round)
            self._weights.put(r, theta)
        got = {p: dict(v) for p, v in packets.items()}
        com = None if committed is None else {p: dict(v) for p, v in committed.items()}
        seen = got if com is None else overlay(com, got)
        screened = screen_candidates(self.cfg, plan, seen) if plan is not None and seen else []
        self._kept[r] = Kept(plan, [(s, e) for s, e in part_ranges], got, screened, committed=com)
        self._kept.move_to_end(r)
        # Rounds stay re-checkable for recheck_rounds (a late verdict must find its round at the others: issue
        # 28), and longer while a queued job needs them; past keep_rounds their contributions leave memory for a
        # file beside their start weights (disk: 4P + contributors x P/8 bytes a round).
        busy = self.queue.rounds()
        horizon = max(self.cfg.keep_rounds, self.cfg.recheck_rounds)
        older = list(self._kept)[: max(0, len(self._kept) - horizon)]
        for old in [k for k in older if k not in busy]:
            del self._kept[old]
            self._weights.drop(old)
        for old in list(self._kept)[: max(0, len(self._kept) - self.cfg.keep_rounds)]:
            k = self._kept[old]
            if k.packets is not None:
                if k.packets:
                    self._weights.put_blob(old, pack_packets(k.packets))
                k.packets = None

    def _set_burst(self, plan) -> None:
        """The worker's burst allowance: its duty held over ``burst_rounds`` rounds, a round being the time since the
        last kept round (the plan's window before there is one; :meth:`~geomesh_p2p.trust.verify_queue.Pacer.set_window`)."""
        now = time.monotonic()
        if self._last_keep is not None:
            self._round_gaps = (self._round_gaps + [now - self._last_keep])[-5:]
        self._last_keep = now
        # the median of the last gaps: one stalled round does not widen the window (and the burst) eightfold
        gaps = sorted(self._round_gaps) or [float(getattr(plan, "window_s", 0) or 0)]
        round_s = gaps[len(gaps) // 2]
        if round_s > 0 and isinstance(self.queue.pacer, Pacer):
            self.queue.pacer.set_window(self.cfg.burst_rounds * round_s)

    def _packets(self, round: int, kept: Kept) -> dict:
        """Round ``round``'s contributions, sender -> part -> packet: in memory for the newest ``keep_rounds``,
        else read back from their file (blocking; {} when it is gone)."""
        got = kept.packets
        if got is None:
            blob = self._weights.get_blob(round)
            got = unpack_packets(blob) if blob else {}
        return got if kept.committed is None else overlay(kept.committed, got)

    def kept_theta(self, round: int) -> Optional[torch.Tensor]:
        """Round ``round``'s kept start weights, fp32 CPU ``[P]`` mapped read-only from their file (writes
        stay private to the tensor), or None when the round is not kept. Drop the tensor when done: its
        pages leave the process then."""
        return self._weights.get(round) if int(round) in self._kept else None

    def is_kept(self, round: int) -> bool:
        """Whether ``round`` is kept (:meth:`keep_round`, not dropped since)."""
        return int(round) in self._kept

    @property
    def kept_weights(self) -> KeptWeights:
        """The store of the kept start weights (its directory and files)."""
        return self._weights

    def close(self) -> None:
        """Stop the background worker (waiting checks are dropped), forget the kept rounds and delete their
        files and directory. Safe to call twice."""
        self.queue.close()
        self._kept.clear()
        self._weights.close()

    def selection(self, round: int, start_digest: Optional[str]) -> bytes:
        return self.identity.sign(selection_message(self.run_id, round, start_digest))

    def _record(self, task: VerifyTask, verdict: Verdict, by: str) -> None:
        """A failure of ``task.accused`` measured here (own check or re-check): exclude when the rule says so.
        The exclusion is for the round checked; its plan grace runs from :attr:`now_round` when the verdict
        comes later (a background check: the others need their rounds to re-check it too)."""
        lone = by == self.me
        at = max(task.round, self.now_round)
        if verdict.outcome == FAIL:
            self._exclude(task.accused, f"round {task.round}: {verdict.reason} (checked by {by[:10]})", at, lone=lone)
        elif verdict.outcome == MARGINAL:
            rounds = self._marginal.setdefault(task.accused, set())
            rounds.add(task.round)
            recent = {r for r in rounds if r > task.round - self.cfg.marginal_window}
            self._marginal[task.accused] = recent
            if len(recent) >= self.cfg.marginal_needed:
                self._exclude(
                    task.accused,
                    f"rounds {sorted(recent)}: {verdict.reason} (last checked by {by[:10]})",
                    at,
                    lone=lone,
                )

    def _run(
        self,
        task: VerifyTask,
        packets: Mapping[str, Mapping[int, Any]],
        theta: torch.Tensor,
        micro_batch: Optional[int],
        deadline: Optional[float],
        pace: Optional[Pacer] = None,
        kept: Optional[Kept] = None,
    ):
        """:func:`check_contribution` of ``task`` here (blocking, heavy), with this node's own contribution of
        ``kept``'s round as the loss-gain test's power reference (none without ``kept``)."""
        with self._compute:
            if pace is not None:
                pace.start()  # the wait for the device (another check) is not this check's compute
            try:
                return check_contribution(
                    self.cfg,
                    task,
                    model=self.model,
                    dataset=self.dataset,
                    theta=theta,
                    seed=self.seed,
                    packets=packets,
                    lr=self.lr,
                    checker=self.me,
                    weight_decay=self.weight_decay,
                    micro_batch=micro_batch,
                    amp=self.amp,
                    deadline=deadline,
                    pace=pace,
                    plan=kept.plan if kept is not None else None,
                    cache=kept.controls if kept is not None else None,
                )
            finally:
                release_(self.model)  # a hollow model holds no weights between checks (issue 27)

    # -- this node's check ----------------------------------------------------------------------------
    def own_task(self, round: int) -> Optional[VerifyTask]:
        kept = self._kept.get(round)
        if kept is None:
            return None
        sel = self.selection(round, kept.plan.start_digest)
        task = derive_task(
            self.cfg,
            plan=kept.plan,
            verifier=self.me,
            selection=sel,
            packets=self._packets(round, kept),
            part_ranges=kept.part_ranges,
        )
        return narrow(task) if kept.committed is not None else task  # accountable: a bounded fetch

    def _prepare(
        self, round: int, signed_of: Optional[Callable[[int, str], Optional[bytes]]] = None
    ) -> Optional["Prepared"]:
        """This node's check of ``round`` as drawn (None: not kept, or not drawn), with the accused's signed
        contributions taken now from ``signed_of(part, sender)`` (a late check no longer finds them in the
        collective, which keeps a few rounds). Blocking (it parses part results): off the event loop."""
        kept = self._kept.get(round)
        task = self.own_task(round)
        if kept is None or task is None:
            return None
        if kept.committed is not None:
            mine = self._packets(round, kept).get(task.accused, {})
            if any(isinstance(mine.get(j), Committed) for j in task.parts):
                log.info(
                    "round %d: verified work of %s not run: its contribution is not held here", round, task.accused[:10]
                )
                return None
        signed = {}
        for j in task.parts:
            b = signed_of(j, task.accused) if signed_of is not None else None
            if b and len(b) <= MAX_VALUE_BYTES:
                signed[j] = b
        return Prepared(round, kept, task, signed)

    def _measure(
        self,
        prep: "Prepared",
        micro_batch: Optional[int] = None,
        deadline: Optional[float] = None,
        pace: Optional[Pacer] = None,
    ) -> Optional[Measured]:
        """Run a prepared check (blocking, heavy: :func:`check_contribution`; ``pace()`` between its passes).
        None when it cannot be run (its round's weights are gone, out of memory at one row, past
        ``deadline``); the evidence of a failure is built here (hashing its packets), not applied."""
        kept, task = prep.kept, prep.task
        theta = self._weights.get(prep.round)
        if theta is None:
            log.info(
                "round %d: verified work of %s not run: the round's kept weights are gone",
                prep.round,
                task.accused[:10],
            )
            return None
        packets = self._packets(prep.round, kept)
        try:
            stats, verdict, used = self._run(task, packets, theta, micro_batch, deadline, pace, kept)
        except (VerifyTimeout, MemoryError) as e:  # out of memory even at one row: no verdict, no round lost
            log.debug("round %d: verified work of %s abandoned: %s", prep.round, task.accused[:10], e)
            return None
        ev = None
        if verdict.outcome != PASS:
            mine = packets[task.accused]
            ev = Evidence(
                run_id=self.run_id,
                round=prep.round,
                verifier=self.me,
                accused=task.accused,
                start_digest=kept.plan.start_digest,
                selection=self.selection(prep.round, kept.plan.start_digest),
                task=task,
                packets={j: packet_digest(mine[j]) for j in task.parts},
                basis=used,
                plain=stats.plain,
                trace=stats.trace,
                outcome=verdict.outcome,
                reason=verdict.reason,
                contributions=prep.signed,
            )
        return Measured(prep.round, task, stats, verdict, ev)

    def _conclude(self, m: Measured) -> Optional[Evidence]:
        """Apply a measured check here (its verdict, in the round it checked; the plan grace runs from
        :attr:`now_round` when it ends later): history, log, exclusion. Returns its evidence (None: passed)."""
        self.history = (self.history + [(m.round, m.task, m.stats, m.verdict)])[-100:]
        if m.verdict.outcome == PASS:
            # at INFO too (issue 28, session 31): a false positive is judged against the statistic's honest
            # distribution, which only the passes show (one line per check or screen: a few per round at most)
            log.info("round %d: verified work of %s passes: %s", m.round, m.task.accused[:10], m.verdict.reason)
            return None
        # a marginal measurement alone accuses nobody (cfg.marginal_needed of them in cfg.marginal_window rounds
        # do): said so, not "does not reproduce" (a fresh user read an honest demo peer's marginal one as fraud)
        marginal = m.verdict.outcome == MARGINAL
        log.info(
            "round %d: verified work: the contribution of %s %s: %s%s",
            m.round,
            m.task.accused[:10],
            f"is marginal (a doubt, not a failure: {self.cfg.marginal_needed} within {self.cfg.marginal_window} "
            "rounds exclude)"
            if marginal
            else "does not reproduce",
            m.verdict.reason,
            f" (checked in the background, concluded in round {self.now_round})"
            if self.now_round > m.round + 1
            else "",
        )
        self._record(m.task, m.verdict, self.me)
        return m.evidence

    def check_round(
        self,
        round: int,
        *,
        micro_batch: Optional[int] = None,
        deadline: Optional[float] = None,
        signed_of: Optional[Callable[[int, str], Optional[bytes]]] = None,
    ) -> Optional[Evidence]:
        """Run this node's check of ``round`` now (blocking; call it off the event loop). Returns the
        evidence when the contribution failed (``signed_of(part, sender)`` supplies the accused's signed
        contributions to attach), else None; abandoned (None) only past ``deadline`` or out of memory. A
        node runs its checks in the background instead (:meth:`queue_check`): never skipped for time."""
        prep = self._prepare(round, signed_of)
        m = self._measure(prep, micro_batch, deadline) if prep is not None else None
        return self._conclude(m) if m is not None else None

    # -- the background queue (issue 28: a check is never skipped) ------------------------------------
    def queue_check(
        self,
        round: int,
        *,
        micro_batch: Optional[int] = None,
        due: Optional[float] = None,
        signed_of: Optional[Callable[[int, str], Optional[bytes]]] = None,
    ) -> bool:
        """Queue this node's check of kept round ``round`` in the background worker (:class:`CheckQueue`:
        paced to ``cfg.duty`` of the wall time); its verdict is applied by :meth:`tend` once it ends, however
        many rounds later. ``due``: when the first version would have given up on it (counted ``late`` past
        it). Blocking (it takes the accused's signed contributions, :meth:`_prepare`): off the event loop.
        True when a check was queued (this node's selection drew one)."""
        prep = self._prepare(round, signed_of)
        if prep is None:
            return False
        self.queue.submit(
            CheckJob(
                round,
                "check",
                lambda pace: self._measure(prep, micro_batch, None, pace),
                key=prep.task.accused,
                due=due,
            )
        )
        return True

    def counts(self) -> dict:
        """What the background queue did (:meth:`~geomesh_p2p.trust.verify_queue.CheckCounts.as_dict`: queued, done, late, dropped, failed,
        waiting, busy and paced seconds), plus ``drawn``: this node's checks queued; all 0 before any."""
        c = self.queue.snapshot()
        return {**c.as_dict(), "drawn": c.by_kind.get("check", 0), "screened": c.by_kind.get("screen", 0)}

    async def apply_ended(self) -> list[Evidence]:
        """Apply the checks and re-checks that ended (verdicts, evidence published): at :meth:`tend`, and when a job ends
        (session 47: the queue's ``on_done``, so a verdict is held before the next plan). Returns the evidence published."""
        out = []
        for job, result, error in self.queue.results():
            if error is not None:  # one record that got past fetch, say: dropped, never re-queued
                self._log_once(
                    job.key,
                    logging.WARNING,
                    "round %d: verified work (%s of round %d) failed: %r",
                    self.now_round,
                    job.kind,
                    job.round,
                    error,
                )
                if job.kind in ("recheck", "rescreen"):
                    self._queued.discard(job.key)
                    self._forget(job.key)
                elif job.kind == "screen":
                    self._screen_jobs.discard(job.key)
                continue
            if job.kind in ("check", "screen", "probe"):  # a probe (ordering the round's screens) returns None
                if job.kind == "screen":
                    self._screen_jobs.discard(job.key)
                ev = self._conclude(result) if result is not None else None
                if ev is not None:
                    await self.publish(ev)
                    out.append(ev)
            else:
                self._queued.discard(job.key)
                if result == "late":
                    continue
                self._forget(job.key)
        return out

    async def tend(self, round: int, *, micro_batch: Optional[int] = None) -> list[Evidence]:
        """The event loop's side of the background checks, once per round (``round``: the round just kept):
        :meth:`apply_ended`, then read the evidence published about the kept rounds and queue up to ``max_rechecks``
        re-checks of it. Returns the evidence of this node's failed checks published now."""
        self.now_round = max(self.now_round, int(round))
        out = await self.apply_ended()
        await self.fetch()
        n = 0
        for h, data in list(self._pending.items()):
            if n >= self.cfg.max_rechecks:
                break
            if h in self._queued:
                continue
            opened = self._pending_ev.get(h)
            kind = "recheck"
            if opened is not None and opened.task.kind == SCREEN:
                key = (opened.round, opened.accused)
                if key in self.screen_results:  # measured here already: settled now, no computation
                    outcome = await asyncio.to_thread(self.recheck, data, micro_batch=micro_batch)
                    if outcome != "late":
                        self._forget(h)
                    continue
                if key in self._screen_jobs:  # this node's own screen of it answers this evidence once it ends:
                    self.queue.promote(key)  # run it next, so that the others' verdict is confirmed here soon
                    continue
                kind = "rescreen"
            self._queued.add(h)
            dropped = self.queue.submit(
                CheckJob(self._pending_round.get(h, round), kind, self._recheck_job(data, micro_batch), key=h)
            )
            if dropped is not None and dropped.kind in ("recheck", "rescreen"):
                self._queued.discard(dropped.key)  # queued again on a later call while its round is kept
            n += 1
        return out

    def _forget(self, h: str) -> None:
        """Evidence ``h`` is settled here (re-checked, refused, or its round gone): never read again."""
        self._pending.pop(h, None)
        self._pending_round.pop(h, None)
        self._pending_ev.pop(h, None)
        self._seen.add(h)

    def _recheck_job(self, data: bytes, micro_batch: Optional[int]) -> Callable[[Pacer], str]:
        """The background job of a re-check of ``data`` (:meth:`recheck`, paced)."""

        def run(pace: Pacer) -> str:
            return self.recheck(data, micro_batch=micro_batch, pace=pace)

        return run

    # -- evidence -------------------------------------------------------------------------------------
    def recheck(
        self,
        data: bytes,
        *,
        micro_batch: Optional[int] = None,
        deadline: Optional[float] = None,
        pace: Optional[Pacer] = None,
    ) -> str:
        """Check signed evidence and re-run its computation here (blocking). Returns what came of it:
        ``"confirmed"``, ``"refuted"`` (the accuser is excluded), ``"inconclusive"``, ``"invalid"``,
        ``"unverifiable"`` (this node lacks the round's data), ``"own"`` (about or by this node),
        ``"known"`` (the accused is excluded already), ``"late"`` (past the deadline; retry later).
        Only this node's own measurement counts (its own contribution is its basis, not the accuser's)."""
        try:
            ev = Evidence.open(data, self.run_id)
        except EvidenceError as e:
            log.info("verified work: evidence refused: %s", e)
            return "invalid"
        if self.me in (ev.accused, ev.verifier):
            return "own"
        if ev.accused in self.excluded and ev.accused not in self.lone:
            return "known"  # (one excluded alone is re-checked: the others' evidence may confirm it)
        if ev.task.kind == SCREEN:
            return self._recheck_screen(ev, pace)
        kept = self._kept.get(ev.round)
        if kept is None or kept.plan.start_digest != ev.start_digest:
            return "unverifiable"
        materialize(kept, ev.accused, ev.contributions, self.run_id, ev.round)  # accountable: the evidence's copies
        packets = self._packets(ev.round, kept)
        task = derive_task(
            self.cfg,
            plan=kept.plan,
            verifier=ev.verifier,
            selection=ev.selection,
            packets=packets,
            part_ranges=kept.part_ranges,
        )
        if kept.committed is not None:
            task = narrow(task)
        if task != ev.task:
            log.info(
                "round %d: verified work: evidence of %s against %s is not the check its selection draws; ignored",
                ev.round,
                ev.verifier[:10],
                ev.accused[:10],
            )
            return "invalid"
        mine = packets.get(ev.accused, {})
        if any(
            j not in mine or isinstance(mine[j], Committed) or packet_digest(mine[j]) != h
            for j, h in ev.packets.items()
        ):
            return "unverifiable"
        theta = self.kept_theta(ev.round)
        if theta is None:
            return "unverifiable"
        try:
            stats, verdict, used = self._run(task, packets, theta, micro_batch, deadline, pace, kept)
        except VerifyTimeout:
            return "late"
        c = self.cfg
        if verdict.outcome != PASS:
            self._record(task, verdict, ev.verifier)
            return "confirmed"
        # Refuted: a hard accusation that this node's own measurement passes with a margin no float noise
        # or basis difference explains (marginal claims are never refuted: wrong data reaches 0.59 here).
        if (
            ev.outcome == FAIL
            and stats.plain >= c.plain_min + c.refute_margin
            and (not task.full_test or stats.trace >= c.trace_min + c.refute_margin)
            and c.gain_refutes(stats.gain)  # both its t and its per-batch low (session 50)
        ):
            self._exclude(
                ev.verifier,
                f"its accusation of {ev.accused[:10]} in round {ev.round} does not re-check "
                f"(claimed plain {ev.plain:.3f} trace {ev.trace:.3f}, re-checked "
                f"{stats.plain:.3f} / {stats.trace:.3f})",
                ev.round,
            )
            return "refuted"
        return "inconclusive"

    async def run_round(self, round: int, **options: Unpack[CheckOptions]) -> Optional[Evidence]:
        """This node's check of ``round`` (:meth:`check_round` with ``options``) off the event loop, its
        evidence published, then up to ``max_rechecks`` pending evidence records re-checked (all
        bounded by ``options["deadline"]``, with its ``micro_batch``)."""
        ev = await asyncio.to_thread(self.check_round, round, **options)
        micro_batch, deadline = options.get("micro_batch"), options.get("deadline")
        if ev is not None:
            await self.publish(ev)
        await self.fetch()
        done = 0
        while self._pending and done < self.cfg.max_rechecks:
            if deadline is not None and time.time() > deadline:
                break
            h, data = next(iter(self._pending.items()))
            try:
                outcome = await asyncio.to_thread(self.recheck, data, micro_batch=micro_batch, deadline=deadline)
            except Exception as e:  # noqa: BLE001  one record that got past fetch must not stall the queue
                # (it stayed first in _pending, so no other evidence was ever re-checked again): dropped
                self._log_once(h, logging.WARNING, "round %d: evidence record refused in its re-check: %r", round, e)
                outcome = "refused"
            if outcome == "late":
                break
            self._forget(h)
            done += outcome in ("confirmed", "refuted", "inconclusive")
        return ev
