"""Pure index arithmetic: tile-aligned vocabulary shards and CP token layouts.

No torch, no process groups: every rank, the planner and the verifier compute the
same bounds from the same integers.
"""

from __future__ import annotations

from rl_engine.tables import CP_LAYOUTS


class BoundsError(ValueError):
    """A vocabulary or token split that cannot be made exactly."""


def tile_width(padded_vocab: int, num_vocab_tiles: int) -> int:
    """Width of one vocabulary tile; the tile count must divide the padded vocabulary."""
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


def even_vocab_shards(
    padded_vocab: int, num_vocab_tiles: int, tp: int
) -> tuple[tuple[int, int], ...]:
    """Split ``[0, padded_vocab)`` into ``tp`` equal, tile-aligned, half-open shards."""
    if tp <= 0:
        raise BoundsError(f"tp={tp} must be a positive integer")
    width = tile_width(padded_vocab, num_vocab_tiles)
    if num_vocab_tiles % tp != 0:
        shard = padded_vocab / tp
        raise BoundsError(
            f"tp={tp} does not split num_vocab_tiles={num_vocab_tiles} evenly: a shard of "
            f"{shard:g} columns is not a multiple of the tile width {width}, so shards would "
            f"not be tile aligned; use a TP degree that divides {num_vocab_tiles}"
        )
    per_rank = padded_vocab // tp
    return tuple((r * per_rank, (r + 1) * per_rank) for r in range(tp))


def check_vocab_shards(
    bounds: tuple[tuple[int, int], ...], padded_vocab: int, num_vocab_tiles: int
) -> None:
    """Shards must be contiguous in rank order, cover the padded vocabulary and be tile aligned."""
    width = tile_width(padded_vocab, num_vocab_tiles)
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
        if start % width or end % width:
            raise BoundsError(
                f"vocab_shard_bounds[{rank}]=({start}, {end}) is not aligned to the tile width "
                f"{width} (padded_vocab={padded_vocab} / num_vocab_tiles={num_vocab_tiles}); "
                "shards must start and end on tile boundaries"
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
