"""Pure index arithmetic: tile-aligned vocabulary shards and CP token layouts.

No torch, no process groups: every rank, the planner and the verifier compute the
same bounds from the same integers.
"""

from __future__ import annotations

import math

from rl_engine.tables import AUTO_TILES as AUTO_TILES  # re-exported: the API and the case import it from here
from rl_engine.tables import CP_LAYOUTS


class BoundsError(ValueError):
    """A vocabulary or token split that cannot be made exactly."""


def tile_width(padded_vocab: int, num_vocab_tiles: int) -> int:
    """Width of one vocabulary tile where the tile count divides the padded vocabulary.

    The campaign's rule (its case and its hash hold a dividing count); the op itself takes any
    vocabulary with :func:`grid_tile_width`, which equals this wherever this answers."""
    if num_vocab_tiles <= 0:
        raise BoundsError(
            f"num_vocab_tiles={num_vocab_tiles} must be a positive integer; use e.g. 64"
        )
    if padded_vocab % num_vocab_tiles != 0:
        raise BoundsError(
            f"num_vocab_tiles={num_vocab_tiles} does not divide padded_vocab={padded_vocab}; "
            f"choose a tile count that divides {padded_vocab} or pad the vocabulary to a "
            f"multiple of {num_vocab_tiles}"
        )
    return padded_vocab // num_vocab_tiles


