"""The ``geomesh-peer`` application: a thin CLI over :mod:`geomesh_p2p` (no protocol logic here).

Importing this package quiets gRPC's C core (:func:`geomesh_p2p.util.grpc_env.quiet_grpc_core`): the console
script imports grpc while its modules load, and the C core reads ``GRPC_VERBOSITY`` only then.
"""

from geomesh_p2p.util.grpc_env import quiet_grpc_core

quiet_grpc_core()

__all__ = ["quiet_grpc_core"]
