"""The order of one domain's global stream: epoch after epoch, each a shard-aware shuffle.

A domain of ``N`` samples is one endless stream, the same for every topology: position ``p = 0, 1, ...``
is the ``p % N``-th sample of epoch ``p // N``'s order. Global batches take consecutive positions of it
(:mod:`grape_stream.mixing.quotas`) and each rank reads the positions that land in its slots
(:mod:`grape_stream.mixing.rows`), so within an epoch the ranks' samples are disjoint and together cover
the domain exactly once (no padding, no repeats), whatever the number of ranks.

The epoch order is a *block shuffle* in the spirit of streaming's ``py1b``: shards are permuted, their
samples laid end to end, and the result is cut into blocks of ``block_size`` samples whose contents are
shuffled. Samples read together therefore come from a few neighbouring shards (cheap to download and to
cache under ``cache_limit``), while a new seed per epoch reshuffles both levels. Unlike a materialised
epoch permutation, blocks are built lazily and cached, so no process holds an ``N``-sized array: the
cost is O(#shards + block_size) memory per domain, however large the domain.

With ``C`` canonical nodes (``lanes``) the shards, laid out once for the whole run in a shuffled order,
are cut into ``C`` consecutive spans of ``floor(N / C)`` or ``ceil(N / C)`` samples, and lane ``c`` has its
own endless stream over its span: epoch after epoch, the span's shards (and the parts of the one or two it
shares with a neighbour) in a new order, block-shuffled within the span -- streaming's canonical nodes do
the same (its py1* shuffles fix the shard order of a run and reshuffle within each node's span). A node
therefore downloads the ~``#shards / C`` shards of its span plus at most one shard at each end that it
shares with a neighbour, whatever the weights, and the same ones every epoch (a cache that holds them
downloads them once). The spans are disjoint for the whole run, so two lanes never read the same sample
however far apart their epochs are (a lane's epoch advances with its own share of the batches: they are
close but not in lockstep), and every sample is read once per epoch of its lane. ``C = 1`` is the single
global stream, a new order of all the shards every epoch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import numpy as np

from grape_stream.config import SHUFFLE_BLOCK_SIZE
from grape_stream.errors import ConfigError

__all__ = ["DomainOrder", "DEFAULT_BLOCK_SIZE"]

DEFAULT_BLOCK_SIZE = SHUFFLE_BLOCK_SIZE  # stated in grape_stream.config (MixerConfig's default)


class DomainOrder:
    """Maps positions of one domain's endless global stream to (sample id, epoch).

    Args:
        samples_per_shard: number of samples in each shard, in index order.
        seed: 64-bit seed of this domain (derived from the mixer seed and the domain name).
        shuffle: False reads every epoch in index order.
        block_size: shuffle unit in samples (see module docstring).
    """

    def __init__(self, samples_per_shard: np.ndarray, seed: int, shuffle: bool = True,
                 block_size: int = DEFAULT_BLOCK_SIZE, cache_blocks: int = 4, lanes: int = 1) -> None:
        self.samples_per_shard = np.asarray(samples_per_shard, dtype=np.int64)
        if self.samples_per_shard.ndim != 1 or self.samples_per_shard.size == 0:
            raise ValueError("a domain needs at least one shard")
        self.shard_offsets = np.concatenate([[0], np.cumsum(self.samples_per_shard)])
        self.num_samples = int(self.shard_offsets[-1])
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self.shuffle = bool(shuffle)
        if block_size < 1:
            raise ValueError(f"shuffle block size must be >= 1, got {block_size}")
        self.block_size = int(block_size)
        self.epoch_len = self.num_samples
        self._layouts: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._blocks: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()
        self._cache_blocks_base = max(2, int(cache_blocks))
        self.window = 4096
        self._windows: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
        self.set_lanes(lanes)

    def set_lanes(self, lanes: int, name: str = "") -> None:
        """Cut the run's shard layout into ``lanes`` spans, one per canonical node (module docstring)."""
        if lanes < 1 or lanes > self.num_samples:
            raise ConfigError(f"domain {name!r} has {self.num_samples} samples, fewer than canonical_nodes={lanes}: "
                              "every canonical node needs a share of every domain")
        self.lanes = int(lanes)
        self.span_starts = (np.arange(lanes + 1, dtype=np.int64) * self.num_samples) // lanes
        self.lane_lens = np.diff(self.span_starts)
        # a process reading many lanes (one rank of a many-node stream) keeps a block of each: no thrashing
        self._cache_blocks = max(self._cache_blocks_base, 2 * self.lanes)
        self._blocks.clear()
        self._windows.clear()
        self._layouts.clear()
        self._pieces = self._span_pieces() if self.lanes > 1 else []

    def _span_pieces(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per lane: (first sample id, length) of each shard, or part of a shard, of its span of the run's
        shard layout."""
        order = self._rng(2, self.lanes).permutation(self.samples_per_shard.size)
        sizes = self.samples_per_shard[order]
        ends = np.cumsum(sizes)
        begins = ends - sizes
        out = []
        for lo, hi in zip(self.span_starts[:-1].tolist(), self.span_starts[1:].tolist()):
            j0, j1 = np.searchsorted(ends, [lo, hi - 1], side="right").tolist()
            part = slice(j0, j1 + 1)
            b, e = np.maximum(begins[part], lo), np.minimum(ends[part], hi)
            keep = e > b
            out.append(((self.shard_offsets[order[part]] + b - begins[part])[keep], (e - b)[keep]))
        return out

    # ------------------------------------------------------------------------------------------------
    def _rng(self, *coords: int) -> np.random.Generator:
        """``default_rng([seed low, seed high, *coords])``, built from a uint32 array when every coordinate
        fits one word: the same generator (a seed sequence splits each int into 32-bit words, one for any int
        below 2**32) at a third of the cost -- numpy coerces a list of Python ints one by one, which made
        this the largest cost of a process that reads many canonical nodes' shares (one per epoch and
        block of each node it reads)."""
        words = (self.seed & 0xFFFFFFFF, self.seed >> 32, *coords)
        if max(words) <= 0xFFFFFFFF and min(words) >= 0:
            seq = np.random.SeedSequence(np.array(words, dtype=np.uint32))
            return np.random.Generator(np.random.PCG64(seq))
        return np.random.default_rng(list(words))

    @staticmethod
    def _permutation(rng: Callable[[], np.random.Generator], n: int) -> np.ndarray:
        """``rng().permutation(n)``; no generator for one element (its only order: a small domain's span
        inside one shard, read by a process that holds many canonical nodes, has many such)."""
        return rng().permutation(n) if n > 1 else np.zeros(n, np.int64)

    def _layout(self, epoch: int, lane: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(first sample id, first position in the lane's span) of each piece of lane ``lane``'s span in
        epoch ``epoch``: one lane, the domain's shards in a new order; several, the span's pieces in one."""
        key = (epoch, lane)
        hit = self._layouts.get(key)
        if hit is not None:
            self._layouts.move_to_end(key)
            return hit
        if self.lanes == 1:
            order = self._permutation(lambda: self._rng(epoch, 0), self.samples_per_shard.size)
            first, lengths = self.shard_offsets[order], self.samples_per_shard[order]
        else:
            first, lengths = self._pieces[lane]
            order = self._permutation(lambda: self._rng(epoch, 0, self.lanes, lane), first.size)
            first, lengths = first[order], lengths[order]
        self._layouts[key] = (first, np.concatenate([[0], np.cumsum(lengths)[:-1]]))
        while len(self._layouts) > 2 * self.lanes:
            self._layouts.popitem(last=False)
        return self._layouts[key]

    def _block(self, epoch: int, block: int, lane: int) -> np.ndarray:
        key = (epoch, block, lane)
        hit = self._blocks.get(key)
        if hit is not None:
            self._blocks.move_to_end(key)
            return hit
        begin = block * self.block_size
        size = min(self.block_size, int(self.lane_lens[lane]) - begin)
        coords = (epoch, 1, block) if self.lanes == 1 else (epoch, 1, block, self.lanes, lane)
        perm = self._permutation(lambda: self._rng(*coords), size).astype(np.int32 if size < 1 << 31 else np.int64)
        self._blocks[key] = perm
        while len(self._blocks) > self._cache_blocks:
            self._blocks.popitem(last=False)
        return perm

    def epoch_map(self, epoch: int, g: np.ndarray, lane: int = 0) -> np.ndarray:
        """Sample ids at positions ``g`` of lane ``lane``'s span in epoch ``epoch`` (a bijection of the span
        onto its samples; of [0, N) with one lane)."""
        g = np.asarray(g, dtype=np.int64)
        if not self.shuffle:
            return g + int(self.span_starts[lane])
        first, starts = self._layout(epoch, lane)
        blocks = g // self.block_size
        b0, b1 = int(blocks.min()), int(blocks.max())
        if b0 == b1:  # the common case: one block
            out = b0 * self.block_size + self._block(epoch, b0, lane)[g - b0 * self.block_size]
        else:
            out = np.empty_like(g)
            for b in range(b0, b1 + 1):
                sel = blocks == b
                if sel.any():
                    out[sel] = b * self.block_size + self._block(epoch, b, lane)[g[sel] - b * self.block_size]
        j = np.searchsorted(starts, out, side="right") - 1
        return first[j] + (out - starts[j])

    def sample_ids(self, start: int, count: int, lane: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, epochs) of positions ``[start, start + count)`` of lane ``lane``'s stream."""
        return self.ids_at(np.arange(start, start + count, dtype=np.int64), lane)

    def ids_at(self, positions: np.ndarray, lane: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, epochs) of any positions of lane ``lane``'s stream (a rank reads scattered ones)."""
        p = np.asarray(positions, dtype=np.int64)
        if p.size == 0:
            return p.copy(), p.copy()
        n = int(self.lane_lens[lane])
        e0, e1 = int(p.min()) // n, int(p.max()) // n
        if e0 == e1:  # the common case: inside one epoch
            return self.epoch_map(e0, p - e0 * n, lane), np.full(p.shape, e0, np.int64)
        epochs = p // n
        ids = np.empty_like(p)
        for e in range(e0, e1 + 1):
            sel = epochs == e
            if sel.any():
                ids[sel] = self.epoch_map(e, p[sel] - e * n, lane)
        return ids, epochs

    def window_ids(self, start: int, count: int, lane: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`sample_ids` for a reader that walks forward: computed ``window`` positions at a time.

        A rank that reads most positions of a stretch of the stream (few ranks, large batches) reads it in
        small consecutive steps; computing the order for thousands of positions at once makes the cost of
        a step a slice. The returned arrays are read-only views of the cached window.
        """
        win_start, win_ids, win_epochs = self._windows.get(lane, (0, np.empty(0, np.int64), np.empty(0, np.int64)))
        i = start - win_start
        if not (0 <= i and i + count <= len(win_ids)):
            # ``window`` positions split across the lanes (one rank reading many lanes needs a few of each),
            # and at least 16 reads ahead; one lane: the whole window, as before canonical nodes
            ahead = min(self.window, max(16 * count, self.window // self.lanes))
            win_ids, win_epochs = self.sample_ids(start, max(count, ahead), lane)
            win_ids.flags.writeable = False
            win_epochs.flags.writeable = False
            self._windows[lane] = (start, win_ids, win_epochs)
            i = 0
        return win_ids[i:i + count], win_epochs[i:i + count]

    def shard_of(self, sample_ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.shard_offsets, np.asarray(sample_ids, dtype=np.int64), side="right") - 1
