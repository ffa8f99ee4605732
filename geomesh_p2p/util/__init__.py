"""Small helpers with no project dependencies: asyncio task ownership (:mod:`.aio`), atomic file writes
(:mod:`.atomic`), errors a user can act on (:mod:`.errors`), child processes (:mod:`.procs`), gRPC's C-core
logging (:mod:`.grpc_env`) and capped exponential backoff (:mod:`.backoff`).

Lowest layer: imports nothing else of the project.
"""
