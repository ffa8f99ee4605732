"""How a node joins its run (lifecycle step 3 of :mod:`geomesh_p2p.node.peer`): the checks before it
trains (a compatible swarm, a PeerID no other live process runs), then the global state it starts from:
``--resume``'s checkpoint, the swarm's state when the swarm is past round 0, the seed's otherwise, and what
it does when the run's swarm is empty (``--on-empty-swarm``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Optional


import geomesh_p2p
from geomesh_p2p.node.started import started
from geomesh_p2p.dht import IncompatibleSwarmError, check_compatible, live_peers
from geomesh_p2p.dht.state import DHT_PROTOCOL_VERSION
from geomesh_p2p.config.models import RunConfig
from geomesh_p2p.dht.preflight import check_bootstraps, own_address
from geomesh_p2p.dht.preflight import unanswered_bootstraps_line as unanswered_bootstraps_line  # re-exported
from geomesh_p2p.dht.progress import swarm_progress
from geomesh_p2p.model import state as gstate  # module-qualified: tests replace gstate.load_latest_checkpoint
from geomesh_p2p.model.build import flat_params
from geomesh_p2p.model.inner_ckpt import load_inner_state
from geomesh_p2p.net.swarm_time import swarm_time
from geomesh_p2p.schema.peer import PeerRecord
from geomesh_p2p.sync.download import StateSyncError
from geomesh_p2p.telemetry import events
from geomesh_p2p.trust.standing import Standing
from geomesh_p2p.util.aio import wait_event
from geomesh_p2p.util.backoff import Backoff
from geomesh_p2p.util.errors import StartInputError, UserFacingError
from geomesh_p2p.exchange.codec.feedback import PushFeedback
from geomesh_p2p.net.addr import listen_problem
from geomesh_p2p.net.methods import DHT_PING
from geomesh_p2p.wire import dht_pb2

if TYPE_CHECKING:
    from geomesh_p2p.node.peer import PeerNode

log = logging.getLogger("geomesh_p2p.node.peer")

#: Holders a sampled read of records waits for (:func:`records_of`; the DHT's ``read_quorum`` is 5 for full reads).
#: Each holder answers with the sampled records: at 1,024 peers a light follower's two sampled reads were ~65% of
#: its DHT bytes (docs/scale.md, session 18).
SAMPLED_READ_QUORUM = 2

__all__ = [
    "StoppedBeforeJoining",
    "DuplicateIdentityError",
    "EMPTY_SWARM_POLL_MAX_S",
    "IDENTITY_PING_TIMEOUT_S",
    "placeholder_record",
    "check_identity_unique",
    "watch_identity",
    "read_records",
    "check_swarm",
    "initial_state",
    "resume_from",
    "warn_if_other_identity",
    "warn_if_resumed_behind",
    "refuse_remembered_config",
    "on_empty_swarm",
    "continue_if_holders_gone",
]

#: Longest pause between two looks for a live peer while ``--on-empty-swarm wait`` waits (seconds).
EMPTY_SWARM_POLL_MAX_S = 15.0

#: How long a peer waits for the address of a record under its own PeerID to answer at start (seconds).
IDENTITY_PING_TIMEOUT_S = 3.0


class StoppedBeforeJoining(Exception):
    """Ctrl+C / SIGTERM arrived while the node was still joining the DHT (a clean stop, exit 0)."""


class DuplicateIdentityError(UserFacingError):
    """Another live process runs this PeerID (the same --identity key file)."""


def placeholder_record(node: PeerNode) -> PeerRecord:
    """This peer's version, protocol and run config, before its device is profiled (never announced)."""
    return PeerRecord(
        peer_id=node.me,
        address=node.record_address,
        device="(starting)",
        memory_bytes=0,
        max_batch=1,
        upload_bps=1.0,
        download_bps=1.0,
        version=geomesh_p2p.__version__,
        protocol_version=geomesh_p2p.PROTOCOL_VERSION,
        run_config_hash=node.config_hash,
        run_config=node.run_cfg.model_dump(),
    )


