"""Prefix caching across requests: a radix tree over page-aligned token blocks.

A finished request's KV sequence is not dropped: cut to its full 16-token pages, it is *parked*
as a cache entry, and its blocks (16 token ids each) are inserted into a radix tree whose nodes
list the entries holding that path. A new prompt walks the tree block by block; the deepest
match names an entry, and the request's sequence is ``engine.fork_sequence(entry, depth * 16)``:
it shares those pages with the entry (the paged KV cache counts references to every page, so an
entry may be evicted while forks of it still use its pages) and prefills only the rest.

Entries are evicted least-recently-used, those no running sequence was forked from first, when
the scheduler needs room (:meth:`PrefixCache.evict_one`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

PAGE = 16  # tokens per KV page (the engine's paged cache)


@dataclass(eq=False)
class Entry:
    """A parked sequence holding ``tokens`` (whole pages) in the KV cache."""

    seq_id: int
    tokens: tuple[int, ...]
    last_used: int = 0
    refs: int = 0  # running sequences forked from it

    @property
    def pages(self) -> int:
        return len(self.tokens) // PAGE


@dataclass(eq=False)
class _Node:
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    entries: list[Entry] = field(default_factory=list)  # entries whose path passes here


class PrefixCache:
    """Parked sequences indexed by their page-aligned token blocks."""

    def __init__(self) -> None:
        self._root = _Node()
        self._entries: list[Entry] = []
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[Entry]:
        return list(self._entries)

    @staticmethod
    def _blocks(tokens: list[int] | tuple[int, ...], limit: int) -> list[tuple[int, ...]]:
        n = min(len(tokens), limit) // PAGE
        return [tuple(tokens[i * PAGE : (i + 1) * PAGE]) for i in range(n)]

    def match(self, tokens: list[int], limit: int | None = None) -> tuple[Entry | None, int]:
        """The entry sharing the longest page-aligned prefix of ``tokens[:limit]`` and that
        prefix's length in tokens (0 and None when nothing matches)."""
        node, best, depth = self._root, None, 0
        for block in self._blocks(tokens, len(tokens) if limit is None else limit):
            child = node.children.get(block)
            if child is None or not child.entries:
                break
            node, depth = child, depth + 1
            best = child.entries[-1]
        return best, depth * PAGE

    def touch(self, entry: Entry) -> None:
        """Mark ``entry`` used now (LRU order)."""
        entry.last_used = next(self._clock)

    def insert(self, seq_id: int, tokens: list[int]) -> Entry | None:
        """Park ``seq_id`` holding ``tokens`` (a multiple of :data:`PAGE`); None (nothing parked)
        when the tree already holds all of them: the caller drops the sequence instead."""
        assert len(tokens) % PAGE == 0
        if not tokens or self.match(tokens)[1] >= len(tokens):
            return None
        entry = Entry(seq_id, tuple(tokens))
        self.touch(entry)
        node = self._root
        for block in self._blocks(tokens, len(tokens)):
            node = node.children.setdefault(block, _Node())
            node.entries.append(entry)
        self._entries.append(entry)
        return entry

    def remove(self, entry: Entry) -> None:
        """Take ``entry`` out of the tree (the caller removes its sequence)."""
        self._entries.remove(entry)
        path, node = [], self._root
        for block in self._blocks(entry.tokens, len(entry.tokens)):
            child = node.children[block]
            child.entries.remove(entry)
            path.append((node, block, child))
            node = child
        for parent, block, child in reversed(path):  # prune branches nobody holds any more
            if child.entries or child.children:
                break
            del parent.children[block]

    def evict_one(self) -> Entry | None:
        """The least recently used entry (unreferenced ones first), taken out of the tree; None
        when the cache is empty."""
        if not self._entries:
            return None
        victim = min(self._entries, key=lambda e: (e.refs > 0, e.last_used))
        self.remove(victim)
        return victim

    def clear(self) -> list[Entry]:
        """Every entry, taken out of the tree."""
        out = list(self._entries)
        for entry in out:
            self.remove(entry)
        return out
