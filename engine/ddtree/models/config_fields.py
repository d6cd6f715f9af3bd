"""Reading a config.json: the fields a family cannot do without, refused by name when absent or not a
number, before anything indexes them (a KeyError deep in a loader says nothing to the person who wrote the
file)."""

from __future__ import annotations

from collections.abc import Iterable


def require_fields(cfg: dict, names: Iterable[str], what: str = "config", nullable: Iterable[str] = ()) -> None:
    """ValueError naming the first of `names` that `cfg` lacks (and the others), or the first that is not an
    integer (every required size and count is one); those in `nullable` must be there but may be null."""
    names, nullable = list(names), set(nullable)
    missing = [k for k in names if k not in cfg or (cfg[k] is None and k not in nullable)]
    if missing:
        also = f" (and {', '.join(missing[1:])})" if missing[1:] else ""
        raise ValueError(f"{what} lacks '{missing[0]}'{also}")
    for k in names:
        if cfg[k] is not None and (isinstance(cfg[k], bool) or not isinstance(cfg[k], int)):
            raise ValueError(f"{what} field '{k}' must be an integer, got {cfg[k]!r}")