async def check_identity_unique(node: PeerNode) -> None:
    """Refuse to start when another live process already runs this PeerID (issue 14 #7).

    A record under this PeerID at another address may be this identity's previous run (a restart
    within the record's lifetime) or a second process with the same key: the address is pinged, and
    only an answer signed by this very PeerID (only the key's holder can sign it) proves the second.

    Raises:
        DuplicateIdentityError: "this PeerID is already live at ADDRESS".
    """

    transport = node._started_transport()
    mine = transport.address
    for rec in await live_peers(
        started(node.dht), node.run_cfg.run_id, include_leaving=True, shards=node.run_cfg.record_shards
    ):
        if rec.peer_id != node.me or not rec.address or rec.address == mine:
            continue
        req = dht_pb2.PingRequest(
            sender=started(node.dht).self_info(),
            dht_protocol=DHT_PROTOCOL_VERSION,
            software_version=geomesh_p2p.__version__,
        )
        try:
            reply = await transport.call(
                rec.address, DHT_PING, req.SerializeToString(), timeout=IDENTITY_PING_TIMEOUT_S
            )
        except Exception:  # nobody there (a stale record of this identity's previous run)
            continue
        if reply.sender == node.identity.peer_id:
            # The PeerID's record is the other process's now: this one must not announce that it leaves (a
            # leaving record under the shared PeerID made the others drop the live peer: fresh-user trial, s23).
            node.identity_taken = True
            raise DuplicateIdentityError(
                f"this PeerID ({node.identity.peer_id.short()}) is already live at {rec.address}: another "
                f"process runs with the same --identity key; give each peer its own key file"
            )


#: seconds between two pings of a record of this PeerID at another address (seen in a membership read)
IDENTITY_RECHECK_S = 30.0
_identity_checked: dict[str, float] = {}  # PeerID -> monotonic time of its last in-run check


async def watch_identity(node: PeerNode, recs: list[PeerRecord]) -> None:
    """In a run: the check of :func:`check_identity_unique`, when a membership read holds a record of this
    PeerID at another address. At start the other process may not have announced yet (two peers started
    with the same default key seconds apart each saw nobody, then trained apart on two lineages; the record
    under their common subkey then flips between their addresses). At most once per IDENTITY_RECHECK_S.

    Raises:
        DuplicateIdentityError: the other address answers as this PeerID.
    """
    mine = node.record_address
    if not any(r.peer_id == node.me and r.address and r.address != mine for r in recs):
        return
    now = time.monotonic()
    if now < _identity_checked.get(node.me, 0.0) + IDENTITY_RECHECK_S:
        return
    _identity_checked[node.me] = now
    await check_identity_unique(node)


async def read_records(node: PeerNode) -> list[PeerRecord]:
    """One full read of the run's records of this version and run config, leaving peers' included (the
    node's shared membership read), checked for this PeerID live elsewhere (:func:`watch_identity`).

    Raises:
        DuplicateIdentityError: another process runs this PeerID.
    """
    v, h, run = geomesh_p2p.__version__, node.config_hash, node.run_cfg.run_id
    shards = node.run_cfg.record_shards
    recs = await live_peers(
        started(node.dht), run, expected_version=v, expected_config_hash=h, include_leaving=True, shards=shards
    )
    await watch_identity(node, recs)
    return recs


async def records_of(node: PeerNode, peer_ids: Collection[str], *, sampled: bool = True) -> list[PeerRecord]:
    """The live, admitted records of ``peer_ids`` only, of this version and run config, leaving ones
    included: one read of those subkeys (:func:`~geomesh_p2p.dht.live_peers` with ``only``; a light
    follower's sample, issue 25: a few records, not the run's N). This peer's own record, when asked for, is
    its current one (not read); no DHT read when it is the only one asked for. Read from
    :data:`SAMPLED_READ_QUORUM` holders: a sampled read decides nothing alone (a stale record sends a light follower
    to the full path, or its digest sample waits for the next read), so it asks fewer of the 8 replicas.

    ``sampled=False``: read with the DHT's own ``read_quorum`` (5) instead, for a read whose *absence* of a record
    is acted on (a light follower's check that no better-ranked outsider leads,
    :func:`~geomesh_p2p.round.light.outsider_problem`): a holder counts towards a quorum once it answers with any of the subkeys asked for, so two
    stale or hostile holders answering first (a Sybil's record only, or the outsider's old leaving one) ended a
    quorum-2 read without the outsider's live record, and the light follower followed a plan the full-view peers
    did not (red team, session 18)."""
    others = [p for p in peer_ids if p != node.me]
    recs: list[PeerRecord] = []
    if others:
        v, h, run = geomesh_p2p.__version__, node.config_hash, node.run_cfg.run_id
        recs = await live_peers(
            started(node.dht),
            run,
            expected_version=v,
            expected_config_hash=h,
            include_leaving=True,
            only=others,
            quorum=SAMPLED_READ_QUORUM if sampled else None,
            shards=node.run_cfg.record_shards,
        )
    out = node.admission.filter(recs)
    if node.me in peer_ids:
        out.append(node.my_record())
    return out


