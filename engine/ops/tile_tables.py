"""Validation of the deterministic projections' tile tables (`engine.ops.invariant`): each table
is checked once, memoized by value and type, and a malformed one refused by name; and how Triton
lays a norm prologue's tile out along K (`k_layout`), which decides whether two tiles sum a row's
squares in one order."""

from __future__ import annotations

from engine.ops.prologue import tile_width

ROW_BLOCKS_M = (16, 32, 64)  # mma.sync's row blocks, then the warp-group MMA's
PREFILL_BLOCKS_M = (16, 32, 64, 128)  # BLOCK_M of PREFILL_TILES, HEAD_TILES and LARGE_TILES


def by_value(check):
    """check(table) memoized by repr (True == 1 but not alike), the last table by identity."""
    seen: dict[str, object] = {}
    last: list = [None, None]

    def checked(table):
        if table is not last[0]:
            key = repr(table)
            last[:] = table, seen.get(key) or seen.setdefault(key, check(table))
        return last[1]
    return checked


@by_value
def valid_row_tiles(table) -> tuple[tuple[int, int, int], ...]:
    """table if it is a valid ROW_TILES, else ValueError."""
    form = "((max_rows, BLOCK_M, BLOCK_N), ...) of ints in increasing max_rows"
    if not isinstance(table, tuple) or not table:
        raise ValueError(f"ROW_TILES must be None or {form}, not {table!r}")
    last = 0
    for entry in table:
        if (not isinstance(entry, tuple) or len(entry) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)):
            raise ValueError(f"ROW_TILES entry {entry!r} is not (max_rows, BLOCK_M, BLOCK_N)")
        rows, bm, bn = entry
        if rows <= last:
            raise ValueError(f"ROW_TILES max_rows must increase from 1: {rows} after {last}")
        if bm not in ROW_BLOCKS_M:
            raise ValueError(f"ROW_TILES BLOCK_M {bm} not in {ROW_BLOCKS_M}")
        if not tile_width(bn):
            raise ValueError(f"ROW_TILES BLOCK_N {bn} is not a power of two >= 16")
        last = rows
    return table


@by_value
def valid_large_tiles(table):
    """table if a valid LARGE_TILES, else ValueError (once a table, not per launch)."""
    ok = isinstance(table, tuple) and len(table) > 0 and all(
        isinstance(e, tuple) and len(e) == 3 and type(e[1]) is int and e[1] >= 0
        and isinstance(e[2], tuple) and len(e[2]) == 5
        and all(type(v) is int and v > 0 for v in e[2])
        and wide_tile(e[2][0], e[2][1], e[2][4]) and tile_width(e[2][2]) for e in table)
    bounds = [e[0] for e in table] if ok else []
    if not (ok and bounds[-1] is None and table[-1][1] == 0
            and all(type(b) is int and b >= 1 for b in bounds[:-1])
            and bounds[:-1] == sorted(bounds[:-1])):
        raise ValueError(f"LARGE_TILES must be ((max_rows, min_cols, (BLOCK_M, BLOCK_N, BLOCK_K, "
                         f"STAGES, warps)), ..., (None, 0, tiles)), max_rows never decreasing, "
                         f"not {table!r}")
    return table


def k_layout(bm: int, bk: int, warps: int, keys: int = 8) -> tuple[int, int] | None:
    """How Triton lays a norm prologue's [bm, bk] tile of x along K at `warps`: (threads, warps)
    along K after `keys` a thread (16 bytes: 8 of bf16, 4 of fp32), the rest along the rows;
    None where they would not fit bm rows (Triton then lays it out otherwise). Tiles of one bk
    with the same layout sum a row's squares in the same order; another count along K is
    another order."""
    lanes = min(32, max(1, bk // keys))
    along = min(warps, max(1, bk // (keys * lanes)))
    if warps % along or (32 // lanes) * (warps // along) > bm:
        return None
    return lanes, along


def wide_tile(bm: int, bn: int, warps: int) -> bool:
    """Whether a PREFILL_TILES, HEAD_TILES or LARGE_TILES entry's BLOCK_M, BLOCK_N and warps are
    allowed."""
    return bm in PREFILL_BLOCKS_M and tile_width(bn) and warps in (4, 8)
