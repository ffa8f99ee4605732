"""A training peer, composed: :mod:`.peer` wires DHT, capability, round protocol, exchange and inner training
together and owns their lifecycle (start, serve, stop). Top layer of the library.
"""