async def check_before_proof_of_work(node: PeerNode, tls: Optional[object]) -> None:
    """What can be checked before the proof of work (seconds to tens of seconds) and the DHT join: ``--port``
    can be listened on (:func:`~geomesh_p2p.net.addr.listen_problem`, unless ``--client-only``), then each
    ``--bootstrap`` (:func:`check_bootstrap_run`), unless ``geomesh-peer join`` pinged them already before torch's
    import (``node.bootstraps_pinged``: one ping, one WARNING at most).

    Raises:
        StartInputError: the port is in use, the host not this machine's (exit 2, as for a bad flag).
        OtherRunError: as :func:`check_bootstrap_run`.
    """
    c = node.cfg
    problem = None if c.client_only else listen_problem(c.host, c.port)
    if problem is not None:
        raise StartInputError(problem)
    if not getattr(node, "bootstraps_pinged", False):
        await check_bootstrap_run(node, tls)


async def check_bootstrap_run(node: PeerNode, tls: Optional[object], timeout_s: float = 5.0) -> None:
    """Before the proof of work (tens of seconds for a new identity): one ping to each ``--bootstrap`` from a
    client-only transport that lives for this check only (:func:`~geomesh_p2p.dht.preflight.check_bootstraps`), so
    a bootstrap of another run (a wrong ``--run-id``) is named at once, not after the proof of work (a fresh user
    waited 41 s for it). Addresses that each refuse the connection (nothing listens there) are pinged again for up
    to ``--join-attempts`` tries within :data:`~geomesh_p2p.dht.preflight.REFUSED_WINDOW_S` (a bootstrap that is
    starting); any other outcome (an answer, no answer, another refusal) is left to the join, which retries and
    words it. ``geomesh-peer join`` runs the same check earlier, before torch's import.

    When no bootstrap answered, one WARNING line names each address and why (:func:`unanswered_bootstraps_line`).

    Raises:
        NothingListensError: nothing listened at any ``--bootstrap`` address during those tries, naming them.
        OtherRunError: no bootstrap answered, one said it serves another run, and every other failure is final
            (:func:`~geomesh_p2p.dht.join.final_failure`: one silent or not up yet is left to the join's retries).
    """
    addresses = list(node.cfg.bootstrap or [])
    if not addresses or node.run_cfg.pow_bits <= 0:  # no proof of work: the join itself comes at once
        return
    c = node.cfg
    own = own_address(c.host, c.advertise_host, c.port, c.client_only)  # its join leaves it out (red team 44)
    line = await check_bootstraps(
        node.identity, node.run_cfg.run_id, addresses, tls, timeout_s, c.join_attempts, own=own
    )
    if line is not None:
        # said now, before the proof of work (a wrong address was reported ~50 s later, after it and the retries)
        log.warning(line)


def config_differences(here: dict, there: dict) -> list[str]:
    """The fields of two run configs (``RunConfig.model_dump()``) that differ, sorted by name, each as
    ``"inner_lr: 0.001 here vs 0.0003 in the swarm"``; each value's repr cut to :data:`_SHOWN_CHARS` characters
    (``there`` is another node's word: a valid config may carry a 60 KB run id or a 4,300-digit seed)."""
    return [
        f"{k}: {_shown(here.get(k), k)} here vs {_shown(there.get(k), k)} in the swarm"
        for k in sorted(set(here) | set(there))
        if here.get(k) != there.get(k)
    ]


#: The most characters of a run-config value a refusal shows (red team, session 16).
_SHOWN_CHARS = 60


#: What an unset run-config field means, shown instead of Python's ``None`` ("window_s: 1.0 here vs None in the swarm"
#: read as internals to a fresh user, session 34; the flag says ``--window-s auto``).
_NONE_SHOWN = {"window_s": "auto", "group_size": "auto"}


def _shown(value: object, key: str = "") -> str:
    """``repr(value)``, cut to :data:`_SHOWN_CHARS` characters (``...`` appended when cut); None as the flag says it
    (``auto`` for ``window_s`` and ``group_size``, else ``none``)."""
    if value is None:
        return _NONE_SHOWN.get(key, "none")
    text = (
        repr(value)
        if not isinstance(value, int) or abs(value) < 10**_SHOWN_CHARS
        else f"<{value.bit_length()}-bit int>"
    )
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def announced_config_differences(node: PeerNode, config: Optional[dict], config_hash: str) -> list[str]:
    """:func:`config_differences` against a run config another node announced (a bootstrap's progress entry),
    or [] when it does not parse as a run config or does not hash to ``config_hash`` (it is that node's word)."""
    if not config:
        return []
    try:
        theirs = RunConfig.model_validate(config)
    except ValueError:
        return []
    if theirs.config_hash() != config_hash:
        return []
    return config_differences(node.run_cfg.model_dump(), theirs.model_dump())


