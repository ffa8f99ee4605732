"""Configuration: the run and node config models (:mod:`.models`, every default written once), the
command-line flags and config files generated from them (:mod:`.flags`), and what each training method
implies for the exchange and the plan (:mod:`.method`).
"""
