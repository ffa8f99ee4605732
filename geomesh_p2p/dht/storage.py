"""A DHT node's local records: what it holds (hivemind's DHTLocalStorage, bounded by a
:class:`~geomesh_p2p.dht.quota.StorageLedger`), how a record offered to it is validated and kept
(:meth:`DHTStorage._store_local`: owner rule, newest expiration wins, unsigned values kept briefly).

Replication to other nodes (store, republish) is :mod:`geomesh_p2p.dht.node`'s.
"""

from __future__ import annotations

import dataclasses
import time
from typing import List, Optional, Tuple

import grpc
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue

from geomesh_p2p.dht.records import RecordError, SignedRecord, verify_record
from geomesh_p2p.net.identity import PeerID
from geomesh_p2p.wire import dht_pb2
from geomesh_p2p.dht.state import DHTNodeState


class DHTStorage(DHTNodeState):
    """Local record storage of a DHT node (see the module doc)."""

    def _held_records(
        self, min_remaining_s: float = 0.0
    ) -> List[Tuple[DHTID, Tuple[DHTID, Optional[str]], SignedRecord]]:
        """Every record this node holds that expires later than now + ``min_remaining_s``."""
        horizon = time.time() + min_remaining_s
        out = []
        for key_id, item in list(self.storage.items()):
            if isinstance(item.value, DictionaryDHTValue):
                for subkey, sub in list(item.value.items()):
                    if sub.expiration_time > horizon:
                        out.append((key_id, (key_id, subkey), SignedRecord.FromString(sub.value)))
            elif item.expiration_time > horizon:
                out.append((key_id, (key_id, None), SignedRecord.FromString(item.value)))
        return out

    def _local_records(self, key_id: DHTID) -> List[SignedRecord]:
        item = self.storage.get(key_id)
        if item is None:
            return []
        if isinstance(item.value, DictionaryDHTValue):
            return [SignedRecord.FromString(sub.value) for _, sub in list(item.value.items())]
        return [SignedRecord.FromString(item.value)]

    def _store_local(self, rec: SignedRecord, *, from_peer: Optional[PeerID]) -> dht_pb2.StoreOutcome:
        """Validate ``rec`` and keep it if it is newer than what this node holds for its slot.

        Never raises: the outcome carries the status code and reason. Note: compares expirations
        before calling DHTLocalStorage, whose TimedStorage.store (hivemind 1.1.12) re-arms the
        eviction of a held newer value at the older expiration when it rejects an older one.
        """
        now = self.now()
        try:
            vr = verify_record(rec, run_id=self.run_id, now=now, limits=self.limits)
            if vr.owner is None and vr.expiration_time > now + self.limits.max_unsigned_ttl_s:
                # an unsigned value is stored for a short while only (nobody is accountable for it)
                rec = SignedRecord()
                rec.CopyFrom(vr.record)
                rec.expiration_time = now + self.limits.max_unsigned_ttl_s
                vr = dataclasses.replace(vr, expiration_time=rec.expiration_time, record=rec)
            if self.store_check is not None and vr.owner is not None:
                # before the subkey count: junk must not take a slot (2,046 junk peer records locked a run's key
                # for 24 h, red team of session 28)
                nonce = int(vr.record.pow_nonce) if vr.record.HasField("pow_nonce") else None
                why = self.store_check(vr.key, vr.subkey, vr.value, vr.owner, nonce)
                if why is not None:
                    raise RecordError(grpc.StatusCode.INVALID_ARGUMENT, why)
            held = self.storage.get(vr.key_id)
            cur_bytes: Optional[bytes] = None
            cur_exp = float("-inf")
            if vr.subkey is None:
                if held is not None and isinstance(held.value, DictionaryDHTValue):
                    if len(held.value) > 0:
                        raise RecordError(
                            grpc.StatusCode.FAILED_PRECONDITION, "key holds values under subkeys; store with a subkey"
                        )
                elif held is not None:
                    cur_bytes = held.value
            elif held is not None:
                if isinstance(held.value, DictionaryDHTValue):
                    sub = held.value.get(vr.subkey)
                    if sub is not None:
                        cur_bytes = sub.value
                    elif len(held.value) >= self.limits.max_subkeys_per_key:
                        raise RecordError(
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"key already holds {self.limits.max_subkeys_per_key} subkeys",
                        )
                else:  # a plain value would be replaced by a dictionary
                    cur_bytes = held.value
            if cur_bytes is not None:
                cur = SignedRecord.FromString(cur_bytes)
                cur_exp = cur.expiration_time  # swarm time (the storage holds it shifted to local time)
                if cur.owner_public_key and cur.owner_public_key != vr.record.owner_public_key:
                    holder = PeerID.from_public_key(cur.owner_public_key).short()
                    raise RecordError(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"slot is held by a record signed by {holder} for {cur_exp - now:.0f}s more",
                    )
                if cur_exp >= vr.expiration_time:
                    if from_peer is not None and cur_exp == vr.expiration_time and self.republish_period_s:
                        self._fresh[(vr.key_id, vr.subkey)] = now
                    if cur_bytes == rec.SerializeToString():
                        # A republish of exactly the record held here: it is stored, nothing to say.
                        return dht_pb2.StoreOutcome(stored=True, code=0, reason="")
                    return dht_pb2.StoreOutcome(
                        stored=False,
                        code=0,
                        # worded for a volunteer who restarted (fresh user, session 37: "reads like an error")
                        reason=f"a replica keeps an earlier store of this slot, which expires "
                        f"{cur_exp - vr.expiration_time:.1f} s after this one (e.g. from before a restart)",
                    )
            data = rec.SerializeToString()
            slot = (vr.key_id, vr.subkey)
            self.ledger.charge(slot, vr.owner, len(data), vr.expiration_time, now)
            stored = self.storage.store(vr.key_id, data, self._to_storage(vr.expiration_time), subkey=vr.subkey)
            if not stored:
                self.ledger.forget(slot)
            elif vr.subkey is not None:
                self.ledger.forget((vr.key_id, None))  # a plain value it replaced, if any
        except RecordError as err:
            self.stats.records_refused += 1
            return dht_pb2.StoreOutcome(stored=False, code=err.code.value[0], reason=err.reason)
        if stored:
            self.stats.stores_accepted += 1
            if from_peer is not None and self.republish_period_s:
                self._fresh[(vr.key_id, vr.subkey)] = now
        return dht_pb2.StoreOutcome(stored=bool(stored), code=0, reason="" if stored else "not stored")