async def check_swarm(node: PeerNode, mine: Optional[PeerRecord] = None, remembered: bool = False) -> None:
    """Refuse to start when the swarm's live peers all run another config or version; with ``remembered`` (at start,
    before the data, the model and the profile: 33 s for gpt2-124m on a CPU), also when none is live and a
    bootstrap remembers the run past round 0 with another run config (:func:`refuse_remembered_config`, for a fresh
    peer: no ``--resume``, ``--on-empty-swarm`` not ``seed``), which :func:`on_empty_swarm` said only after the
    profile (fresh user 46).

    Raises IncompatibleSwarmError naming the differing fields (e.g. "inner_lr: 0.001 here vs
    0.0003 in the swarm").
    """

    mine = mine or node.my_record()
    found = await live_peers(started(node.dht), node.run_cfg.run_id, shards=node.run_cfg.record_shards)
    others = [r for r in found if r.peer_id != node.me]
    if not others and remembered and not node.cfg.resume and node.cfg.on_empty_swarm != "seed":
        prog = await swarm_progress(started(node.dht), node.run_cfg.run_id)
        if prog is not None:
            refuse_remembered_config(node, prog)
    if not others or any(check_compatible(mine, r) is None for r in others):
        return
    other = others[0]
    detail = check_compatible(mine, other)
    if other.run_config and other.run_config_hash != node.config_hash:
        detail = "; ".join(config_differences(node.run_cfg.model_dump(), other.run_config)) or detail
    # what to do, as the remembered-config refusal says it (fresh user 51: the fields alone left them guessing)
    raise IncompatibleSwarmError(
        f"the {len(others)} live peer(s) of run {node.run_cfg.run_id!r} use another run config: {detail}; join "
        "with the swarm's values (the flags or --config of those fields), or give another --run-id to start a "
        "swarm of your own"
    )


async def initial_state(node: PeerNode) -> None:

    await check_swarm(node)

    if node.cfg.resume and node.cfg.checkpoint_dir:
        ck = await asyncio.to_thread(gstate.load_latest_checkpoint, node.cfg.checkpoint_dir)
        if ck is not None:
            await resume_from(node, ck)
            await node._warn_if_resumed_behind()
            return
        # a WARNING, not INFO: a mistyped folder is created empty and the peer would restart from scratch unnoticed
        log.warning(
            "--resume: no checkpoint in %s (a new or empty folder: check --checkpoint-dir if this peer trained "
            "before); starting fresh",
            node.cfg.checkpoint_dir,
        )
    # Fresh peer: join the swarm's state if it already trained, else the seed's.
    # The seed weights are written into the state buffer itself, in the worker thread (not on the loop).
    await asyncio.to_thread(
        lambda: node._set_state(
            0, flat_params(node.model, out=started(node.gstate).theta), started(node.gstate).opt_state.zero_()
        )
    )
    everyone = [r for r in await node.peers(include_leaving=True) if r.peer_id != node.me]
    recs = [r for r in everyone if not r.leaving]
    if any(r.round > 0 and r.weights_digest for r in recs):
        await _catch_up_or_own(node)
    elif not recs:
        await node._on_empty_swarm()
        if (
            node.round == 0
            and node.cfg.on_empty_swarm != "seed"
            and any(r.round > 0 and r.weights_digest for r in everyone)
        ):
            # only leaving records, a bootstrap not knowing the run past round 0 yet (restarted 1 s after the run
            # ended): the catch-up the first round would start, now, so that its checkpoint may be taken instead
            await _catch_up_or_own(node)
    await warn_unused_checkpoint(node)


async def warn_unused_checkpoint(node: PeerNode) -> None:
    """Without ``--resume``: one WARNING when ``--checkpoint-dir`` holds a checkpoint this start did not take (its
    newest round, and how to use it). Fresh user 50 restarted a peer without ``--resume``: it took the swarm's state
    and its own checkpoint (its inner optimizer moments, its standing) went unused without a word. Nothing when the
    start continued from that checkpoint (:func:`_continue_from_own`: the same round and digest)."""
    d = node.cfg.checkpoint_dir
    if node.cfg.resume or not d:
        return
    try:
        ckpts = await asyncio.to_thread(gstate.list_checkpoints, d)
        rnd, path = ckpts[-1] if ckpts else (None, None)
        digest = json.loads(path.read_text()).get("digest") if path is not None else None
    except (OSError, ValueError, AttributeError):  # unreadable: the --resume that would use it says so
        return
    if rnd is None or (node.round, node.digest) == (rnd, digest):
        return
    took = f"took the swarm's state of round {node.round}" if node.round else "starts from the seed at round 0"
    log.warning(
        "--checkpoint-dir %s holds a checkpoint of round %d, NOT used: this peer started without --resume (it %s, "
        "without that checkpoint's inner optimizer state and standing); to continue from it, restart with --resume",
        d,
        rnd,
        took,
    )


async def _catch_up_or_own(node: PeerNode) -> None:
    """The fresh peer's catch-up; when it adopted nothing because no holder answered, its own checkpoint
    (:func:`continue_if_holders_gone`). Raises the catch-up's StateSyncError when that did not apply."""
    try:
        await node.resync.catch_up()
    except StateSyncError:
        if not await continue_if_holders_gone(node):
            raise
    else:
        await continue_if_holders_gone(node)


