"""This process's memory counters from ``/proc/self/status`` (Linux; torch-free, so the round driver can read
them on its loop thread: one ~2 KB file read, tens of microseconds)."""

from __future__ import annotations

__all__ = ["status_bytes"]


def status_bytes(*fields: str) -> dict[str, int]:
    """The named ``/proc/self/status`` fields (e.g. ``"RssAnon"``, ``"VmHWM"``, ``"RssFile"``) in bytes (the
    file gives kB). A field the kernel does not report, or a system without ``/proc``, is absent from the
    result: callers treat a missing field as "not measured", never as 0."""
    wanted = {f.encode() + b":": f for f in fields}
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                name = wanted.get(line.split(b"\t", 1)[0].split(b" ", 1)[0])
                if name is not None:
                    out[name] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out
