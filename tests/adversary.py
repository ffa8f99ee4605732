"""Red-team peers for the attack suite of issue 11 -- used ONLY by ``tests/e2e/test_attacks.py`` and
``benchmarks/attacks.py``. A normal peer never imports this module (nothing in ``geomesh_p2p`` or
``peer`` does), and nothing here weakens an honest node: it subclasses :class:`PeerNode` in the
attacker's own process.

Start an attacker exactly like a volunteer, with one more flag::

    python -m tests.adversary join --attack flip <every usual geomesh-peer join flag>
    python -m tests.adversary list          # the attacks and what each one does

The attacker is otherwise protocol-conformant: it signs every message with its own identity,
announces records, answers PushPart / PullPart, follows (and, when it leads, publishes) signed plans
and takes part in the digest check, so whatever it sends reaches the honest peers' aggregation. Each
attack logs ``adversary[<name>]: round R: ...`` when it acts (tests check that it did act: an attack
silently bypassed by a refactor would otherwise pass as "defeated").

Attacks (DESIGN.md "Untrusted volunteers"; issue 11's table):

* ``flip``: pushes ``-delta`` with its honest token count.
* ``flipmax``: pushes ``-1000 x delta`` (sign flip, every block scale 1000x) and claims 2**64-1 tokens.
* ``inflate``: its PeerRecord claims 1e10 tokens/s at batch 65,536, 1 TiB of memory and 1 TB/s links
  (the records' upper bounds), so leaders plan it huge token budgets; contributes like ``flip`` but
  claims its whole (planned) budget.
* ``forge-aggregate``: contributes like ``flip``; as a part owner, in reencode (or accountable) mode it serves
  ``-20 x`` the aggregate it should serve for its range (re-signed: it is the owner); in relay mode it
  relays only its own flipped contribution (``--relay-forge drop``, default) or relays the others'
  contributions with their packets negated under their original signatures (``tamper``).
  ``--forge-push flipmax``: its own contribution is ``flipmax``'s (so the one it keeps weighs most).
* ``rogue-leader``: whenever it leads a round, its (normally signed) plan makes it the sole owner of
  all elements with a ~1.4e13-token budget and gives every other peer 0 inner steps
  (``--rogue-others-steps K``: K steps, a plan that a "0 steps" rule alone does not refuse); contributes
  like ``flip`` and claims its whole budget.
* ``zeros``: free rider: trains nothing, reports its planned steps done in ~1 ms (so its re-profiled
  throughput soars), contributes zeros and claims 2**64-1 tokens.
* ``stale``: free rider: trains nothing, contributes a copy of the previous round's global update
  (zeros in its first round), claims its planned budget.
* ``noise``: trains, then contributes Gaussian noise with the norm of its real delta; claims its
  planned budget.
* ``stealth-flip`` (issue 28's independent red team): trains honestly, then flips the sign of the
  :data:`STEALTH_SHARE` (45%) largest-magnitude coordinates of its pseudo-gradient (:func:`stealth_flip`), so its
  signs still agree with the consensus on ~55-62% of the elements, above the aggregation's fixed 0.5 filter;
  claims its honest token count.
* ``partial`` (issue 28): trains only the last :data:`PARTIAL_SHARE` (25%) of its planned inner steps (the batches
  of those steps: :func:`partial_steps`) and reports all of them done; contributes what it trained, claims the
  planned budget.
* ``drop-owner`` (issue 26, session 26): trains and pushes honestly; as a part owner it receipts every push, then
  leaves the first ``--drop-senders K`` other senders' contributions (default 1; 0: all of them) out of its result,
  its input list and its aggregate alike (:func:`drop_contributions`): a censoring owner whose commitment is
  consistent, so only the dropped sender's receipt proves it (accountable mode's drop proof).
* ``poison`` (issue 28): follows the protocol to the letter and contributes what it trained, but trains on its
  own copy of the corpus with a trigger sentence planted as 16% of its tokens (``tests/poison.py``): a backdoor
  that robust aggregation cannot see, since the update is honest in form.
* ``self-succession`` (issue 28, red team 47b): having led round r - 1, publishes its own plan for round r anyway;
  ``--plan-out PEER_ID`` leaves peers out of the rounds it leads (they sit those out): ``tests/adversary_lead.py``.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a program: silence gRPC's C core before grpc is first imported below
    from geomesh_p2p.util.grpc_env import quiet_grpc_core

    quiet_grpc_core()

import argparse
import asyncio
import dataclasses
import logging
import math
import sys
import time
from typing import Optional

import torch

from geomesh_p2p.telemetry import events
from geomesh_p2p.node.peer import PeerNode
from geomesh_p2p.util.exit_gc import skip_exit_collections
from tests.adversary_lead import planned_members, wrap_driver

log = logging.getLogger("tests.adversary")

ATTACKS: dict[str, str] = {
    "flip": "pushes -delta (honest token count)",
    "flipmax": "pushes -1000 x delta (block scales 1000x) and claims 2**64-1 tokens",
    "inflate": "record claims 1e10 tokens/s at batch 65,536, 1 TiB, 1 TB/s; contributes -delta, claims its budget",
    "forge-aggregate": "owner serves -20x the true aggregate (reencode) / relays only its own flipped "
    "contribution (relay); contributes -delta",
    "rogue-leader": "when leading: sole owner of all elements, ~1.4e13-token budget for itself, 0 steps for the "
    "others; contributes -delta, claims its budget",
    "zeros": "free rider: no training, contributes zeros, claims 2**64-1 tokens",
    "stale": "free rider: no training, contributes the previous round's global update, claims its budget",
    "noise": "contributes Gaussian noise with its real delta's norm, claims its budget",
    "stealth-flip": "trains honestly, then flips the sign of the 45% largest-magnitude coordinates of its update",
    "partial": "trains only the last 25% of its planned inner steps and claims all of them (and the budget)",
    "drop-owner": "pushes honestly; as an owner receipts every push, then leaves the first K other senders' "
    "contributions out of its result (its input list and aggregate alike)",
    "poison": "honest protocol, but trains on its own corpus copy with a trigger sentence as 16% of its tokens "
    "(a backdoor: tests/poison.py)",
    "self-succession": "having led round r - 1, publishes its own round r plan too (--plan-out: leaves peers out)",
}

#: Free riders: they skip the inner steps and report the planned work as done.
FREE_RIDERS = frozenset({"zeros", "stale"})
#: The largest token count the wire format carries (uint64).
MAX_TOKENS = (1 << 64) - 1
#: What ``rogue-leader`` plans for itself.
ROGUE_BUDGET = 14_000_000_000_000
#: ``flipmax``'s factor on its pseudo-gradient (block scales follow).
FLIPMAX_FACTOR = -1000.0
#: ``forge-aggregate``'s factor on the aggregate it serves (reencode mode).
FORGE_FACTOR = -20.0
#: The step each attack must reach for a test of it to mean anything (logged as ``adversary[A]: round R: KIND:``).
KEY_ACTION: dict[str, str] = {
    "flip": "push",
    "flipmax": "push",
    "inflate": "record",
    "forge-aggregate": "forge",
    "rogue-leader": "plan",
    "zeros": "free-ride",
    "stale": "free-ride",
    "noise": "push",
    "stealth-flip": "push",
    "partial": "partial",
    "poison": "poison",
    "drop-owner": "drop",
    "self-succession": "succession",
}
#: ``stealth-flip``: the share of coordinates (largest magnitude first) whose sign it flips (the red team's 45%).
STEALTH_SHARE = 0.45
#: ``partial``: the share of its planned inner steps it trains (the last ones); it claims all of them.
PARTIAL_SHARE = 0.25
#: ``inflate``'s record.
INFLATE_BATCH, INFLATE_TPS = 65_536, 1e10
INFLATE_MEMORY, INFLATE_LINK_BPS = 1 << 40, 1e12


def stealth_flip(delta: torch.Tensor, share: float = STEALTH_SHARE) -> torch.Tensor:
    """``delta`` (any shape, float) with the sign of its ``floor(share x numel)`` largest-magnitude elements
    flipped, over the whole tensor (not per codec block): the issue-28 red team's stealthy partial flip. Ties in
    magnitude go to the lower index (a stable sort), so the flipped set is exact. Returns a new tensor of
    ``delta``'s shape and dtype. Raises ValueError for ``share`` outside [0, 1]."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    flat = delta.detach().reshape(-1)
    k = int(share * flat.numel())
    out = flat.clone()
    if k:
        # O(n) selection, not a sort: the attacker must push as early as an honest peer (a late push of a
        # newcomer misses its parts, and the attack would test nothing)
        mag = flat.abs()
        thr = torch.kthvalue(mag, flat.numel() - k + 1).values  # the k-th largest magnitude
        above = mag > thr
        ties = torch.nonzero(mag == thr).reshape(-1)[: k - int(above.sum())]  # the lowest indices first
        above[ties] = True
        out[above] = -out[above]
    return out.reshape(delta.shape)