def adopt_state(node: PeerNode, round: int, theta, momentum) -> None:
    """A state the catch-up adopted (a download or the donors' updates): made the node's state of ``round``
    (``PeerNode._set_state``, whole-model: a worker thread), and the collective told, so that the others'
    pushes for ``round`` are held until this peer registers it, not refused as "too far ahead" of the round it
    had before (red team, session 13: a peer that caught up from round 3 to 19 refused round 19's pushes to the
    part it owned, and the round's digests split)."""
    node._set_state(round, theta, momentum)
    node.rs.written_by = None  # the state is a donor's now, not the resumed checkpoint's
    node.rs.resumed_with = ()
    # every level of the exchange (the grouped one forwards to the one-level service)
    collective = getattr(node, "grouped", None) or getattr(node, "collective", None)
    if collective is not None:
        collective.note_round(round)


def hashed_defaults(run: RunConfig, want: object) -> list[str]:
    """The ``patch_fields`` of ``run`` that, back at this release's default, give the run-config hash ``want``
    (a checkpoint's), each as a line for the refusal: its run left the field out of its hash as that release's
    default (``--group-size 0`` was the default until 0.11; given now, it counts in the hash); [] when none does."""
    out = []
    for k in sorted(run.patch_fields):
        default = type(run).model_fields[k].get_default(call_default_factory=True)
        if getattr(run, k) != default and run.model_copy(update={k: default}).config_hash() == want:
            out.append(
                f"{k}: {getattr(run, k)!r} here, the same value there, but its run hashed it as the default of its "
                f"release (this release's default: {_shown(default, k)}): leave its flag out to resume"
            )
    return out


async def resume_from(node: PeerNode, ck) -> None:
    """Take the global state of checkpoint ``ck`` (``gstate.load_latest_checkpoint``'s tuple: round,
    theta [P] fp32, optimizer state [k * P] fp32 or None, meta), the standing ledger it saved and this peer's
    verdicts (verified-work exclusions, owner and no-show penalties).

    Raises:
        UserFacingError: the checkpoint is of another run config, or holds no or another optimizer state.
    """
    rnd, theta, momentum, meta = ck
    if meta.get("run_config_hash") not in (None, node.config_hash):
        old = (meta.get("meta") or {}).get("run_config") or {}
        diff = [
            f"{k}: {old.get(k)!r} there vs {v!r} here"
            for k, v in node.run_cfg.model_dump().items()
            if k in old and old[k] != v
        ]
        if not diff:  # the same values: a patch field given at a value its run hashed as the default (red team 37b)
            diff = hashed_defaults(node.run_cfg, meta.get("run_config_hash"))
        raise UserFacingError(
            f"checkpoint in {node.cfg.checkpoint_dir} is from another run config ("
            + ("; ".join(diff) or f"{meta.get('run_config_hash')} vs {node.config_hash}")
            + "); resume with the same flags, or use another --checkpoint-dir"
        )
    if momentum is None or momentum.numel() != node.state_numel:
        raise UserFacingError(
            f"checkpoint in {node.cfg.checkpoint_dir} holds no or another optimizer "
            f"state ({0 if momentum is None else momentum.numel()} elements, this run "
            f"needs {node.state_numel}); was it written by another --method?"
        )
    # a consistent but edited file of another size: copy_ raised a RuntimeError's traceback (red team 37b)
    if getattr(node, "numel", 0) and theta.numel() != node.numel:
        raise UserFacingError(
            f"checkpoint in {node.cfg.checkpoint_dir} holds {theta.numel()} weights, this run's model has {node.numel}"
        )
    if warn_if_other_identity(node, rnd, meta.get("meta") or {}):
        node.rs.written_by = (meta.get("meta") or {}).get("peer_id")  # its records back nothing (RoundDriver.run)
    await asyncio.to_thread(node._set_state, rnd, theta, momentum)
    round_log = getattr(node, "round_log", None)
    if round_log is not None:  # /metrics said round 0 until the first round after a resume
        round_log.note_state_round(rnd)
    node.standing = Standing.from_meta((meta.get("meta") or {}).get("standing"))
    node.rs.resumed_with = node.standing.trained_with(rnd, node.me)
    verdicts = (meta.get("meta") or {}).get("verdicts") or {}
    if isinstance(verdicts, dict):  # checkpoints before issue 28 hold none
        node.verified.restore(verdicts.get("verified"))
        node.penalties.restore(verdicts.get("penalties"))
        node.profile.restore_delivered(verdicts.get("delivered"), rnd)
    events.emit(
        log,
        logging.INFO,
        "resumed_from_checkpoint",
        "resumed from checkpoint at round %d (digest %s)",
        rnd,
        str(node.digest)[:8],
        peer=node.me,
        round=rnd,
        digest=node.digest,
    )
    await resume_inner_state(node, rnd, meta)
    fb: Optional[PushFeedback] = getattr(node, "feedback", None)  # absent before _build_training
    if fb is not None and node.digest is not None:  # _set_state set the digest
        got = await asyncio.to_thread(fb.load, node.cfg.checkpoint_dir, state_round=rnd, digest=node.digest)
        log.info(
            "error feedback: %s",
            "residual resumed from the checkpoint" if got == "loaded" else f"residual starts at zero ({got})",
        )


