"""Screening newcomers (issue 28): the loss-gain test alone on every contributor's first rounds, run before the
sampled checks, its evidence re-checked the same way by everyone (:class:`Screening`, a part of
:class:`~geomesh_p2p.trust.verify.WorkVerifier`); and the kept rounds' bookkeeping both share (:class:`Kept`, the
contributions of older kept rounds written to disk: :func:`pack_packets`).

Why. A sampled check (:mod:`geomesh_p2p.trust.verify`) is drawn for ~10% of a peer's compute and paced to 15% of
the wall time, so at small H it concludes ~12 rounds after the round it checked, and a poisoner of 1 of 4 was in
every aggregate until then (docs/security.md, "The backdoor benchmark"). A newcomer is screened instead in each of
its first rounds, by a few peers, at once:

* **Who is screened**: every contributor of the ``screen_rounds`` rounds from ``gain_first_round`` (the loss-gain
  test has no power on a fresh model's first updates: none before), later every contributor a
  plan marks as on probation (:func:`~geomesh_p2p.trust.verify_task.screen_candidates`): the same list at every
  participant. A contributor knows its first rounds are screened and nothing else.
* **By whom**: ``screeners`` participants drawn after the round from a seed over every contribution received
  (:func:`~geomesh_p2p.trust.verify_task.screen_seed`, :func:`~geomesh_p2p.trust.verify_task.screeners_of`).
* **What**: the loss-gain test alone (:func:`~geomesh_p2p.trust.verify_check.screen_contribution`):
  ``gain_assigned`` of the contributor's batches drawn from that seed against ``gain_controls`` control batches,
  forward passes only, with the full check's thresholds (a hard failure below ``gain_t_hard``). The batches and
  rows follow from the seed and the accused alone, so every screener measures the same thing, and a screener's
  own measurement is its re-check of another's evidence (no second computation); a participant that did not
  screen re-checks the evidence by running the same screen.
* **When**: queued as the round is kept, in the background worker's first lane
  (:data:`~geomesh_p2p.trust.verify_queue.FIRST`): before any sampled check or re-check, under the same duty.

An established contributor is screened the same way when the round's seed draws it (session 19, against a patient
attacker: honest while it is new, poisoning after): with the probability that keeps these screens at
``sample_share`` of the participants' compute, by ``sample_screeners`` screeners
(:func:`~geomesh_p2p.trust.verify_task.sampled_candidates`); besides the sampled full checks.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from geomesh_p2p.exchange import codec as compression
from geomesh_p2p.trust.check_model import release_
from geomesh_p2p.trust.evidence import MAX_VALUE_BYTES, Evidence
from geomesh_p2p.trust.gain import welch_t
from geomesh_p2p.trust.gain_stages import can_stage
from geomesh_p2p.trust.verify_check import (
    FAIL,
    PASS,
    Verdict,
    VerifyTimeout,
    WorkStats,
    _rows_of,
    packet_digest,
    screen_contribution,
)
from geomesh_p2p.trust.verify_commit import Committed, commitment_seed, materialize, narrow
from geomesh_p2p.trust.verify_queue import CheckJob, Pacer
from geomesh_p2p.trust.verify_task import VerifyTask, derive_screen, gain_order, sampled_candidates, screen_seed

log = logging.getLogger("geomesh_p2p.trust.verify")

__all__ = ["Kept", "Prepared", "Measured", "Screening", "pack_packets", "unpack_packets"]


#: Own screening results remembered (round, accused) -> (stats, verdict): what answers others' evidence.
MAX_SCREEN_RESULTS = 256


@dataclass
class Kept:
    """A kept round: its plan, part ranges and received contributions (``packets``: in memory for the newest
    ``keep_rounds``; None once written beside the start weights, read back by ``WorkVerifier._packets``), the
    contributors screened in it, its screening seed once computed and the control losses its gain tests share."""

    plan: Any
    part_ranges: list[tuple[int, int]]
    packets: Optional[dict[str, dict[int, Any]]]
    screened: list[str] = field(default_factory=list)
    seed: Optional[bytes] = None
    controls: dict = field(default_factory=dict)
    #: accountable mode: sender -> part -> Committed (every part result's inputs; ``packets`` then holds only this
    #: peer's own and fetched contributions: :mod:`.verify_commit`); None in relay mode
    committed: Optional[dict] = None


@dataclass
class Prepared:
    """This node's check of ``round`` as drawn, with the accused's signed contributions (part -> bytes)."""

    round: int
    kept: Kept
    task: VerifyTask
    signed: dict[int, bytes]


@dataclass
class Measured:
    """A check's measurement, not applied yet (``WorkVerifier._conclude``); ``evidence``: None when it passed."""

    round: int
    task: VerifyTask
    stats: WorkStats
    verdict: Verdict
    evidence: Optional[Evidence]


