"""Double Sparsity's key selection (Yang et al., "Post-Training Sparse Attention with Double Sparsity", 2024; code
andy-yang-1/DoubleSparse; SGLang serves it as its double-sparsity attention backend).

Each head's "heavy" channels are fixed offline by a calibration pass: a channel's weight is the mean over tokens of
|q_c·k_c|, each token's post-RoPE query against its own key (the reference's "qk" statistic, the one it ships). A
query scores every key on its head's r heaviest channels alone, read from a copy of the keys restricted to them (the
paper's label cache); the ``budget`` keys of largest partial score are scored exactly and the top-k returned. Where
SparQ picks each query's own r largest components, the channels here are the same for every query of the head.

Calibrated here on the prefill's own queries and keys: the training queries at the positions the prefill had them
(``own_positions``), each paired with the index's key at its position (the window's keys and held-out ones are not
the index's, so their queries are left out). The reference calibrates once per model on other text (the Pile): this
can only help the index. Not modelled: the label cache's 4-bit quantization (bytes are counted in float32 as for every
index of the lab), its per-GQA-group channel sums; keys added later are scored on the build's channels, as the
reference's offline ones serve every token.

Counting (:mod:`anns_lab_lowrank.partial`): ``n_scanned`` = ceil(n·r/d) + keys scored exactly; ``bytes_read`` =
8·r (the head's r channel ids, read from the index: no inner product) + 4·r·n + 4·d per key scored.
"""

from __future__ import annotations

import numpy as np

from anns_lab.errors import IndexConfigError
from anns_lab.indexes.persist import expect
from anns_lab_lowrank import partial


def heavy_channels(keys: np.ndarray, key_positions: np.ndarray, queries: np.ndarray,
                   query_positions: np.ndarray) -> np.ndarray:
    """The d channels, heaviest first (ties to the lower channel): mean |q_c·k_c| over the positions holding both a
    key and a query (int64 (d,))."""
    _, at_key, at_query = np.intersect1d(key_positions, query_positions, return_indices=True)
    if not len(at_key):
        raise IndexConfigError("double-sparsity calibrates its channels on the training queries at the keys' own "
                               "positions, and no training query is at a key's position")
    weight = np.zeros(keys.shape[1])
    for lo in range(0, len(at_key), 4096):  # a chunk at a time: no (m, d) float64 copy at 128K
        rows = slice(lo, lo + 4096)
        weight += np.abs(keys[at_key[rows]].astype(np.float64) * queries[at_query[rows]]).sum(axis=0)
    return np.argsort(-weight, kind="stable").astype(np.int64)


class DoubleSparsity(partial.TransposedKeys):
    """Double Sparsity: every key scored on the head's r heaviest channels, the best ``budget`` scored exactly.

    A channel's weight: mean |q_c·k_c| over the prefill's tokens, each query against its own token's key."""

    uses_train_queries = True
    own_positions = True  # a query is paired with the key of its own token, as the prefill computed them
    reads_positions = True
    restores_exactly = True

    def _build(self, keys: np.ndarray, train_queries: np.ndarray, key_positions: np.ndarray,
               train_positions: np.ndarray) -> None:
        self._set(keys, heavy_channels(keys, key_positions, train_queries, train_positions))

    def _set(self, keys: np.ndarray, order: np.ndarray) -> None:
        self._hold_transposed(keys)  # the label cache's rows: one copy for the KV head's query heads
        self._order = order

    def _search(self, queries: np.ndarray, k: int, rank: float, budget: int):
        r = partial.channels(rank, self.dim)
        dims = np.broadcast_to(np.sort(self._order[:r]), (len(queries), r))  # the head's, the same for every query
        ids, scores, scanned, nbytes = partial.search_channels(self._by_dim.buf, dims, self._keys, queries, budget, k)
        return ids, scores, scanned, nbytes + 8 * r  # and the r channel ids (int64) read from the index

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"keys": self._keys, "order": self._order}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        keys = expect(arrays, "keys", np.float32, (self.n_keys, self.dim), finite=True)
        order = expect(arrays, "order", np.int64, (self.dim,))
        if not np.array_equal(np.sort(order), np.arange(self.dim)):
            raise IndexConfigError(f"array 'order' is not an ordering of the {self.dim} channels")
        self._set(keys, order)
