from typing import Any

def untrack_plain(lst: list[Any], start: int = 0) -> bool:
    """Untrack lst (True) when no item from start on is of a GC-tracked type (bytes, str,
    int, float, bool, None, Entry...); else track it (False). start: items before it were
    checked when lst was untracked (ignored while lst is tracked)."""