async def resume_inner_state(node: PeerNode, rnd: int, record: dict) -> None:
    """After :func:`resume_from` took checkpoint ``record`` (of round ``rnd``): this peer's inner optimizer state
    and global step saved beside it (:func:`~geomesh_p2p.model.inner_ckpt.load_inner_state`, worker thread), when
    they match. One line either way: INFO ``inner_state_resumed``; INFO ``inner_state_fresh`` for a checkpoint
    without the file (an older release: it resumes as before, from zero moments); WARNING ``inner_state_fresh``
    naming the mismatch (another optimizer, run config, checkpoint digest, parameter names or shapes, a damaged
    file). Why (fresh user, session 37): every peer resumed with zero AdamW moments, and the eval perplexity got
    worse for rounds (122.97 before the stop, 129.02 after)."""
    trainer = getattr(node, "trainer", None)
    if trainer is None or not node.cfg.checkpoint_dir or node.digest is None:
        return
    stem = Path(str(record.get("weights") or f"ckpt-{rnd:08d}.safetensors")).stem
    ok, why = await asyncio.to_thread(
        load_inner_state,
        trainer,
        node.cfg.checkpoint_dir,
        stem,
        round=rnd,
        digest=str(record.get("digest")),
        config_hash=node.config_hash,
    )
    if ok:
        events.emit(
            log,
            logging.INFO,
            "inner_state_resumed",
            "inner optimizer state resumed from the checkpoint of round %d (%s, global step %d)",
            rnd,
            why,
            trainer.global_step,
            peer=node.me,
            round=rnd,
            global_step=trainer.global_step,
        )
        return
    missing = why == "missing"
    events.emit(
        log,
        logging.INFO if missing else logging.WARNING,
        "inner_state_fresh",
        "the inner optimizer starts fresh (zero moments): %s",
        f"the checkpoint of round {rnd} holds no inner optimizer state (written by an older release)"
        if missing
        else f"its state beside the checkpoint of round {rnd} does not match ({why})",
        peer=node.me,
        round=rnd,
        reason=why,
    )


def warn_if_other_identity(node: PeerNode, rnd: int, meta: dict) -> Optional[str]:
    """A resumed checkpoint written under another PeerID than this peer's (a mistyped ``--identity`` creates a
    new key, and the resume went on under it with only the key's INFO line: fresh-user trial): one WARNING naming
    both PeerIDs, the checkpoint's folder and both key files (the checkpoint's when it recorded one, from 0.11).
    Not refused: the state is the swarm's, any peer may start from it (a copy given to a new volunteer); what
    stays with the old key is its standing with the other peers. Returns the line, None when the IDs agree or
    the checkpoint recorded none."""
    theirs = meta.get("peer_id")
    if not isinstance(theirs, str) or not theirs or theirs == node.me:
        return None
    key = meta.get("identity")
    created = getattr(node.identity, "created", None) is not None
    line = (
        f"--resume: the checkpoint of round {rnd} in {node.cfg.checkpoint_dir} was written by PeerID {theirs[:60]}"
        + (f" (key {str(key)[:300]})" if isinstance(key, str) and key else "")
        + f", but this peer runs as PeerID {node.me} from --identity {node.cfg.identity}"
        + (" (a key created now)" if created else "")
        + ": continuing under the new PeerID, without the standing the swarm gave the old one; if --identity is "
        "mistyped, stop (Ctrl+C) and pass the key file that wrote the checkpoint"
    )
    log.warning(line)
    return line


