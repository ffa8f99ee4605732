"""Storage quotas of a DHT node: bytes held per owner, per key, for unsigned values and in total.

A node's local storage (hivemind's ``DHTLocalStorage``) is filled by whoever calls Store, so without
quotas one identity can fill any node's memory (measured on the first version: 512 MiB of unsigned
64 KiB records with a 24 h lifetime stored on a bootstrap in 7.2 s, then republished to every
honest peer). The :class:`StorageLedger` counts the serialized size of every record held, by slot
``(key id, subkey)``, and refuses with RESOURCE_EXHAUSTED a record that would take:

* its signer over ``max_owner_bytes`` or ``max_owner_records`` (signed records);
* all unsigned records together over ``max_unsigned_bytes`` (they also live at most
  ``RecordLimits.max_unsigned_ttl_s``, and only under keys outside the run's own);
* its key (all subkeys together) over ``max_key_bytes``;
* the node over ``max_total_bytes``.

A record replacing one in the same slot is charged only the difference. Expired entries are dropped
lazily (a heap ordered by expiration). Units: bytes, unix seconds.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import grpc
from hivemind.dht.routing import DHTID

from geomesh_p2p.dht.records import RecordError
from geomesh_p2p.net.identity import PeerID

Slot = Tuple[DHTID, Optional[str]]


@dataclass(frozen=True)
class StorageQuota:
    """How much one node stores. Units: bytes. Legitimate use per peer: one capability record
    (~1-2 KB) plus, for a leader, a plan per round for the plan lifetime (a few KB each)."""

    max_total_bytes: int = 64 << 20
    max_owner_bytes: int = 2 << 20
    max_owner_records: int = 512
    max_key_bytes: int = 8 << 20
    max_unsigned_bytes: int = 4 << 20


DEFAULT_QUOTA = StorageQuota()


class StorageLedger:
    """Bytes held per owner, per key, unsigned and in total (see the module docstring)."""

    def __init__(self, quota: StorageQuota = DEFAULT_QUOTA):
        self.quota = quota
        self._slots: Dict[Slot, Tuple[Optional[bytes], int, float]] = {}  # slot -> (owner, bytes, expiration)
        self._heap: List[Tuple[float, int, Slot]] = []
        self._seq = 0
        self.total = 0
        self.unsigned = 0
        self._owner_bytes: Dict[bytes, int] = {}
        self._owner_records: Dict[bytes, int] = {}
        self._key_bytes: Dict[DHTID, int] = {}
        self.refused = 0

    def purge(self, now: float) -> None:
        """Forget entries that expired by ``now``."""
        while self._heap and self._heap[0][0] <= now:
            exp, _, slot = heapq.heappop(self._heap)
            cur = self._slots.get(slot)
            if cur is not None and cur[2] == exp:
                self._remove(slot)

    def _remove(self, slot: Slot) -> None:
        owner, size, _exp = self._slots.pop(slot)
        self.total -= size
        k = self._key_bytes[slot[0]] - size
        if k > 0:
            self._key_bytes[slot[0]] = k
        else:
            del self._key_bytes[slot[0]]
        if owner is None:
            self.unsigned -= size
        else:
            b = self._owner_bytes[owner] - size
            n = self._owner_records[owner] - 1
            if n > 0:
                self._owner_bytes[owner], self._owner_records[owner] = b, n
            else:
                del self._owner_bytes[owner], self._owner_records[owner]

    def forget(self, slot: Slot) -> None:
        """The slot's record is gone from storage (evicted or replaced outside the ledger)."""
        if slot in self._slots:
            self._remove(slot)

    def _refuse(self, reason: str) -> RecordError:
        self.refused += 1
        return RecordError(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)

    def charge(self, slot: Slot, owner: Optional[PeerID], size: int, expiration_time: float, now: float) -> None:
        """Account a record of ``size`` bytes for ``slot`` (replacing what the slot held), or raise
        RecordError(RESOURCE_EXHAUSTED) naming the quota it would break (and change nothing)."""
        self.purge(now)
        q = self.quota
        okey = bytes(owner) if owner is not None else None
        old_owner, old_size, _ = self._slots.get(slot, (None, 0, 0.0))
        had = slot in self._slots
        same_owner = had and old_owner == okey
        total = self.total - old_size + size
        key_bytes = self._key_bytes.get(slot[0], 0) - old_size + size
        if okey is None:
            unsigned = self.unsigned - (old_size if had and old_owner is None else 0) + size
            if unsigned > q.max_unsigned_bytes:
                raise self._refuse(
                    f"unsigned values on this node would take {unsigned} bytes, over the quota of "
                    f"{q.max_unsigned_bytes}"
                )
        else:
            assert owner is not None  # okey is bytes(owner)
            ob = self._owner_bytes.get(okey, 0) - (old_size if same_owner else 0) + size
            orec = self._owner_records.get(okey, 0) + (0 if same_owner else 1)
            if ob > q.max_owner_bytes or orec > q.max_owner_records:
                raise self._refuse(
                    f"records signed by {owner.short()} would take {ob} bytes in {orec} records on this "
                    f"node, over the quota of {q.max_owner_bytes} bytes / {q.max_owner_records} records"
                )
        if key_bytes > q.max_key_bytes:
            raise self._refuse(f"the key would hold {key_bytes} bytes, over the quota of {q.max_key_bytes} per key")
        if total > q.max_total_bytes:
            raise self._refuse(f"this node's DHT storage is full ({self.total} of {q.max_total_bytes} bytes)")
        if had:
            self._remove(slot)
        self._slots[slot] = (okey, size, expiration_time)
        self.total += size
        self._key_bytes[slot[0]] = self._key_bytes.get(slot[0], 0) + size
        if okey is None:
            self.unsigned += size
        else:
            self._owner_bytes[okey] = self._owner_bytes.get(okey, 0) + size
            self._owner_records[okey] = self._owner_records.get(okey, 0) + 1
        self._seq += 1
        heapq.heappush(self._heap, (expiration_time, self._seq, slot))
        if len(self._heap) > 4 * len(self._slots) + 1024:  # drop the stale heap entries of replaced slots
            self._heap = [(e, i, s) for e, i, s in self._heap if self._slots.get(s, (None, 0, None))[2] == e]
            heapq.heapify(self._heap)

    def owner_bytes(self, owner: PeerID) -> int:
        return self._owner_bytes.get(bytes(owner), 0)

    def __len__(self) -> int:
        return len(self._slots)
