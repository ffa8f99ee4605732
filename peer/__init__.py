"""The ``geomesh-peer`` application: a thin CLI over :mod:`geomesh_p2p` (no protocol logic here)."""
