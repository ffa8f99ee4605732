"""``geomesh-bootstrap``: a stable DHT node that does not train; newcomers dial it with ``--bootstrap``.

Thin over :mod:`geomesh_p2p.dht` (no protocol logic here): see :mod:`bootstrap.cli`.
"""