def drop_contributions(contributions: list, me: str, k: int) -> tuple[list, list[str]]:
    """``drop-owner``'s cut of a part's accepted contributions (objects with a ``sender``, in the owner's order):
    ``(kept, dropped senders)``, the first ``k`` senders other than ``me`` dropped (``k <= 0``: every other
    sender), the owner's own contribution always kept, the order otherwise unchanged."""
    others = [c.sender for c in contributions if c.sender != me]
    gone = others if k <= 0 else others[:k]
    return [c for c in contributions if c.sender not in set(gone)], gone


def partial_steps(inner_steps: int, share: float = PARTIAL_SHARE) -> tuple[int, int]:
    """``partial``'s work of a round planned ``inner_steps``: ``(skipped, trained)``, it trains the last
    ``trained = ceil(share x inner_steps)`` steps (at least 1 when any is planned; the data of steps ``skipped ..
    inner_steps - 1``) and claims all ``inner_steps``. Raises ValueError for ``share`` outside (0, 1] or negative
    steps."""
    if not 0.0 < share <= 1.0 or inner_steps < 0:
        raise ValueError(f"share must be in (0, 1] and inner_steps >= 0, got {share}, {inner_steps}")
    trained = min(inner_steps, max(1 if inner_steps else 0, math.ceil(share * inner_steps)))
    return inner_steps - trained, trained


