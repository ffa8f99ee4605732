"""The ``geomesh-peer`` application: a thin CLI over :mod:`geomesh_p2p` (no protocol logic here).

Importing this package (or its modules) reads nothing of the process: the command line's own start,
:func:`peer.cli.main` run as the program, quiets gRPC's C core (:func:`geomesh_p2p.util.grpc_env.quiet_grpc_core`)
before its first grpc import. The test zygote (tests/zygote.py) preloads these modules before it forks.
"""
