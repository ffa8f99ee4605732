"""What a bootstrap knows of its run's progress, kept across its restarts (issue 14 #2).

A bootstrap counts the live peers of its run and the newest round they announce; it publishes that as
a :class:`SwarmProgress` under ``<run>/progress``, subkey = its own PeerID (so only it can write its
entry), and saves it with its routing table in a :class:`BootstrapState` file. After a restart it
re-dials the saved contacts (:meth:`~geomesh_p2p.dht.node.DHTNode.rejoin`) and publishes the saved
progress again, so:

* the swarm's peers are back in its routing table at once (newcomers joining through it find them);
* a newcomer that finds *no* live peer learns the run was at round N (:func:`swarm_progress`) and can
  say so, then wait or resume from a checkpoint, instead of starting from the seed at round 0 alone.

Only entries signed by a bootstrap this node joined through count (``DHTNode.bootstrap_peers``): any
peer could write its own subkey, and a fake "round 10^9" must not make newcomers wait forever.
Units: seconds, unix seconds.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

from geomesh_p2p.util.atomic import atomic_write
from geomesh_p2p.net.identity import Identity, PeerID
from geomesh_p2p.util.untrusted import json_loads, non_finite

if TYPE_CHECKING:  # annotations only: reading a --state-file imports no hivemind (a bootstrap's start-up check)
    from geomesh_p2p.dht.node import DHTNode
    from geomesh_p2p.dht.state import Contact

log = logging.getLogger(__name__)

STATE_VERSION = 1
#: The longest a DHT record may live (RecordLimits.max_ttl_s), less a margin: a node whose swarm clock is a little
#: behind the storer's saw exactly 24 h as "expires in 86400s, over the maximum lifetime of 86400s" and refused it
#: (fresh user, session 15). 10 minutes covers any clock offset the transport accepts (30 s).
PROGRESS_TTL_S = 24 * 3600.0 - 600.0
MAX_SAVED_CONTACTS = 256
#: the largest run config (bytes of JSON) a progress entry carries; a run config is ~1-2 KB
MAX_CONFIG_BYTES = 8192
#: the latest ``seen_at`` (unix seconds) an entry may say, as ``PeerRecord.timestamp`` (year 5138)
MAX_SEEN_AT = 1e11


def progress_key(run_id: str) -> str:
    """The DHT key of a run's bootstrap progress entries."""
    return f"{run_id}/progress"


@dataclass(frozen=True)
class SwarmProgress:
    """The newest round a bootstrap saw the run's live peers announce.

    ``round``: that round; ``seen_at``: unix time (the bootstrap's clock) it last saw a live peer;
    ``peers``: live peers it counted then; ``by``: base58 PeerID of the bootstrap that says so;
    ``config_hash``: the run-config hash the peers at that round announced ("" when not known: an entry
    of an older bootstrap), so a newcomer of another config is told at once instead of waiting.
    ``config``: the run config those peers announced (``RunConfig.model_dump()``, None when not known or over
    :data:`MAX_CONFIG_BYTES` of JSON), so that newcomer is told which fields differ, not only two hashes. It is
    the announcing peers' word: a reader shows it only when it hashes to ``config_hash``.
    """

    round: int
    seen_at: float
    peers: int
    by: str = ""
    config_hash: str = ""
    config: Optional[dict] = None

    def fields(self) -> dict:
        """The published fields (``by`` is the entry's subkey, not a field); ``config_hash`` and ``config`` only
        when known (``config`` also only when its JSON fits :data:`MAX_CONFIG_BYTES`)."""
        d: dict = {"round": self.round, "seen_at": self.seen_at, "peers": self.peers}
        if self.config_hash:
            d["config_hash"] = self.config_hash
            if self.config is not None and len(json.dumps(self.config, sort_keys=True)) <= MAX_CONFIG_BYTES:
                d["config"] = self.config
        return d

    def to_bytes(self) -> bytes:
        return json.dumps(self.fields(), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, by: str = "") -> "SwarmProgress":
        """Raises ValueError on anything but {"round": int >= 0, "seen_at": unix seconds in [0, 1e11], "peers":
        int >= 0} with an optional "config_hash": str of at most 128 characters and an optional "config": object
        that holds no number that is not finite (JSON's NaN, Infinity and 1e999 parse)."""
        d = json_loads(data, "swarm progress record")
        if not isinstance(d, dict):
            raise ValueError(f"malformed progress entry {d!r:.80}")
        rnd, seen, peers, cfg = d.get("round"), d.get("seen_at"), d.get("peers"), d.get("config_hash", "")
        config = d.get("config")
        if not (
            isinstance(rnd, int)
            and rnd >= 0
            and isinstance(peers, int)
            and peers >= 0
            and isinstance(seen, (int, float))
            and not isinstance(seen, bool)
            and 0 <= seen <= MAX_SEEN_AT  # nan fails too; an int of 400 digits does not reach float()
            and isinstance(cfg, str)
            and len(cfg) <= 128
            and (config is None or (isinstance(config, dict) and non_finite(config) is None))
        ):
            raise ValueError(f"malformed progress entry {d!r:.80}")
        return cls(rnd, float(seen), peers, by, cfg, config)


