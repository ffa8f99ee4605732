"""``geomesh-bootstrap``: a stable DHT node that does not train; newcomers dial it with ``--bootstrap``.

Thin over :mod:`geomesh_p2p.dht` (no protocol logic here): see :mod:`bootstrap.cli`. Importing it quiets
gRPC's C core before grpc is first imported (:func:`peer.quiet_grpc_core`, which runs on import).
"""

import peer  # noqa: F401  (sets GRPC_VERBOSITY=NONE before grpc loads, unless --log-level DEBUG or the user's own)
