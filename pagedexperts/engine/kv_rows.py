"""The server's KV cache held in place: a row per running request in a preallocated static layout.

Owns: ``KVRows``, per attention layer one keys and one values tensor [R, kv_heads, L, D]
(R rows = ``--max-running-requests``; L columns), which row each running request holds (the
lowest free row, taken at admission, given back when the request ends), and the width L:
column c of a row holds its request's token at position c, so a row is filled up to its
request's ``length``; the last ``scratch`` columns are never a position: padding rows and
padding query positions of a fixed-shape step write there (``row_forwards``). A decode step
reads rows [0, B) as a view of these tensors and writes its new keys and values into them:
nothing is copied per step.

L grows when an admitted request needs more columns (prompt + max_tokens): to the next
multiple of ``COLUMN_ROUND`` and at least twice the old width (few growths), the rows in use
copied once into the new tensors; ``generation`` counts the replacements, so a step built over
the old tensors (a captured CUDA graph holds their addresses) is rebuilt. Memory is R x L per
layer whatever the requests' lengths (the price of one fixed-shape step per batch size; see
docs/server.md "Serving on the fast path").

Legend: R rows, L columns, W_s scratch columns, D head dim. Does not: compute attention
(``row_attention``), build steps (``row_forwards``) or choose requests (``scheduler``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

COLUMN_ROUND = 64  # L is allocated in multiples of this (fewer growths, fewer recaptures)


@dataclass
class KVRows:
    """The KV rows of one scheduler (module docstring).

    ``rows``: R. ``scratch``: W_s (the widest step's query positions). ``limit``: the most
    positions a request may need (the context length); L never exceeds ``limit`` + W_s
    rounded up. ``keys`` / ``values``: attention layer -> [R, kv_heads, L, D], made at the
    layer's first write (its dtype, device and head shapes), zeros.
    """

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
        """Give request ``request_id`` the lowest free row with room for ``need`` positions
        (growing L first when it is short); returns the row.

        Raises:
            ValueError: ``need`` over ``limit`` (the context length), or every row taken
                (more running requests than rows: a scheduler bug).
        """
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
        ``key`` / ``value`` ([*, kv_heads, *, D]: a step's new states)."""
        if index not in self.keys:
            self.keys[index] = key.new_zeros((self.rows, key.shape[1], self.width, key.shape[-1]))
            self.values[index] = value.new_zeros((self.rows, value.shape[1], self.width, value.shape[-1]))
        return self.keys[index], self.values[index]

    def _grow(self, need: int) -> None:
        """Widen L to hold ``need`` positions (module docstring), copying the columns in use."""
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