def progress_of(records, by: str, seen_at: float) -> Optional[SwarmProgress]:
    """A bootstrap's :class:`SwarmProgress` from its run's records (``PeerRecord``-like: ``round``,
    ``leaving``, ``run_config_hash``; leaving peers' records count: each is the last round its peer
    finished), or None when there are none. ``by``: the bootstrap's base58 PeerID; ``seen_at``: unix seconds.

    The config hash is the one most records announce (ties: the one announced at the later round), and the
    round and peer count are those of its records only: a single record of another config (a stray peer,
    or an identity announcing round 10^9 with any hash) neither names the run's config -- a peer of the
    run's own config would then fail at once in ``PeerNode._on_empty_swarm`` -- nor its round. The round is
    the one a strict majority of that config's live records has reached (its leaving records when none is
    live), not the newest one announced: one identity copying the run's config hash at round 10^9 told
    newcomers that round (red team, session 13) -- or, when later, the one a strict majority of all its records
    (live and leaving) reached: the live records alone went back to a peer behind, e.g. a killed peer's record
    at round 11 outliving it while the two others finished round 15 and left (fresh user 46: the bootstrap then
    said the run was at round 11)."""
    recs = list(records)
    if not recs:
        return None
    groups: dict[str, list] = {}
    for r in recs:
        groups.setdefault(r.run_config_hash or "", []).append(r)
    config_hash, mine = max(groups.items(), key=lambda kv: (len(kv[1]), max(r.round for r in kv[1]), kv[0]))

    def reached(pool: list) -> int:
        rounds = sorted((r.round for r in pool), reverse=True)
        return rounds[len(rounds) // 2]  # more than half of the pool is at this round or later

    newest = max(reached([r for r in mine if not getattr(r, "leaving", False)] or mine), reached(mine))
    return SwarmProgress(newest, seen_at, len(mine), by, config_hash, _config_of(mine))


def disowned_rise(rose_from: SwarmProgress, records) -> Optional[bool]:
    """Whether the rounds a bootstrap remembered past ``rose_from`` (its :class:`SwarmProgress` before live records
    raised it) were a fork the peers that trained them disowned: ``records`` (``PeerRecord``-like: ``round``,
    ``leaving``, ``weights_digest``, ``run_config_hash``; the run's, read now) of ``rose_from``'s config past its
    round. True when there are some and each is a leaving record without a digest (``node.report.disowned``: a peer
    left alone ended saying its state is NOT the swarm's); False when one is live or left holding a state (the
    rise stands); None when none is left to tell (expired, or another config).

    Fresh user 48: a peer restarted alone on round 214 trained it alone and ended "NOT the swarm's", exit 3; its
    live record of round 215 had raised the bootstrap's remembered round to 215, the restarted peers then adopted
    that state as the run's."""
    past = [
        r
        for r in records
        if r.round > rose_from.round and (r.run_config_hash or "") == (rose_from.config_hash or r.run_config_hash or "")
    ]
    if not past:
        return None
    return all(getattr(r, "leaving", False) and not getattr(r, "weights_digest", None) for r in past)


def _config_of(records) -> Optional[dict]:
    """The run config most of ``records`` (one config hash) carry, among those whose JSON fits
    :data:`MAX_CONFIG_BYTES` (ties: the one announced at the later round), or None. Not the first one seen: one
    identity copying the run's hash with another config, listed first, was remembered, and readers then dropped
    it (it does not hash to the entry's hash): a newcomer was not told which fields differ (red team, session 16)."""
    votes: dict[str, tuple[int, int, dict]] = {}
    for r in records:
        cfg = getattr(r, "run_config", None)
        if not isinstance(cfg, dict):
            continue
        try:
            text = json.dumps(cfg, sort_keys=True)
        except (TypeError, ValueError, RecursionError):
            continue
        if len(text) > MAX_CONFIG_BYTES:
            continue
        n, rnd, _ = votes.get(text, (0, -1, cfg))
        votes[text] = (n + 1, max(rnd, int(r.round)), cfg)
    if not votes:
        return None
    return max(votes.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0]))[1][2]