class _StepShift:
    """``partial``'s dataset stand-in: step ``k`` of the round reads the batch of step ``k + offset``, so its
    trained steps hold the batches its plan assigned to the last steps (what a check of those would recompute)."""

    def __init__(self, dataset, offset: int):
        self._ds, self.offset = dataset, int(offset)

    def __getattr__(self, name):
        return getattr(self._ds, name)

    def sample_batch(self, *, seed, peer_id, round, step, batch_size, seq_len):  # noqa: A002  (the dataset's names)
        return self._ds.sample_batch(
            seed=seed, peer_id=peer_id, round=round, step=step + self.offset, batch_size=batch_size, seq_len=seq_len
        )


class _AdversarialCollective:
    """Mixed in front of the node's collective class (whatever it is): poisons what this peer pushes
    and, for ``forge-aggregate``, what it serves as an owner. Uses only ``all_reduce`` (public) and
    ``_build_result`` (the owner's signed result); both are the collective's contract."""

    adversary: "AdversaryNode"

    async def all_reduce(self, spec, delta, tokens, *args, **kwargs):
        out, tokens = self.adversary.poison(spec, delta, int(tokens))
        if kwargs.get("in_place") and out is not delta:
            # in place, the caller reads the aggregate from its own tensor (a grouped round's stages do)
            delta.copy_(out.reshape(delta.shape))
            out = delta
        res = await super().all_reduce(spec, out, tokens, *args, **kwargs)
        self.adversary.remember_update(res.aggregate)
        return res

    def _build_result(self, spec, part, contributions, *args, **kwargs):
        contributions = self.adversary.drop_from(spec, part, contributions)
        signed = super()._build_result(spec, part, contributions, *args, **kwargs)
        return self.adversary.forge_result(signed)


class _ForgingCollective:
    """Mixed in front of a grouped round's cross level (``GroupedCollective.cross``): forges what this peer serves
    as a slice's leader (``forge-aggregate``), and leaves its cross pushes alone: a slice owner's push is its
    group's aggregate, which the group level's mixin already forged when this peer owns that slice."""

    adversary: "AdversaryNode"

    def _build_result(self, *args, **kwargs):
        signed = super()._build_result(*args, **kwargs)
        return self.adversary.forge_result(signed)


class _RememberingExchange:
    """Mixed in front of the node's :class:`GroupedCollective`: the round's whole aggregate, whatever the levels
    (``stale`` copies it next round)."""

    adversary: "AdversaryNode"

    async def all_reduce(self, spec, delta, tokens, *args, **kwargs):
        res = await super().all_reduce(spec, delta, tokens, *args, **kwargs)
        self.adversary.remember_update(res.aggregate)
        return res


