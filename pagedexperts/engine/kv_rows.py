"""The server's KV cache held in place (``KVRows``): per attention layer keys and values [R, kv_heads,
L, D], a row per running request, column = position, the last W_s columns scratch for padding; a
decode step reads and writes rows [0, B) in place. L grows (at least doubling) when a request needs
more, replacing the tensors. docs/server.md "Serving on the fast path".

Legend: R rows, L columns, W_s scratch columns, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

COLUMN_ROUND = 64  # L is allocated in multiples of this (fewer growths, fewer recaptures)


@dataclass
class KVRows:
    """``rows`` R, ``scratch`` W_s, ``limit`` the context length; ``keys`` / ``values``: layer -> [R,
    kv_heads, L, D], made at the layer's first write."""

    rows: int
    scratch: int
    limit: int
    width: int = 0  # L, columns incl. the scratch ones (0 until the first placement)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    row_of: dict[int, int] = field(default_factory=dict)  # request id -> row
    generation: int = 0  # times the tensors were replaced (a growth)

    @property
    def positions(self) -> int:
        """Columns that can hold positions: L - W_s."""
        return max(0, self.width - self.scratch)

    def place(self, request_id: int, need: int) -> int:
        """The lowest free row with room for ``need`` positions; ValueError over ``limit`` or with
        every row taken."""
        if need > self.limit:
            raise ValueError(f"a request needs {need} KV positions; the limit is {self.limit} (--context-length)")
        free = sorted(set(range(self.rows)) - set(self.row_of.values()))
        if not free:
            raise ValueError(f"all {self.rows} KV rows are taken (--max-running-requests {self.rows})")
        if need > self.positions:
            self._grow(need)
        self.row_of[request_id] = free[0]
        return free[0]

    def release(self, request_id: int) -> None:
        """Free the request's row (nothing when it holds none)."""
        self.row_of.pop(request_id, None)

    def layer(self, index: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [R, kv_heads, L, D] of attention layer ``index``, made on first use like
        ``key``."""
        if index not in self.keys:
            self.keys[index] = key.new_zeros((self.rows, key.shape[1], self.width, key.shape[-1]))
            self.values[index] = value.new_zeros((self.rows, value.shape[1], self.width, value.shape[-1]))
        return self.keys[index], self.values[index]

    def _grow(self, need: int) -> None:
        """Widen L to hold ``need`` positions, copying the columns in use."""
        positions = max(need, min(2 * self.positions, self.limit))
        width = -(-positions // COLUMN_ROUND) * COLUMN_ROUND + self.scratch
        kept = self.positions
        for tensors in (self.keys, self.values):
            for index, old in tensors.items():
                new = old.new_zeros((*old.shape[:2], width, old.shape[3]))
                new[:, :, :kept] = old[:, :, :kept]
                tensors[index] = new
        self.width = width
        self.generation += 1

    def nbytes(self) -> int:
        """Bytes held by the keys and values of every layer."""
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values) for t in d.values())
