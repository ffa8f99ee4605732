"""Config-file support of the CLIs, now in the library (:mod:`geomesh_p2p.config.flags`); re-exported here
for the callers and tests that import it from ``peer.config``."""

from __future__ import annotations

from geomesh_p2p.config.flags import ConfigFileError, load_config_defaults

__all__ = ["ConfigFileError", "load_config_defaults"]