async def publish_progress(node: DHTNode, progress: SwarmProgress, identity: Optional[Identity] = None) -> bool:
    """Store ``progress`` under ``<run>/progress``, subkey = this node's PeerID, signed, for 24 h (the
    node republishes it). Returns whether a node accepted it."""
    identity = identity or node.identity
    return await node.store(
        progress_key(node.run_id),
        progress.to_bytes(),
        node.now() + PROGRESS_TTL_S,
        subkey=identity.peer_id.to_string(),
        owner=identity,
    )


async def swarm_progress(node: DHTNode, run_id: Optional[str] = None) -> Optional[SwarmProgress]:
    """The newest :class:`SwarmProgress` published by a bootstrap ``node`` joined through (see the
    module doc), or None when none is known. Malformed entries are skipped."""
    trusted = {pid.to_string() for pid in node.bootstrap_peers}
    if not trusted:
        return None
    found = await node.get(progress_key(run_id or node.run_id))
    best: Optional[SwarmProgress] = None
    for subkey, item in found.items():
        if subkey not in trusted or item.owner is None or item.owner.to_string() != subkey:
            continue
        try:
            p = SwarmProgress.from_bytes(item.value, by=subkey)
        except (ValueError, UnicodeDecodeError):
            continue
        if best is None or (p.round, p.seen_at) > (best.round, best.seen_at):
            best = p
    return best


