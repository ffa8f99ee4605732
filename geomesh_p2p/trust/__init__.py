"""Trust in an open swarm: admission of identities (:mod:`.admission`), probation of new identities
(:mod:`.probation`), standing from delivered work (:mod:`.standing`) and verified work (:mod:`.verify`).
DESIGN.md "Identity and trust" and "Untrusted volunteers".
"""
