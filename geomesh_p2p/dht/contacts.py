"""Who a DHT node knows: admission of contacts into its routing table (a caller is pinged back at the
address it claims first; at most ``max_contacts_per_ip`` identities per IP and ``max_contacts_per_subnet``
per /24, IPv6 /48), failures and eviction (blacklist, Kademlia 4.1), replacement lists bounded to k per
bucket, and the hand-over of records to a newcomer that is now among their nearest nodes.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from typing import TYPE_CHECKING, List, Optional, Tuple

import grpc
from hivemind.dht.routing import DHTID

from geomesh_p2p import __version__
from geomesh_p2p.net.addr import host_of, ip_of
from geomesh_p2p.dht.records import SignedRecord
from geomesh_p2p.net.identity import PeerID
from geomesh_p2p.net.transport import RpcError
from geomesh_p2p.net.methods import DHT_PING
from geomesh_p2p.wire import dht_pb2
from geomesh_p2p.dht.state import DHT_PROTOCOL_VERSION, Contact, DHTJoinError
from geomesh_p2p.dht.storage import DHTStorage

# The node was one module: its parts log under that logger name (operators filter on it).
log = logging.getLogger("geomesh_p2p.dht.node")


class DHTContacts(DHTStorage):
    """Routing table upkeep of a DHT node (see the module doc)."""

    if TYPE_CHECKING:  # provided by the layers above (protocol.py); declared for the type checker

        async def _call(
            self, contact_or_address, method: str, request, response_cls, expected: Optional[PeerID] = None
        ): ...

        async def ping(self, address: str, *, expected: Optional[PeerID] = None) -> Contact: ...

        async def _send_records(
            self, contact: Contact, records: List[SignedRecord]
        ) -> Optional[List[dht_pb2.StoreOutcome]]: ...

    def _on_contact(self, contact: Contact) -> None:
        """``contact`` answered us at its address: add it (Kademlia 2.2) unless its IP or subnet already
        has its share of the table, and push it the values it should hold."""
        if contact.peer_id == self.peer_id:
            return
        node_id = contact.node_id
        self.blacklist.register_success(contact.peer_id)
        self._failures.pop(contact.peer_id, None)
        self._removed.pop(contact.address, None)
        old = self.routing_table.get(node_id=node_id)  # None: not in the table (nor a replacement)
        known = old == contact  # the usual case: a node we know answers or calls again
        if not known and not self._admissible(contact):
            self.stats.contacts_refused += 1
            return
        if old is None and self._started and self._alive:
            self._hand_over(node_id, contact)
        if old is not None and not known:
            self._forget(node_id)
        to_ping = self.routing_table.add_or_update_node(node_id, contact)
        if not known:  # a known node only moves within its list: no list grew
            self._trim_replacements(node_id)
        if to_ping is not None and self._alive and self._started:
            ping_id, ping_contact = to_ping
            if ping_id not in self._pinging:
                self._pinging.add(ping_id)
                self.tasks.spawn(self._check_stale(ping_id, ping_contact), name="dht-ping-stale")

    @staticmethod
    def _groups(address: str) -> Tuple[str, Optional[str], bool]:
        """(IP or host name, subnet or None, is loopback) of a ``host:port`` address."""
        host = host_of(address)
        ip = ip_of(host)
        if ip is None:
            return host.lower(), None, host.lower() == "localhost"
        if ip.is_loopback or ip.is_private or ip.is_link_local:
            return str(ip), None, ip.is_loopback
        bits = 24 if ip.version == 4 else 48
        return str(ip), str(ipaddress.ip_network(f"{ip}/{bits}", strict=False)), False

    def _admissible(self, contact: Contact) -> bool:
        """Whether the table (with replacements) has room for one more identity at this IP and subnet."""
        ip, subnet, loopback = self._groups(contact.address)
        per_ip = self.max_contacts_per_ip if (self.limit_loopback or not loopback) else 0
        per_subnet = self.max_contacts_per_subnet if subnet is not None else 0
        if not per_ip and not per_subnet:
            return True
        n_ip = n_subnet = 0
        for c in self.routing_table.uid_to_peer_id.values():
            if c.peer_id == contact.peer_id:
                continue
            cip, csub, _ = self._groups(c.address)
            n_ip += cip == ip
            n_subnet += subnet is not None and csub == subnet
        if per_ip and n_ip >= per_ip:
            self._once(logging.INFO, f"routing table {ip}", f"already holds {n_ip} nodes at {ip}; not adding more")
            return False
        if per_subnet and n_subnet >= per_subnet:
            self._once(
                logging.INFO, f"routing table {subnet}", f"already holds {n_subnet} nodes in {subnet}; not adding more"
            )
            return False
        return True

    def _trim_replacements(self, node_id: DHTID) -> None:
        """hivemind keeps every replacement candidate of a full bucket: keep the k most recent."""
        bucket = self.routing_table.buckets[self.routing_table.get_bucket_index(node_id)]
        while len(bucket.replacement_nodes) > self.k:
            old_id = next(iter(bucket.replacement_nodes))
            self._forget(old_id)

    def _check_contact(self, contact: Contact) -> None:
        """An unknown node called us naming ``contact.address``: ping it back there (in the background)
        and add it only if it answers, signed by the same PeerID. Bounded: one check per PeerID, at
        most ``max_contact_checks`` at once, an address that did not answer is not tried again for
        ``refresh_period_s``.

        Unlike CheckReachable it may dial an address of another IP than the caller's (a node behind a
        NAT or multi-homed calls out from another IP than it serves on), because it tells the caller
        nothing: the call that named the address was answered before the ping, whose outcome is never
        sent back, and the node is added only when the reply is signed by the caller's own PeerID
        (nobody else's answer can show up in the routing table). Dialling addresses other nodes name is
        Kademlia's lookup anyway (find replies list contacts that are then dialled)."""
        if not self._alive or contact.peer_id in self._checking:
            return
        failed_at = self._unanswered.get(contact.address)
        if failed_at is not None:
            if time.monotonic() - failed_at < self.refresh_period_s:
                return
            del self._unanswered[contact.address]
        if len(self._checking) >= self.max_contact_checks or not self._admissible(contact):
            self.stats.contacts_refused += 1
            return
        self._checking[contact.peer_id] = contact.address
        self.stats.contacts_checked += 1
        self.tasks.spawn(self._ping_back(contact), name="dht-check-contact")

    async def _ping_back(self, contact: Contact) -> None:
        # Not self.ping(): a caller that lied about its address is not blacklisted or counted as a failure
        # of a known node (those tables would grow with every fake identity).
        req = dht_pb2.PingRequest(
            sender=self.self_info(), dht_protocol=DHT_PROTOCOL_VERSION, software_version=__version__
        )
        try:
            answered, resp = await self._call(contact.address, DHT_PING, req, dht_pb2.PingResponse, contact.peer_id)
            if resp.dht_protocol != DHT_PROTOCOL_VERSION:
                raise RpcError(
                    contact.address,
                    DHT_PING,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"speaks DHT protocol {resp.dht_protocol}",
                )
            self._on_contact(answered)
        except RpcError as err:
            self.stats.contacts_unverified += 1
            self._unanswered[contact.address] = time.monotonic()
            while len(self._unanswered) > 4096:
                self._unanswered.popitem(last=False)
            log.debug("caller %r did not answer at its address: %s", contact, err)
        finally:
            self._checking.pop(contact.peer_id, None)

    def _forget(self, node_id: DHTID) -> None:
        try:
            del self.routing_table[node_id]
        except KeyError:
            pass

    def _on_failure(self, contact: Contact) -> None:
        """``contact`` did not answer: skip it for a while (blacklist with backoff) and drop it from the
        routing table after ``max_failures`` failures in a row, or at once when its bucket has a
        replacement waiting (Kademlia 4.1: do not empty the table on a transient outage)."""
        self.stats.rpc_failures += 1
        self.blacklist.register_failure(contact.peer_id)
        if len(self._failures) > 64 * self.k:  # bound the memory of peers met once and gone
            self._failures.clear()
        n = self._failures[contact.peer_id] = self._failures.get(contact.peer_id, 0) + 1
        node_id = contact.node_id
        if self.routing_table.get(node_id=node_id) != contact:
            return
        bucket = self.routing_table.buckets[self.routing_table.get_bucket_index(node_id)]
        if n >= self.max_failures or bucket.replacement_nodes:
            self._forget(node_id)
            self._failures.pop(contact.peer_id, None)
            self._removed[contact.address] = contact
            while len(self._removed) > 4 * self.k:
                self._removed.pop(next(iter(self._removed)))

    async def _check_stale(self, node_id: DHTID, contact: Contact) -> None:
        """A bucket is full: ping its least recently seen node; drop it if silent (its replacement moves in)."""
        try:
            await self.ping(contact.address, expected=contact.peer_id)
        except (RpcError, DHTJoinError):
            pass
        finally:
            self._pinging.discard(node_id)

    def _hand_over(self, new_id: DHTID, contact: Contact) -> None:
        """Send a newcomer the records it is now among the nearest for, when this node is the nearest
        holder it knows (hivemind DHTProtocol.update_routing_table; Kademlia section 2.5)."""
        records: List[SignedRecord] = []
        for key_id, _slot, rec in self._held_records(min_remaining_s=self.rpc_timeout_s):
            replicas = self.replicas_for(rec.key)  # fewer for peer records (PEER_RECORD_REPLICAS)
            neighbors = self.routing_table.get_nearest_neighbors(key_id, replicas, exclude=self.node_id)
            if neighbors:
                if new_id.xor_distance(key_id) >= neighbors[-1][0].xor_distance(key_id) and len(neighbors) >= replicas:
                    continue
                if self.node_id.xor_distance(key_id) >= neighbors[0][0].xor_distance(key_id):
                    continue
            records.append(rec)
        if records:
            self.tasks.spawn(self._send_records(contact, records), name="dht-hand-over")