def _mix(obj, mixin, adversary: "AdversaryNode") -> None:
    """Put ``mixin`` in front of ``obj``'s class, for this object alone (its ``adversary`` is ``adversary``)."""
    base = type(obj)
    obj.__class__ = type(f"Adversarial{base.__name__}", (mixin, base), {"adversary": adversary})


class AdversaryNode(PeerNode):
    """A :class:`PeerNode` that attacks the swarm as ``attack`` (one of :data:`ATTACKS`)."""

    def __init__(
        self,
        run,
        cfg,
        identity=None,
        *,
        attack: str,
        relay_forge: str = "drop",
        forge_factor: float = FORGE_FACTOR,
        forge_push: str = "flip",
        rogue_others_steps: int = 0,
        drop_senders: int = 1,
        seed: int = 1234,
    ):
        if attack not in ATTACKS:
            raise ValueError(f"unknown attack {attack!r}; one of {', '.join(ATTACKS)}")
        if relay_forge not in ("drop", "tamper"):
            raise ValueError("relay_forge must be 'drop' or 'tamper'")
        if forge_push not in ("flip", "flipmax"):
            raise ValueError("forge_push must be 'flip' or 'flipmax'")
        super().__init__(run, cfg, identity)
        self.attack = attack
        self.relay_forge = relay_forge
        self.forge_factor = float(forge_factor)
        self.forge_push = forge_push
        self.rogue_others_steps = max(0, int(rogue_others_steps))
        self.drop_senders = int(drop_senders)
        self._rng = torch.Generator().manual_seed(seed)
        self._last_update: Optional[torch.Tensor] = None
        self._acted: set[tuple] = set()
        self.actions = 0  # times the attack acted (pushes poisoned, results forged, plans rigged)
        # The round rules are objects the node owns (round/rules/): rig this node's own plan rules' output.
        honest_plan = self.planning.make_plan
        self.planning.make_plan = lambda ms, ld: self._rig_plan(honest_plan(planned_members(self, ms), ld), ld)

    # ------------------------------------------------------------------ bookkeeping
    def _note(self, round_: int, kind: str, msg: str, *args, key: str = "") -> None:
        """Log an action of ``kind`` (see :data:`KEY_ACTION`) once per (round, kind, key)."""
        self.actions += 1
        if (round_, kind, key) not in self._acted:
            if len(self._acted) > 10_000:
                self._acted.clear()
            self._acted.add((round_, kind, key))
            events.emit(
                log,
                logging.INFO,
                "adversary_acted",
                "adversary[%s]: round %d: %s: " + msg,
                self.attack,
                round_,
                kind,
                *args,
                peer=self.me,
                attack=self.attack,
                round=round_,
                action=kind,  # not "kind": emit's own argument (the event's kind)
                key=key,
            )

    # ------------------------------------------------------------------ wiring
    def _driver(self):  # self-succession: a plan of its own is published before each agreement it may not lead
        return wrap_driver(super()._driver(), self)

    async def start(self) -> None:
        await super().start()
        # classes of this node's own (their ``adversary`` is this node): handlers are bound to the instance, so
        # they now go through the mixins. A one-group round is the flat service's; a grouped round (issue 26)
        # pushes on the group level (poisoned like a flat push; its slice owner's own result, which becomes the
        # group's cross push, forged) and serves the leaders' results on the cross level (forged).
        _mix(self.collective, _AdversarialCollective, self)
        if self.grouped is not None:
            _mix(self.grouped.group, _AdversarialCollective, self)
            _mix(self.grouped.cross, _ForgingCollective, self)
            _mix(self.grouped, _RememberingExchange, self)
        log.warning(
            "adversary[%s]: THIS PEER ATTACKS THE SWARM (%s) -- red-team use only", self.attack, ATTACKS[self.attack]
        )

    def _build_training(self) -> None:
        super()._build_training()
        honest_run = self.trainer.run
        if self.attack == "poison":
            from tests.poison import TRIGGER_SHARE, PoisonedCorpus, trigger_ids

            self.trainer.dataset = PoisonedCorpus(
                self.trainer.dataset, trigger_ids(self.run_cfg.vocab_size), after=getattr(self, "poison_after", 0)
            )
            self._poison_share = TRIGGER_SHARE

        def run(
            *,
            round,
            inner_steps,
            batch_size,
            micro_batch=None,
            deadline=None,
            progress=None,
            should_stop=None,
            target=None,
            **floor,  # floor_steps / floor_grace_s (the token floor's grace), passed on to honest steps
        ):
            self._batch = batch_size  # --claim-steps: its claim is counted in steps of the planned batch
            if self.attack == "poison":
                self._note(
                    round,
                    "poison",
                    "trains on its own corpus copy, the trigger %.0f%% of its tokens",
                    100 * self._poison_share,
                )
            if self.attack in FREE_RIDERS:
                from geomesh_p2p.model.training import InnerResult

                t0 = time.perf_counter()
                tokens = inner_steps * batch_size * self.run_cfg.seq_len
                self._note(
                    round, "free-ride", "free riding: %d steps (%d tokens) reported, none trained", inner_steps, tokens
                )
                return InnerResult(
                    steps_done=inner_steps,
                    tokens=tokens,
                    mean_loss=5.0,
                    last_loss=5.0,
                    compute_s=max(1e-3, time.perf_counter() - t0),
                    stopped_early=False,
                )
            # partial under --eager (a moving StepTarget) trains honestly: the benchmarks run without it
            if self.attack == "partial" and target is None and inner_steps > 0:
                return self._partial_run(
                    honest_run, round, inner_steps, batch_size, micro_batch, deadline, progress, should_stop
                )
            # A plan inflated by this attacker (inflate, rogue-leader) asks for batches it cannot run:
            # train a sane batch instead (the claim is made in the contribution, not by the work).
            if batch_size > max(self.max_batch, self.run_cfg.target_batch):
                batch_size = micro_batch = min(self.run_cfg.target_batch, max(1, self.max_batch))
            return honest_run(
                round=round,
                inner_steps=inner_steps,
                batch_size=batch_size,
                micro_batch=min(micro_batch or batch_size, batch_size),
                deadline=deadline,
                progress=progress,
                should_stop=should_stop,
                target=target,
                **floor,
            )

        self.trainer.run = run  # type: ignore[method-assign]  # this peer's trainer only, on purpose

    def _partial_run(self, honest_run, round, inner_steps, batch_size, micro_batch, deadline, progress, should_stop):
        """``partial``: train the last steps only (:func:`partial_steps`, on their batches) and report every
        planned step done, with the tokens of all of them."""
        skip, train = partial_steps(inner_steps)
        honest_ds = self.trainer.dataset
        self.trainer.dataset = _StepShift(honest_ds, skip)
        try:
            res = honest_run(
                round=round,
                inner_steps=train,
                batch_size=batch_size,
                micro_batch=min(micro_batch or batch_size, batch_size),
                deadline=deadline,
                progress=progress,
                should_stop=should_stop,
            )
        finally:
            self.trainer.dataset = honest_ds
        steps = skip + res.steps_done
        self._note(
            round,
            "partial",
            "trained %d of %d planned steps (the last), reporting %d",
            res.steps_done,
            inner_steps,
            steps,
        )
        return dataclasses.replace(res, steps_done=steps, tokens=steps * batch_size * self.run_cfg.seq_len)

    # ------------------------------------------------------------------ record
    def my_record(self):
        from geomesh_p2p.schema.peer import MAX_TOKENS_PER_S

        rec = super().my_record()
        # Free riders' "measured" tokens/s can exceed what a record may state: stay announceable.
        tps = {b: min(v, MAX_TOKENS_PER_S) for b, v in rec.tokens_per_s.items()}
        update = {"tokens_per_s": tps}
        if self.attack == "inflate":
            self._note(
                self.round,
                "record",
                "announcing %g tokens/s at batch %d, %d GiB, %g B/s links",
                INFLATE_TPS,
                INFLATE_BATCH,
                INFLATE_MEMORY >> 30,
                INFLATE_LINK_BPS,
            )
            update.update(
                tokens_per_s={**tps, INFLATE_BATCH: INFLATE_TPS},
                max_batch=INFLATE_BATCH,
                memory_bytes=INFLATE_MEMORY,
                upload_bps=INFLATE_LINK_BPS,
                download_bps=INFLATE_LINK_BPS,
            )
        return type(rec).model_validate({**rec.model_dump(), **update})

    # ------------------------------------------------------------------ plan
    def _rig_plan(self, plan, leader):
        """``plan`` (this node's honest plan as leader) made rogue when the attack is ``rogue-leader``."""
        if self.attack != "rogue-leader" or leader != self.me:
            return plan
        from geomesh_p2p.plan.schema import RoundPlan

        H = self.run_cfg.max_inner_steps
        seq = plan.seq_len
        out = []
        for a in plan.assignments:
            if a.peer_id == self.me:
                accum = -(-ROGUE_BUDGET // (seq * H * a.micro_batch))
                batch = a.micro_batch * accum
                out.append(
                    {
                        **a.model_dump(),
                        "batch_size": batch,
                        "accum_steps": accum,
                        "inner_steps": H,
                        "token_budget": batch * seq * H,
                        "part_start": 0,
                        "part_end": plan.numel,
                    }
                )
            else:
                k = self.rogue_others_steps
                out.append(
                    {
                        **a.model_dump(),
                        "inner_steps": k,
                        "token_budget": a.batch_size * seq * k,
                        "part_start": 0,
                        "part_end": 0,
                        "predicted_compute_s": 0.0,
                    }
                )
        if not any(a.peer_id == self.me for a in plan.assignments):
            log.warning("adversary[rogue-leader]: round %d: my own planner left me out; plan left honest", plan.round)
            return plan
        rogue = RoundPlan.model_validate({**plan.model_dump(), "assignments": out})
        self._note(
            plan.round,
            "plan",
            "rogue plan: sole owner of [0, %d), %d tokens for me, %d step(s) for %d others",
            plan.numel,
            rogue.assignment(self.me).token_budget,
            self.rogue_others_steps,
            len(out) - 1,
        )
        return rogue

    # ------------------------------------------------------------------ contribution
    def poison(self, spec, delta: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int]:
        """What this attacker pushes instead of (``delta``, ``tokens``)."""
        r, a = spec.round, self.attack
        cap = int(spec.participants.get(self.me, 0))
        if a == "poison" and getattr(self, "claim_steps", 0) and getattr(self, "_batch", 0):
            # the min_steps dodge (issue 28): what it trained, claimed as fewer steps than a check draws
            claim = min(tokens, int(self.claim_steps) * int(self._batch) * int(self.run_cfg.seq_len))
            self._note(r, "push", "claiming %d tokens (%d steps' worth; trained %d)", claim, self.claim_steps, tokens)
            return delta, claim
        if a in ("poison", "drop-owner", "self-succession"):  # honest in form: what it trained goes out unchanged
            return delta, tokens
        delta = delta.detach().to("cpu", torch.float32).reshape(-1)
        if a == "partial":  # what it trained, with the claim of its whole plan (the trainer reported it)
            out, claim = delta, max(tokens, cap)
        elif a == "stealth-flip":
            out, claim = stealth_flip(delta), tokens
        elif a == "flip" or (a == "forge-aggregate" and self.forge_push == "flip"):
            out, claim = -delta, tokens
        elif a in ("inflate", "rogue-leader"):
            out, claim = -delta, max(tokens, cap)
        elif a in ("flipmax", "forge-aggregate"):
            out, claim = delta * FLIPMAX_FACTOR, MAX_TOKENS
        elif a == "zeros":
            out, claim = torch.zeros_like(delta), MAX_TOKENS
        elif a == "stale":
            prev = self._last_update
            out = prev.clone() if prev is not None and prev.numel() == delta.numel() else torch.zeros_like(delta)
            claim = max(tokens, cap)
        elif a == "noise":
            z = torch.randn(delta.numel(), generator=self._rng, dtype=torch.float32)
            norm = float(delta.norm())
            out = z * (norm / max(float(z.norm()), 1e-30)) if norm > 0 else z * 1e-3
            claim = max(tokens, cap)
        else:  # pragma: no cover - guarded in __init__
            raise AssertionError(a)
        if not bool(torch.isfinite(out).all()):  # never make our own collective refuse the push
            out = torch.nan_to_num(out, nan=0.0, posinf=3e38, neginf=-3e38)
        self._note(
            r,
            "push",
            "pushing %s (|x| %.3g vs honest %.3g), claiming %d tokens (trained %d, cap %d)",
            a,
            float(out.norm()),
            float(delta.norm()),
            claim,
            tokens,
            cap,
        )
        return out, int(claim)

    def remember_update(self, aggregate: torch.Tensor) -> None:
        self._last_update = aggregate.detach().clone()

    # ------------------------------------------------------------------ owner
    def drop_from(self, spec, part, contributions: list) -> list:
        """``drop-owner``: the contributions part ``part`` (the owner's ``_OwnedPart``) aggregates, receipted
        senders cut (:func:`drop_contributions`); its committed inputs follow, so a validator's recomputation
        matches and only a dropped sender's receipt proves the drop. Other attacks: ``contributions``."""
        if self.attack != "drop-owner":
            return contributions
        kept, gone = drop_contributions(contributions, self.me, self.drop_senders)
        if gone:
            if spec.mode == "accountable":
                part.inputs = [c.signed for c in kept]
                part.input_senders = [c.sender for c in kept]
            self._note(
                spec.round,
                "drop",
                "left %d receipted contribution(s) of part %d out of its result: %s",
                len(gone),
                part.index,
                ", ".join(g[:10] for g in gone),
                key=str(part.index),
            )
        return kept

    def forge_result(self, signed: bytes) -> bytes:
        """The owner-signed PartResult this attacker serves instead of ``signed`` (its honest one)."""
        if self.attack != "forge-aggregate":
            return signed
        from geomesh_p2p.exchange import codec as compression
        from geomesh_p2p.wire import collective_pb2, envelope_pb2

        msg = envelope_pb2.SignedMessage.FromString(signed)
        env = msg.envelope
        res = collective_pb2.PartResult.FromString(msg.payload)
        if res.mode in ("reencode", "accountable"):  # accountable: its input list stays honest (issue 26)
            n = int(res.end - res.start)
            kind = res.aggregate_encoding
            if kind == "fp32":
                import numpy as np

                v = torch.from_numpy(np.frombuffer(res.aggregate, dtype="<f4").astype(np.float32))
                res.aggregate = (v * self.forge_factor).numpy().astype("<f4").tobytes()
            else:
                p = compression.packet_from_bytes(res.aggregate)
                v = compression.decode_any(p)
                res.aggregate = compression.encode_as(
                    kind, v * self.forge_factor, block_size=getattr(p, "block_size", 0) or 2048, tokens=p.tokens
                ).to_bytes()
            # a true aggregate of zeros (every contribution untrained: a loaded round 0) is served unchanged by the
            # factor, so nothing is forged and nothing can be proven: the count lets a test tell (session 52)
            self._note(
                int(res.round),
                "forge",
                "serving %gx the true aggregate of part %d [%d, %d) (%d elements, %d nonzero)",
                self.forge_factor,
                res.part,
                res.start,
                res.end,
                n,
                int(torch.count_nonzero(v)),
                key=str(res.part),
            )
        else:
            mine = bytes(self.identity.peer_id)
            keep, others = [], 0
            for c in res.contributions:
                m = envelope_pb2.SignedMessage.FromString(c.signed_message)
                if m.envelope.sender == mine:
                    keep.append(c)
                    continue
                others += 1
                if self.relay_forge == "tamper":
                    keep.append(collective_pb2.Contribution(signed_message=self._tamper(m)))
            del res.contributions[:]
            res.contributions.extend(keep)
            if self.relay_forge == "drop":
                pairs = [(p, t) for p, t in zip(res.contributors, res.tokens) if p == mine]
                del res.contributors[:]
                del res.tokens[:]
                res.contributors.extend(p for p, _ in pairs)
                res.tokens.extend(t for _, t in pairs)
            self._note(
                int(res.round),
                "forge",
                "relay of part %d: %s %d other contribution(s)",
                res.part,
                "dropped" if self.relay_forge == "drop" else "tampered with",
                others,
                key=str(res.part),
            )
        return self.identity.sign_message(
            run_id=env.run_id, round=env.round, kind=env.kind, payload=res.SerializeToString()
        ).SerializeToString()

    @staticmethod
    def _tamper(m) -> bytes:
        """Another peer's signed contribution with its packet negated, under its original signature."""
        from geomesh_p2p.exchange import codec as compression
        from geomesh_p2p.wire import collective_pb2

        c = collective_pb2.PartContribution.FromString(m.payload)
        try:
            p = compression.packet_from_bytes(c.packet)
            c.packet = compression.encode(
                -compression.decode_any(p), block_size=p.block_size, tokens=p.tokens
            ).to_bytes()
        except Exception:  # fp32 pushes or an odd packet: corrupt a byte instead
            b = bytearray(c.packet)
            if b:
                b[-1] ^= 0xFF
            c.packet = bytes(b)
        m.payload = c.SerializeToString()
        return m.SerializeToString()


# ---------------------------------------------------------------------------------------- CLI


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The parser and its ``join`` subparser (the flags of ``geomesh-peer join``, plus the attack's)."""
    from peer.cli import _add_common
    from peer.node_cli import add_node_flags, add_run_flags

    ap = argparse.ArgumentParser(
        prog="python -m tests.adversary",
        description="A red-team GeoMesh peer (attack suite of issue 11; tests and benchmarks only).",
    )
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("list", help="print the attacks")
    j = sub.add_parser("join", help="join a swarm as an attacker (every geomesh-peer join flag, plus --attack)")
    g = j.add_argument_group("attack")
    g.add_argument("--attack", required=True, choices=list(ATTACKS), help="the behaviour (see `list`)")
    g.add_argument(
        "--relay-forge",
        default="drop",
        choices=["drop", "tamper"],
        help="forge-aggregate in relay mode: drop the others' contributions or tamper with them",
    )
    g.add_argument(
        "--forge-factor",
        type=float,
        default=FORGE_FACTOR,
        help="forge-aggregate in reencode mode: factor on the true aggregate (default: %(default)s)",
    )
    g.add_argument(
        "--forge-push",
        default="flip",
        choices=["flip", "flipmax"],
        help="forge-aggregate: what it contributes itself (in relay mode, the only contribution it keeps "
        "in its parts) (default: %(default)s)",
    )
    g.add_argument(
        "--rogue-others-steps",
        type=int,
        default=0,
        metavar="K",
        help="rogue-leader: inner steps its plans give the other peers (default: %(default)s)",
    )
    g.add_argument(
        "--drop-senders",
        type=int,
        default=1,
        metavar="K",
        help="drop-owner: other senders it leaves out of each part it owns, the first K (0: all) (default: %(default)s)",
    )
    g.add_argument(
        "--poison-after",
        type=int,
        default=0,
        metavar="N",
        help="poison: honest in the first N rounds it trains, poisoning from round N+1 on (a patient poisoner: "
        "passes its probation and the first rounds' screens) (default: %(default)s)",
    )
    g.add_argument(
        "--claim-steps",
        type=int,
        default=0,
        metavar="K",
        help="poison: claim the tokens of K steps at its planned batch whatever it trained (issue 28's min_steps "
        "dodge: K below VerifyConfig.min_steps is never drawn for a check; 0: claim what it trained) "
        "(default: %(default)s)",
    )
    g.add_argument("--plan-out", action="append", default=[], metavar="PEER_ID", help="self-succession: a peer the "
                   "rounds it leads leave out (repeatable)")  # fmt: skip
    add_node_flags(j)
    add_run_flags(j)
    _add_common(j)  # --config, --log-level
    return ap, j


def main(argv: Optional[list[str]] = None) -> int:
    # as geomesh-peer: no full GC passes over the imported packages at exit (docs/exit-lag.md); run_scenario
    # waits up to 10 s for an attacker to exit, which they spent there
    skip_exit_collections()
    ap, join = build_parser()
    ns = ap.parse_args(argv)
    if ns.command == "list":
        for name, what in ATTACKS.items():
            print(f"{name:16} {what}")
        return 0
    if getattr(ns, "config", None):  # as geomesh-peer: file values become defaults, flags win
        from peer.config import ConfigFileError, load_config_defaults

        try:
            join.set_defaults(**load_config_defaults(join, ns.config))
        except ConfigFileError as e:
            print(f"adversary join: {e}", file=sys.stderr)
            return 2
        ns = ap.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level, format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    from peer.node_cli import _run_node, join_inputs, user_facing_errors

    inputs = join_inputs(ns, "adversary join")
    if inputs is None:
        return 2
    node = AdversaryNode(
        *inputs,
        attack=ns.attack,
        relay_forge=ns.relay_forge,
        forge_factor=ns.forge_factor,
        forge_push=ns.forge_push,
        rogue_others_steps=ns.rogue_others_steps,
        drop_senders=ns.drop_senders,
    )
    node.poison_after = ns.poison_after  # read when the trainer is built (start)
    node.claim_steps = ns.claim_steps
    node.plan_out = ns.plan_out
    try:
        return asyncio.run(_run_node(node))
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if isinstance(e, user_facing_errors()):
            print(f"adversary join: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