def pack_packets(packets: Mapping[str, Mapping[int, Any]]) -> bytes:
    """The contributions of a kept round as one blob: per sender (sorted) and part (sorted), ``u16`` length and the
    sender's UTF-8 id, ``u32`` part, ``u64`` length and the packet's bytes (``to_bytes``). Packets without a byte
    form are left out (none in practice: every codec packet has one)."""
    out = []
    for sender in sorted(packets):
        s = sender.encode()
        for j in sorted(packets[sender]):
            p = packets[sender][j]
            if not hasattr(p, "to_bytes"):
                continue
            b = p.to_bytes()
            out.append(struct.pack("<H", len(s)) + s + struct.pack("<IQ", int(j), len(b)) + b)
    return b"".join(out)


def unpack_packets(blob: bytes) -> dict[str, dict[int, Any]]:
    """The contributions :func:`pack_packets` wrote (this node's own file). Raises ValueError when truncated."""
    out: dict[str, dict[int, Any]] = {}
    mv, i = memoryview(blob), 0
    while i < len(blob):
        if i + 2 > len(blob):
            raise ValueError("kept contributions: truncated file")
        (n,) = struct.unpack_from("<H", mv, i)
        sender = bytes(mv[i + 2 : i + 2 + n]).decode()
        i += 2 + n
        if i + 12 > len(blob):
            raise ValueError("kept contributions: truncated file")
        j, m = struct.unpack_from("<IQ", mv, i)
        i += 12
        if i + m > len(blob):
            raise ValueError("kept contributions: truncated file")
        out.setdefault(sender, {})[int(j)] = compression.packet_from_bytes(bytes(mv[i : i + m]))
        i += m
    return out


#: The probe t an unmeasured screen is ordered by (:func:`probe_order`): a neutral place, not the last one.
UNMEASURED_PROBE_T = 0.0


def probe_order(accused: Sequence[str], ts: Mapping[str, float]) -> list[str]:
    """The order a round's screens run in (``accused``: their PeerIDs in drawn order; ``ts``: the probe t of those
    measured, :meth:`Screening.probe_ts`): lowest t first, stable among equals; one without a probe t (too few steps to
    stage, settled, a part not held) ranks as t :data:`UNMEASURED_PROBE_T`, after those the probe suspects (t < 0) and
    before those it clears. Why not last (session 47's combined runs, run p4): a poisoner that trained 7 steps could
    not be staged, so its screen ran after the probe and both honest screens at all three screeners (4.6-6.4 s
    queued), and its verdict came a round later: an unmeasured screen is no more likely honest than a measured one."""
    return sorted(accused, key=lambda a: ts.get(a, UNMEASURED_PROBE_T))