def grid_tile_width(padded_vocab: int, num_vocab_tiles: int) -> int:
    """Width ``w = ceil(Vp / T)`` of the tile grid of any vocabulary (docs/arithmetic.md section 6).

    Tile ``j`` is columns ``[j * w, (j + 1) * w)``; the grid's columns ``[Vp, T * w)`` (fewer than
    ``T``, all in the last tile) are padding that no caller stores: they read as ``-inf``, so they
    add nothing, and a vocabulary padded by hand to ``T * w`` columns gives the same bytes. A count
    that leaves a tile with no column of the vocabulary (``(T - 1) * w >= Vp``) is refused."""
    if num_vocab_tiles <= 0:
        raise BoundsError(
            f"num_vocab_tiles={num_vocab_tiles} must be a positive integer; use e.g. 64"
        )
    width = -(-padded_vocab // num_vocab_tiles)
    if (num_vocab_tiles - 1) * width >= padded_vocab:
        raise BoundsError(
            f"num_vocab_tiles={num_vocab_tiles} leaves its last tile with no column of padded_vocab="
            f"{padded_vocab} (tiles of ceil({padded_vocab} / {num_vocab_tiles}) = {width} columns); use "
            f"fewer tiles (at most {math.isqrt(padded_vocab)} always works) or a count that divides "
            f"{padded_vocab}"
        )
    return width


AUTO_MAX_TILE_WIDTH = 4096  # columns: a bf16 tile in 8 KiB, its binary32 upcast in 16 KiB (a core's L1)
AUTO_MIN_TILE_WIDTH = 128  # columns: one column per lane of the 128-lane sums (docs/arithmetic.md)
AUTO_TILES_RULE = (f"the smallest multiple of max_tp that divides the padded vocabulary with tiles of at most "
                   f"{AUTO_MAX_TILE_WIDTH} columns, and of at least {AUTO_MIN_TILE_WIDTH} (or padded_vocab // "
                   "max_tp where that is smaller)")
AUTO_TILES_RULE_ANY = (f"{AUTO_TILES_RULE}; where none divides it, the smallest multiple of max_tp whose tiles of "
                       f"ceil(padded_vocab / tiles) columns are at most {AUTO_MAX_TILE_WIDTH} wide, the last "
                       "tile's columns past the vocabulary being padding")


def auto_vocab_tiles(padded_vocab: int, max_tp: int, *, divisible: bool = False) -> int:
    """``num_vocab_tiles="auto"``: :data:`AUTO_TILES_RULE_ANY` (the op's), or with ``divisible`` the
    campaign's :data:`AUTO_TILES_RULE`, which refuses a vocabulary with no dividing count, naming
    the padding that has one. Every TP degree dividing ``max_tp`` splits the tiles evenly, so TP 1
    and TP ``max_tp`` compute with the same tiles (the same bytes); a dividing count is taken
    wherever one exists, so the count (and the bytes) of such a vocabulary is the same under both
    rules."""
    for name, value in (("padded_vocab", padded_vocab), ("max_tp", max_tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BoundsError(f"{name}={value!r} must be a positive integer")
    tiles = _auto(padded_vocab, max_tp)
    if tiles is not None:
        return tiles
    if not divisible:
        tiles = _auto_any(padded_vocab, max_tp)
        if tiles is not None:
            return tiles
        raise BoundsError(
            f"num_vocab_tiles='auto' has no tile count for padded_vocab={padded_vocab} and max_tp={max_tp} "
            f"({AUTO_TILES_RULE_ANY}): every count leaves a tile or a TP rank without a column; use a "
            "smaller max_tp or give num_vocab_tiles explicitly")
    start = -(-padded_vocab // max_tp) * max_tp
    padded = next(v for v in range(start, start + AUTO_MAX_TILE_WIDTH * max_tp + 1, max_tp)
                  if _auto(v, max_tp) is not None)  # max_tp * 4096 columns at the latest
    raise BoundsError(
        f"num_vocab_tiles='auto' has no tile count for padded_vocab={padded_vocab} and max_tp={max_tp} "
        f"({AUTO_TILES_RULE}); pad the vocabulary (padded_vocab_size={padded}, the smallest that has one, "
        "or a model's own padding such as a multiple of 128) or give num_vocab_tiles explicitly")


def _auto(padded_vocab: int, max_tp: int) -> int | None:
    narrowest = min(AUTO_MIN_TILE_WIDTH, padded_vocab // max_tp)
    for tiles in range(max_tp, padded_vocab + 1, max_tp):
        if padded_vocab % tiles == 0 and padded_vocab // tiles <= AUTO_MAX_TILE_WIDTH:
            return tiles if padded_vocab // tiles >= narrowest else None
    return None


def _auto_any(padded_vocab: int, max_tp: int) -> int | None:
    tiles = max_tp * -(-padded_vocab // (AUTO_MAX_TILE_WIDTH * max_tp))  # the first with w <= 4096
    try:
        grid_tile_width(padded_vocab, tiles)
    except BoundsError:
        return None  # a vocabulary of fewer than about max_tp ** 2 columns
    return tiles


def even_vocab_shards(
    padded_vocab: int, num_vocab_tiles: int, tp: int
) -> tuple[tuple[int, int], ...]:
    """Split the tile grid into ``tp`` tile-aligned, half-open shards of ``num_vocab_tiles / tp``
    tiles each: rank ``r`` holds columns ``[r k w, min((r + 1) k w, Vp))`` (``k`` tiles of ``w``
    columns). Where the tiles divide the vocabulary the shards are equal; otherwise the last
    rank's is narrower by the grid's padding (its columns past ``Vp`` are nobody's)."""
    if tp <= 0:
        raise BoundsError(f"tp={tp} must be a positive integer")
    width = grid_tile_width(padded_vocab, num_vocab_tiles)
    if num_vocab_tiles % tp != 0:
        shard = padded_vocab / tp
        raise BoundsError(
            f"tp={tp} does not split num_vocab_tiles={num_vocab_tiles} evenly: a shard of "
            f"{shard:g} columns is not a multiple of the tile width {width}, so shards would "
            f"not be tile aligned; use a TP degree that divides {num_vocab_tiles}"
        )
    per_rank = num_vocab_tiles // tp * width
    return tuple((r * per_rank, min((r + 1) * per_rank, padded_vocab)) for r in range(tp))


def check_vocab_shards(
    bounds: tuple[tuple[int, int], ...], padded_vocab: int, num_vocab_tiles: int
) -> None:
    """Shards must be contiguous in rank order, cover the padded vocabulary and be tile aligned
    (each ends on a tile boundary, the last at the vocabulary's end)."""
    width = grid_tile_width(padded_vocab, num_vocab_tiles)
    expected_start = 0
    for rank, pair in enumerate(bounds):
        if len(pair) != 2:
            raise BoundsError(f"vocab_shard_bounds[{rank}]={pair!r} must be a (start, end) pair")
        start, end = pair
        if start != expected_start:
            raise BoundsError(
                f"vocab_shard_bounds[{rank}] starts at {start} but must start at {expected_start}: "
                "shards are half-open, contiguous and in rank order"
            )
        if end <= start:
            raise BoundsError(
                f"vocab_shard_bounds[{rank}]=({start}, {end}) is empty; every TP rank needs "
                "at least one tile"
            )
        if start % width or (end % width and end != padded_vocab):
            raise BoundsError(
                f"vocab_shard_bounds[{rank}]=({start}, {end}) is not aligned to the tile width "
                f"{width} (ceil(padded_vocab={padded_vocab} / num_vocab_tiles={num_vocab_tiles})); "
                "shards must start and end on tile boundaries (the last may end at padded_vocab)"
            )
        expected_start = end
    if expected_start != padded_vocab:
        raise BoundsError(
            f"vocab_shard_bounds end at {expected_start} but must cover [0, {padded_vocab})"
        )


def cp_chunks_per_sequence(cp: int, layout: str) -> int:
    if layout not in CP_LAYOUTS:
        raise BoundsError(f"cp_layout={layout!r} is unknown; use one of {list(CP_LAYOUTS)}")
    return cp if layout == "contiguous" else 2 * cp


def check_cp_split(seq_len: int, cp: int, layout: str) -> None:
    chunks = cp_chunks_per_sequence(cp, layout)
    if seq_len % chunks != 0:
        raise BoundsError(
            f"seq_len={seq_len} cannot be split into {chunks} equal chunks for cp={cp} with "
            f"cp_layout={layout!r}; use a sequence length that is a multiple of {chunks}"
        )


def sequence_positions(seq_len: int, cp: int, cp_rank: int, layout: str) -> tuple[int, ...]:
    """Positions within one sequence held by ``cp_rank``, in the rank's local order."""
    check_cp_split(seq_len, cp, layout)
    if not 0 <= cp_rank < cp:
        raise BoundsError(f"cp_rank={cp_rank} must lie in [0, {cp})")
    chunks = cp_chunks_per_sequence(cp, layout)
    width = seq_len // chunks
    owned = [cp_rank] if layout == "contiguous" else [cp_rank, chunks - 1 - cp_rank]
    return tuple(p for c in owned for p in range(c * width, (c + 1) * width))


def token_indices(
    sequences: tuple[int, ...] | range, seq_len: int, cp: int, cp_rank: int, layout: str
) -> tuple[int, ...]:
    """Global flat token indices (``sequence * seq_len + position``) held by ``cp_rank``.

    Local rows are ordered sequence-major, then by the rank's positions.
    """
    positions = sequence_positions(seq_len, cp, cp_rank, layout)
    return tuple(s * seq_len + p for s in sequences for p in positions)