async def warn_if_resumed_behind(node: PeerNode) -> None:
    """After ``--resume``: when no other peer of the run is live but a bootstrap saw the run at a later
    round than the checkpoint's, or the records of its peers that left back one, say so (the newest of the two) in one WARNING (event ``resumed_behind_swarm``): unless a peer of the
    run joins and hands it the later state (peers restarted together, whose records are not in yet: session 36's
    fresh user read the earlier wording, "trains alone ... a fork", as a failure while it adopted round 16 in the
    same second), this peer trains alone from an older state, a fork of the run (a fresh-user trial resumed
    round 6 of a run that had reached round 12, untold). Live peers at a later round need no line: the
    first round's behind-check catches up to them."""
    everyone = [r for r in await node.peers(include_leaving=True) if r.peer_id != node.me]
    if [r for r in everyone if not r.leaving]:
        return
    prog = await swarm_progress(started(node.dht), node.run_cfg.run_id)
    # and the round the records of the peers that left back (the state vote, as the catch-up reads it): the
    # bootstrap's figure may be older (fresh user 46: "resume from a checkpoint of round 11" while the peers that
    # finished had announced round 15, which this peer read a second later as "the swarm was last seen at round 15")
    left = node.resync.swarm_round(everyone) if everyone else None
    newest = max(prog.round if prog is not None else -1, left if left is not None else -1)
    node.rs.known_round = max(node.rs.known_round, newest)  # a resume at round 0 behind it is no whole swarm
    if newest <= node.round:
        return
    seen = f"bootstrap {prog.by[:8] or '?'} saw run {node.run_cfg.run_id!r} at round {prog.round}" if prog else ""
    if left is not None and (prog is None or left > prog.round):
        seen = f"the records of its peers that left say run {node.run_cfg.run_id!r} reached round {left}" + (
            f" ({seen})" if seen else ""
        )
    events.emit(
        log,
        logging.WARNING,
        "resumed_behind_swarm",
        "resumed at round %d, but %s and no other peer of it is live yet: "
        "if one joins (peers restarted together), this peer adopts the swarm's state of round %d from it; if none "
        "does, this peer %s from round %d, a fork of the run (to avoid that, resume from a checkpoint "
        "of round %d)",
        node.round,
        seen,
        newest,
        # a checkpoint trained with others waits for them (round.gather.held_for_swarm; fresh user 50)
        "waits for the peers it trained its checkpoint with, then trains with them"
        if node.rs.resumed_with and getattr(node.cfg, "min_peers", 1) >= 2
        else "trains alone",
        node.round,
        newest,
        peer=node.me,
        round=node.round,
        swarm_round=newest,
        bootstrap=prog.by if prog is not None else "",
        bootstrap_round=prog.round if prog is not None else None,
    )


async def _own_checkpoint(node: PeerNode):
    """The newest checkpoint in ``--checkpoint-dir`` (``load_latest_checkpoint``'s tuple), or None when there is
    no directory, no checkpoint or an unreadable one (the wait goes on as before)."""
    d = node.cfg.checkpoint_dir
    if not d:
        return None
    try:
        return await asyncio.to_thread(gstate.load_latest_checkpoint, d)
    except Exception as e:  # noqa: BLE001  a damaged checkpoint: no shortcut, the wait says nothing of it
        log.debug("checkpoint in %s not usable while the swarm is empty: %s", d, e)
        return None


async def _continue_from_own(node: PeerNode, own, known: int, why: str) -> bool:
    """Take ``own`` (:func:`_own_checkpoint`'s tuple, or None) when it holds round ``known`` or later of this run
    config, saying so in one INFO line ending with ``why``; False (nothing taken) otherwise."""
    if own is None or own[0] < known or own[3].get("run_config_hash") not in (None, node.config_hash):
        return False
    log.info(
        "this peer's checkpoint in %s holds round %d, %s: continuing from it", node.cfg.checkpoint_dir, own[0], why
    )
    await resume_from(node, own)
    return True


async def continue_if_holders_gone(node: PeerNode) -> bool:
    """After a fresh peer's catch-up that adopted nothing because every peer announcing a state past round 0 did
    not answer (no connection: they exited, their records outliving them by a TTL; ``StateSync.unanswered``):
    continue from ``--checkpoint-dir``'s newest checkpoint when it holds the round the run is known at (those
    records' round, a bootstrap's), as :func:`on_empty_swarm` does (fresh user 47: a peer restarted 1 s after a
    two-peer run ended trained the seed alone, exit 3, its checkpoint of the run's last round unused). True when
    it did; a state that answered differently, or a checkpoint behind, changes nothing."""
    silent = node.resync.unanswered
    if silent is None or node.round > 0:
        return False
    prog = await swarm_progress(started(node.dht), node.run_cfg.run_id)
    known = max(silent, node.rs.known_round, prog.round if prog is not None else 0)
    why = f"at or past round {known}, the run's, whose peers do not answer (no connection: they left)"
    if not await _continue_from_own(node, await _own_checkpoint(node), known, why):
        return False
    node.rs.known_round = max(node.rs.known_round, known)  # the whole swarm: it holds the run's known round
    return True


