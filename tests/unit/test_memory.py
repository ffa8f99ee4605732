def test_malloc_arenas_are_capped_unless_the_environment_sets_them(monkeypatch):
    """limit_malloc_arenas: glibc's mallopt(M_ARENA_MAX, 2) succeeds (True); a MALLOC_ARENA_MAX in the environment
    is the user's choice and is left alone (False)."""
    from geomesh_p2p.model.memory import limit_malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert limit_malloc_arenas() is True