@dataclass
class BootstrapState:
    """What a bootstrap saves to survive a restart: its run, routing table and the run's progress."""

    run_id: str
    contacts: List[List[str]] = field(default_factory=list)  # [base58 PeerID, "host:port"]
    progress: Optional[dict] = None  # SwarmProgress.fields() (round, seen_at, peers, config_hash)
    saved_at: float = 0.0
    version: int = STATE_VERSION

    @classmethod
    def capture(cls, node: DHTNode, progress: Optional[SwarmProgress]) -> "BootstrapState":
        """This node's routing table (at most MAX_SAVED_CONTACTS contacts) and ``progress``, now."""
        contacts = [[c.peer_id.to_string(), c.address] for c in node.contacts()[:MAX_SAVED_CONTACTS]]
        return cls(node.run_id, contacts, None if progress is None else progress.fields(), time.time())

    def contact_list(self) -> List[Contact]:
        """The saved contacts (malformed entries skipped)."""
        from geomesh_p2p.dht.state import Contact  # here: the module imports hivemind (see the imports above)

        out = []
        for entry in self.contacts:
            try:
                pid_text, address = entry
                pid = PeerID.from_string(pid_text)
            except (ValueError, TypeError):
                continue
            out.append(Contact(pid, str(address)))
        return out

    def swarm_progress(self, by: str = "") -> Optional[SwarmProgress]:
        if not self.progress:
            return None
        try:
            return SwarmProgress.from_bytes(json.dumps(self.progress).encode(), by=by)
        except ValueError:
            return None

    def save(self, path: str) -> None:
        """Write atomically (a temporary file in the same directory, then rename): a crash mid-write
        leaves the previous file. Blocking file I/O: call it in a worker thread. Raises OSError."""

        def write(tmp: str) -> None:
            with open(tmp, "w") as f:
                json.dump(asdict(self), f)

        atomic_write(Path(path).expanduser(), write)

    @classmethod
    def read(cls, path: str) -> Optional["BootstrapState"]:
        """The state file at ``path`` as :meth:`save` wrote it (of any run and version), or None when there is
        no file. Blocking file I/O: call it in a worker thread. Raises :class:`StateFileError` (why, one line)
        when something else is there: a folder, an unreadable file, bytes that are not UTF-8 JSON, or JSON that
        is not an object of the fields :meth:`save` writes (a mistyped ``--state-file`` naming the user's own
        file: the bootstrap must not replace it with its state, red team, session 28)."""
        p = Path(path).expanduser()
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise StateFileError("is a folder, not a bootstrap state file") from None
        except OSError as e:
            raise StateFileError(f"cannot be read: {e.strerror or e}") from None
        try:
            d = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise StateFileError(f"is not a bootstrap state file: not UTF-8 text (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise StateFileError(
                f"is not a bootstrap state file: not JSON ({e.msg}, line {e.lineno} column {e.colno})"
            ) from None
        except (ValueError, RecursionError) as e:  # an integer of 4,300 digits, nesting thousands deep
            raise StateFileError(f"is not a bootstrap state file: not JSON ({e})") from None
        if not isinstance(d, dict):
            raise StateFileError(f"is not a bootstrap state file: JSON {type(d).__name__}, not an object")
        if not _STATE_FIELDS <= d.keys():
            raise StateFileError(f"is not a bootstrap state file: no {', '.join(sorted(_STATE_FIELDS - d.keys()))}")
        progress, saved_at, version = d["progress"], d["saved_at"], d["version"]
        if not (
            isinstance(d["run_id"], str)
            and isinstance(d["contacts"], list)
            and (progress is None or isinstance(progress, dict))
            and isinstance(saved_at, (int, float))
            and not isinstance(saved_at, bool)
            and isinstance(version, int)
            and not isinstance(version, bool)
        ):
            raise StateFileError("is not a bootstrap state file: a field of the wrong type")
        return cls(d["run_id"], list(d["contacts"]), progress, float(saved_at), version)

    @classmethod
    def load(cls, path: str, run_id: str) -> Optional["BootstrapState"]:
        """The state saved at ``path`` for ``run_id``; None when there is none, it is of another run or
        version, or it is not a state file (logged; the CLI refuses that one at start). Blocking file I/O:
        call it in a worker thread."""
        p = Path(path).expanduser()
        try:
            state = cls.read(path)
        except StateFileError as e:
            log.warning("ignoring the saved bootstrap state %s: it %s", p, e)
            return None
        if state is None:
            return None
        if state.version != STATE_VERSION or state.run_id != run_id:
            log.info(
                "ignoring the saved bootstrap state %s: it is of run %r (version %d)", p, state.run_id, state.version
            )
            return None
        return state


class StateFileError(ValueError):
    """A state file that exists but is not one :meth:`BootstrapState.save` wrote; the message says why, to follow
    "<path> " ("is not a bootstrap state file: not UTF-8 text (byte 0)")."""


#: The fields :meth:`BootstrapState.save` writes (every version so far).
_STATE_FIELDS = frozenset({"run_id", "contacts", "progress", "saved_at", "version"})