def refuse_remembered_config(node: PeerNode, prog) -> None:
    """Raise IncompatibleSwarmError when ``prog`` (a bootstrap's :class:`~geomesh_p2p.dht.progress.SwarmProgress`
    of a run past round 0) names another run config than this peer's: the remembered swarm's peers would refuse
    this one when they come back (and it them); said now rather than after waiting for them (a fresh-user trial
    waited, untold)."""
    if prog.round <= 0 or not prog.config_hash or prog.config_hash == node.config_hash:
        return
    diff = announced_config_differences(node, prog.config, prog.config_hash)
    raise IncompatibleSwarmError(
        f"run {node.run_cfg.run_id!r} was at round {prog.round} with another run config (hash "
        f"{prog.config_hash[:12]} there, {node.config_hash[:12]} here"
        + (f"; {'; '.join(diff)}" if diff else "")
        + "): its peers could not take this one back; use the run's flags, another --run-id, or "
        "--on-empty-swarm seed to start this run id anew"
    )


async def on_empty_swarm(node: PeerNode) -> None:
    """No other live peer of this run (issue 14 #2): when a bootstrap saw the run at round N > 0
    (:func:`~geomesh_p2p.dht.progress.swarm_progress`, kept across bootstrap restarts), say so in one
    line and act by ``--on-empty-swarm``: ``wait`` (default) continues from ``--checkpoint-dir``'s newest
    checkpoint when it holds the round the run was at (this peer has the run's last state itself), else polls
    with a capped backoff until a peer of the run is live (then downloads its state) or Ctrl+C; ``resume``
    takes ``--checkpoint-dir``'s
    newest checkpoint; ``seed`` keeps the seed's state at round 0 (a new run under the same id). A run
    no bootstrap knows past round 0 starts from the seed silently, as before.

    Raises:
        UserFacingError: ``resume`` with no ``--checkpoint-dir`` or no checkpoint in it.
        StoppedBeforeJoining: Ctrl+C / SIGTERM while waiting.
    """
    prog = await swarm_progress(started(node.dht), node.run_cfg.run_id)
    if prog is None or prog.round <= 0:
        return
    how = node.cfg.on_empty_swarm
    ago = max(0.0, swarm_time() - prog.seen_at)
    events.emit(
        log,
        logging.WARNING,
        "empty_swarm",
        # "or later": the bootstrap's figure is its last sight (fresh user 53: a run that went on to round 14 and
        # ended was read "at round 9", seen 29 s before)
        "run %r was at round %d or later (bootstrap %s saw %d peer(s) there %.0f s ago) but no peer of it is live now",
        node.run_cfg.run_id,
        prog.round,
        prog.by[:8] or "?",
        prog.peers,
        ago,
        peer=node.me,
        run_id=node.run_cfg.run_id,
        round=prog.round,
        bootstrap=prog.by,
        peers=prog.peers,
        seen_ago_s=ago,
        action=how,
    )
    if how == "seed":
        log.info("--on-empty-swarm seed: starting the run again from the seed at round 0")
        return
    refuse_remembered_config(node, prog)
    node.rs.known_round = max(node.rs.known_round, prog.round)  # resumed or waited at round 0: no whole swarm
    if how == "resume":
        d = node.cfg.checkpoint_dir
        ck = await asyncio.to_thread(gstate.load_latest_checkpoint, d) if d else None
        if ck is None:
            raise UserFacingError(
                f"--on-empty-swarm resume: no checkpoint in {d}"
                if d
                else "--on-empty-swarm resume needs --checkpoint-dir (the directory of this run's checkpoints)"
            )
        await resume_from(node, ck)
        return
    own = await _own_checkpoint(node)
    # This peer holds the run's last state itself (a fresh-user trial re-ran the README's one-machine swarm with
    # the same run id: every peer waited for a peer of the run, none announced, for good).
    if await _continue_from_own(node, own, prog.round, "the round the run was at"):
        return
    events.emit(
        log,
        logging.INFO,
        "empty_swarm_waiting",
        "waiting for a peer of run %r to come back (Ctrl+C to stop; --on-empty-swarm resume or seed "
        "starts without one%s)",
        node.run_cfg.run_id,
        ""
        if own is None
        else f"; this peer's checkpoint in {node.cfg.checkpoint_dir} is at round {own[0]}: "
        "--on-empty-swarm resume continues from it",
        peer=node.me,
        run_id=node.run_cfg.run_id,
    )
    backoff = Backoff(first=1.0, cap=EMPTY_SWARM_POLL_MAX_S)
    while True:
        if await wait_event(node._stop, backoff.next()):
            raise StoppedBeforeJoining("stop requested while waiting for a peer of the run")
        recs = [r for r in await node.peers() if r.peer_id != node.me]
        if not recs:
            continue
        events.emit(
            log,
            logging.INFO,
            "swarm_back",
            "%d peer(s) of run %r are live again",
            len(recs),
            node.run_cfg.run_id,
            peer=node.me,
            run_id=node.run_cfg.run_id,
            peers=sorted(r.peer_id for r in recs),
        )
        if any(r.round > 0 and r.weights_digest for r in recs):
            await node.resync.catch_up()
        return
