"""``geomesh-bootstrap``: a stable DHT node that does not train; newcomers dial it with ``--bootstrap``.

Thin over :mod:`geomesh_p2p.dht` (no protocol logic here): see :mod:`bootstrap.cli`. Importing this package
quiets gRPC's C core (:func:`geomesh_p2p.util.grpc_env.quiet_grpc_core`) before :mod:`bootstrap.cli` imports grpc.
"""

from geomesh_p2p.util.grpc_env import quiet_grpc_core

quiet_grpc_core()
