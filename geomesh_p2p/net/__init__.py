"""Networking below the protocols: addresses (:mod:`.addr`), Ed25519 identities and signed envelopes
(:mod:`.identity`), the gRPC transport that bounds and verifies every request (:mod:`.transport`), link
bandwidth measured from real transfers (:mod:`.links`) and swarm time (:mod:`.swarm_time`).
"""