class Screening:
    """The screening side of :class:`~geomesh_p2p.trust.verify.WorkVerifier` (see the module docstring). Uses the
    verifier's ``cfg``, ``me``, ``queue``, ``_kept``, ``_weights``, ``_compute``, ``_packets``, ``selection``,
    ``_record``, ``_exclude`` and the model, dataset and optimizer settings."""

    cfg: Any
    me: str
    run_id: str
    queue: Any
    _kept: "OrderedDict[int, Kept]"
    _weights: Any
    _compute: Any
    model: Any
    dataset: Any
    seed: int
    lr: float
    weight_decay: float
    _packets: Callable[[int, Kept], dict]
    selection: Callable[[int, Optional[str]], bytes]
    _record: Callable[..., None]
    settled: Callable[[str], bool]
    _exclude: Callable[..., None]

    def _init_screening(self) -> None:
        #: (round, accused) -> (stats, verdict) of the screens measured here (own, or re-checks of others')
        self.screen_results: "OrderedDict[tuple[int, str], tuple[WorkStats, Verdict]]" = OrderedDict()
        self._screen_jobs: set[tuple[int, str]] = set()  # own screens queued or running

    def _seed_of(self, round: int, kept: Kept, packets: Mapping[str, Mapping[int, Any]]) -> bytes:
        if kept.seed is None:  # accountable mode: from the committed input hashes every participant holds
            c = kept.committed
            kept.seed = (
                screen_seed(self.run_id, kept.plan, packets)
                if c is None
                else commitment_seed(self.run_id, kept.plan, c)
            )
        return kept.seed

    def queue_screens(
        self,
        round: int,
        *,
        due: Optional[float] = None,
        signed_of: Optional[Callable[[int, str], Optional[bytes]]] = None,
    ) -> int:
        """Queue this node's screening checks of kept round ``round`` (every newcomer it is a screener of) in the
        background worker's first lane, in an order drawn from its selection signature (nobody else can tell
        which newcomer it screens first), with the accused's signed contributions taken now from
        ``signed_of(part, sender)``. Two or more staged screens are preceded by their probe, which reorders them
        (:meth:`probe_ts`, session 47). Blocking (hashes the round's contributions): off the event loop. Returns the
        number of screens queued."""
        kept = self._kept.get(int(round))
        if kept is None:
            return 0
        if not kept.screened and not self._sampling(round):
            return 0
        packets = self._packets(round, kept)
        seed = self._seed_of(round, kept, packets)
        tasks = []
        for accused in self.screen_targets(round, kept, packets, seed):
            if self.settled(accused):  # excluded here on more than its own measurement: a screen changes nothing
                continue
            t = derive_screen(
                self.cfg,
                plan=kept.plan,
                verifier=self.me,
                accused=accused,
                seed=seed,
                packets=packets,
                part_ranges=kept.part_ranges,
            )
            if t is not None:
                tasks.append(narrow(t) if kept.committed is not None else t)
        sel = self.selection(round, kept.plan.start_digest)
        tasks.sort(key=lambda t: hashlib.sha256(sel + t.accused.encode()).digest())
        preps = []
        for task in tasks:
            if any(isinstance(packets.get(task.accused, {}).get(j), Committed) for j in task.parts):
                log.info(  # accountable mode: its contribution was not fetched (refused, withheld): nothing to run
                    "round %d: screening of %s not run: its contribution is not held here", round, task.accused[:10]
                )
                continue
            signed = {}
            for j in task.parts:
                b = signed_of(j, task.accused) if signed_of is not None else None
                if b and len(b) <= MAX_VALUE_BYTES:
                    signed[j] = b
            preps.append(Prepared(int(round), kept, task, signed))
        if len(preps) > 1 and self.cfg.gain_staged:  # the probe orders them, lowest t first (session 47)
            self.queue.submit(CheckJob(int(round), "probe", self._probe_job(preps), key=("probe", int(round)), due=due))
        for prep in preps:
            key = (int(round), prep.task.accused)
            self._screen_jobs.add(key)
            self.queue.submit(CheckJob(int(round), "screen", self._screen_job(prep), key=key, due=due))
        return len(preps)

    def _probe_job(self, preps: list[Prepared]) -> Callable[[Pacer], None]:
        """The background job that orders a round's screens (queued before them; :meth:`probe_ts`, then
        :meth:`~geomesh_p2p.trust.verify_queue.CheckQueue.reorder`: lowest probe t first, the unmeasured last in
        their drawn order)."""

        def run(pace: Pacer) -> None:
            ts = self.probe_ts(preps, pace)
            accused = probe_order([p.task.accused for p in preps], ts)
            log.info(  # the probe's t is the same at every screener (the same rows): a misorder is everyone's
                "round %d: screens ordered by their probes: %s",
                preps[0].round,
                ", ".join(f"{a[:10]} t " + (f"{ts[a]:.2f}" if a in ts else "unmeasured") for a in accused),
            )
            self.queue.reorder([(preps[0].round, a) for a in accused])

        return run

    def probe_ts(self, preps: list[Prepared], pace: Optional[Pacer] = None) -> dict[str, float]:
        """Session 47: a round's screens ran in an order drawn from this node's selection signature, so the poisoner's
        waited behind 0-2 honest screens (each ~1-3 s of a loaded 2-core box, a round or more of its verdict). Each
        staged screen's **probe** is the first batch of its drawn order against the first 2 controls: 2 + 2 forward
        passes (2 more for the round's first controls), rows its first stage then reuses from the round's cache (the
        same rows, so the same statistic and verdict to the bit: :func:`~.gain.cached_gain_rows`). Accused -> the
        probe's t (8 rows against 16); a task not staged, settled or failing to measure has none. Who gets which
        place only decides when each verdict comes, never what it is: every screen still runs; a contribution that
        did not train on its batches shows no gain on the first either (it cannot know which batch that is)."""
        c = self.cfg
        if not preps:
            return {}
        theta = self._weights.get(preps[0].round)
        if theta is None:
            return {}
        kept = preps[0].kept
        packets = self._packets(preps[0].round, kept)
        rows = _rows_of(
            c, self.model, self.dataset, theta, seed=self.seed, deadline=None, pace=pace, cache=kept.controls
        )
        out: dict[str, float] = {}
        with self._compute:
            if pace is not None:
                pace.start()
            try:
                for prep in preps:
                    task = prep.task
                    order = gain_order(task, c.gain_assigned)
                    if self.settled(task.accused) or not can_stage(len(order), c.gain_controls):
                        continue
                    try:
                        got, _ = rows(task, packets[task.accused], [order[0]], [0, 1])
                    except (KeyError, ValueError, VerifyTimeout):  # a part not held: the screen says why
                        continue
                    out[task.accused] = welch_t(got[0], got[1] + got[2])  # row-level, as the test's t
            finally:
                release_(self.model)
        return out

    def _sampling(self, round: int) -> bool:
        """Whether kept round ``round`` draws established contributors for sampled screens."""
        return self.cfg.sample_share > 0 and int(round) >= self.cfg.gain_first_round

    def screen_targets(
        self, round: int, kept: Kept, packets: Mapping[str, Mapping[int, Any]], seed: bytes
    ) -> list[str]:
        """The contributors screened in kept round ``round``: its newcomers and the established contributors its
        seed draws for a sampled screen (:func:`~geomesh_p2p.trust.verify_task.sampled_candidates`), added to
        ``kept.screened`` (their evidence is read too: :meth:`fetch`). Sorted PeerIDs; this node is a screener of
        some of them only (:func:`~geomesh_p2p.trust.verify_task.derive_screen` says which).

        Why one list for both callers (session 31): accountable mode fetches the contributions its screens need
        before it queues them (:meth:`accountable_wants`), and drew the sampled ones only when queueing, so a
        sampled screen in accountable mode never had its contribution ("not run: its contribution is not held
        here", every one of them in the backdoor benchmark): the patient poisoner went unscreened."""
        if self._sampling(round):
            kept.screened = sorted(set(kept.screened) | set(sampled_candidates(self.cfg, kept.plan, packets, seed)))
        return list(kept.screened)

    def _screen_job(self, prep: Prepared) -> Callable[[Pacer], Optional[Measured]]:
        """The background job of screen ``prep`` (:meth:`_measure_screen`, paced)."""

        def run(pace: Pacer) -> Optional[Measured]:
            return self._measure_screen(prep, pace)

        return run

    def _screen_result(
        self, task: VerifyTask, kept: Kept, theta: torch.Tensor, packets, pace: Optional[Pacer]
    ) -> tuple[WorkStats, Verdict]:
        """The screen of ``(task.round, task.accused)`` measured here: remembered, else run now (blocking, heavy).
        The same for every screener's task of it (the verifier does not enter the computation)."""
        key = (task.round, task.accused)
        got = self.screen_results.get(key)
        if got is not None:
            return got
        with self._compute:
            if pace is not None:
                pace.start()  # the wait for the device (another check) is not this screen's compute
            try:
                got = screen_contribution(
                    self.cfg,
                    task,
                    model=self.model,
                    dataset=self.dataset,
                    theta=theta,
                    seed=self.seed,
                    packets=packets,
                    lr=self.lr,
                    weight_decay=self.weight_decay,
                    pace=pace,
                    cache=kept.controls,
                    plan=kept.plan,
                    checker=self.me,
                )
            finally:
                release_(self.model)  # a hollow model holds no weights between checks (issue 27)
        self.screen_results[key] = got
        while len(self.screen_results) > MAX_SCREEN_RESULTS:
            self.screen_results.popitem(last=False)
        return got

    def _measure_screen(self, prep: Prepared, pace: Optional[Pacer] = None) -> Optional[Measured]:
        """Run a prepared screen (the background job). None when its round's weights are gone or memory ran out
        at one row; the evidence of a failure is built here, applied by ``_conclude``."""
        if self.settled(prep.task.accused):  # confirmed while the job waited: its budget goes to the others
            log.debug("round %d: screening of %s not run: excluded here already", prep.round, prep.task.accused[:10])
            return None
        theta = self._weights.get(prep.round)
        if theta is None:
            log.info(
                "round %d: screening of %s not run: the round's kept weights are gone",
                prep.round,
                prep.task.accused[:10],
            )
            return None
        packets = self._packets(prep.round, prep.kept)
        try:
            stats, verdict = self._screen_result(prep.task, prep.kept, theta, packets, pace)
        except (VerifyTimeout, MemoryError) as e:
            log.info("round %d: screening of %s abandoned: %s", prep.round, prep.task.accused[:10], e)
            return None
        ev = None
        if verdict.outcome != PASS:
            mine = packets[prep.task.accused]
            ev = Evidence(
                run_id=self.run_id,
                round=prep.round,
                verifier=self.me,
                accused=prep.task.accused,
                start_digest=prep.kept.plan.start_digest,
                selection=self.selection(prep.round, prep.kept.plan.start_digest),
                task=prep.task,
                packets={j: packet_digest(mine[j]) for j in prep.task.parts},
                basis=[],
                plain=0.0,
                trace=0.0,
                outcome=verdict.outcome,
                reason=verdict.reason,
                contributions=prep.signed,
            )
        return Measured(prep.round, prep.task, stats, verdict, ev)

    def _recheck_screen(self, ev: Evidence, pace: Optional[Pacer] = None) -> str:
        """``WorkVerifier.recheck`` of screening evidence: the task must be the one the round's plan and
        contributions draw for that screener; the measurement is this node's own screen of the same newcomer in
        the same round (remembered, else run now). Returns "confirmed", "refuted" (the accuser is excluded: a
        hard accusation this node's t passes by ``gain_refute_margin``), "inconclusive", "invalid" or
        "unverifiable"."""
        kept = self._kept.get(ev.round)
        if kept is None or kept.plan.start_digest != ev.start_digest:
            return "unverifiable"
        materialize(kept, ev.accused, ev.contributions, self.run_id, ev.round)  # accountable: the evidence's copies
        packets = self._packets(ev.round, kept)
        task = derive_screen(
            self.cfg,
            plan=kept.plan,
            verifier=ev.verifier,
            accused=ev.accused,
            seed=self._seed_of(ev.round, kept, packets),
            packets=packets,
            part_ranges=kept.part_ranges,
        )
        if kept.committed is not None:
            task = narrow(task)
        if task != ev.task:
            log.info(
                "round %d: screening evidence of %s against %s is not a screen the round draws; ignored",
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
        theta = self._weights.get(ev.round)
        if theta is None:
            return "unverifiable"
        try:
            stats, verdict = self._screen_result(task, kept, theta, packets, pace)
        except (VerifyTimeout, MemoryError):
            return "late"
        if verdict.outcome != PASS:
            self._record(task, verdict, ev.verifier)
            return "confirmed"
        c = self.cfg
        if ev.outcome == FAIL and stats.gain is not None and c.gain_refutes(stats.gain):
            self._exclude(
                ev.verifier,
                f"its screening accusation of {ev.accused[:10]} in round {ev.round} does not re-check "
                f"(re-checked: gain t {stats.gain.t:.2f})",
                ev.round,
            )
            return "refuted"
        return "inconclusive"
