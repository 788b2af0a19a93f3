"""PQCache-style product quantization (Zhang et al., "PQCache: Product Quantization-based KVCache for
Long Context LLM Inference", SIGMOD 2025).

Build: faiss product quantization of the keys (``M`` sub-vectors of d/M dimensions, ``2^nbits``
codewords each, k-means on the keys as PQCache; its defaults M = 2, nbits = 6). Search: the query's
approximate inner product with every key from its codes (asymmetric distance computation, faiss
``IndexPQ`` with inner product), the ``pool`` keys of largest approximate score re-ranked by their
exact inner product, and the top-k of those returned. PQCache chooses one pool per KV head (the softmax of the
approximate scores summed over the group's query heads); here each query head chooses its own, as for every index
of the lab (measured on SmolLM2 8K layer 15: recall@100 0.00-0.11 higher per head at one pool, each head charged
its own reads). Codebooks: faiss k-means, 25 iterations (PQCache: scikit-learn's, 3-300 adaptive).

Counting: the ADC table is the query's products with every codeword: M × 2^nbits products of d/M
dimensions, as many multiplications as ``2^nbits`` full inner products, so ``n_scanned = 2^nbits +
pool``; the n code lookups are additions, not inner products, and are charged in bytes:
``bytes_read = 4·d·2^nbits`` (the codebooks, float32) ``+ code_size · n`` (every key's code: ⌈M·nbits/8⌉
bytes) ``+ 4·d · pool`` (the re-ranked keys).
"""

from __future__ import annotations

import math

import faiss
import numpy as np

from anns_lab.errors import IndexConfigError
from anns_lab.indexes import KeyRowsIndex, Param
from anns_lab.indexes.persist import expect, refuse_faiss_payload

POOLS = (100, 150, 200, 300, 400, 600, 800, 1200, 1600, 2400, 3200, 4800, 6400, 9600, 12800, 19200, 25600)
SAFE = 2.0 ** 20  # keys are encoded within ±SAFE: faiss's PQ encoder starts its codeword search at a distance of 1e20, so a
# sub-vector farther than that from every codeword (keys of ~1.3e9 and up; the lab accepts ±1e15) took codeword 0


def code_scale(keys: np.ndarray) -> float:
    """The power of two (at most 1) that brings ``keys`` within ±SAFE for training and encoding. A power of two scales
    every float exactly, so the codes are those of the unscaled keys had faiss no limit, and the approximate scores
    (the pool's ranking) only scale."""
    top = float(np.abs(keys).max()) if keys.size else 0.0
    return 1.0 if top <= SAFE else 2.0 ** -math.ceil(math.log2(top / SAFE))


class PQCacheIndex(KeyRowsIndex):
    """PQCache: PQ codes of the keys (faiss), approximate scores over all codes, exact re-ranking of a pool."""

    build_params = {
        "M": Param(2, 1, 256, help="sub-vectors per key (PQCache: 2); must divide the dimension"),
        "nbits": Param(6, 1, 12, help="bits per sub-vector code, 2^nbits codewords (PQCache: 6)"),
        "seed": Param(1234, 0, 2**31 - 1, help="k-means seed of the codebooks"),
    }
    search_params = {"pool": Param(400, 1, 1 << 30, help="keys of best approximate score re-ranked exactly (≥ k)")}
    search_grid = {"pool": POOLS}

    def check_keys(self, n_keys: int) -> None:
        if n_keys < 2 ** self.params["nbits"]:
            raise IndexConfigError(f"{self._owner()}: {n_keys} keys cannot train 2^{self.params['nbits']} codewords")

    def check_dim(self, dim: int) -> None:
        if dim % self.params["M"]:
            raise IndexConfigError(f"{self._owner()}: M={self.params['M']} does not divide the key dimension {dim}")

    def _build(self, keys: np.ndarray, train_queries: np.ndarray | None) -> None:
        M, nbits = self.params["M"], self.params["nbits"]
        index = faiss.IndexPQ(keys.shape[1], M, nbits, faiss.METRIC_INNER_PRODUCT)
        index.pq.cp.seed = self.params["seed"]
        self._scale = code_scale(keys)
        scaled = keys if self._scale == 1.0 else keys * np.float32(self._scale)
        index.train(scaled)
        index.add(scaled)
        self._pq = index
        self._hold_keys(keys)

    @property
    def ksub(self) -> int:
        return 2 ** self.params["nbits"]

    def _search(self, queries: np.ndarray, k: int, pool: int):
        pool = min(max(pool, k), self.n_keys)
        _, cand = self._pq.search(queries, pool)  # ADC over every code
        ids = np.full((len(queries), k), -1, np.int64)
        scores = np.full((len(queries), k), -np.inf, np.float32)
        for row, (q, c) in enumerate(zip(queries, cand)):
            c = c[c >= 0]
            s = self._keys[c] @ q
            top = np.argsort(-s, kind="stable")[:k]
            ids[row, : len(top)], scores[row, : len(top)] = c[top], s[top]
        d = queries.shape[1]
        n_scanned = np.full(len(queries), self.ksub + pool, np.int64)
        n_bytes = 4 * d * self.ksub + self._pq.code_size * self.n_keys + 4 * d * pool
        return ids, scores, n_scanned, np.full(len(queries), n_bytes, np.int64)

    def grid(self) -> list[dict]:
        return [{"pool": p} for p in sorted({min(p, self.n_keys) for p in self.search_grid["pool"]} | {self.n_keys})]

    def max_scanned(self) -> int:
        return self.n_keys + self.ksub

    def _add(self, keys: np.ndarray) -> None:
        # encoded with the codebooks of the build, as PQCache encodes new tokens, at the build's scale
        self._pq.add(keys if self._scale == 1.0 else keys * np.float32(self._scale))
        self._append_keys(keys)

    def _arrays(self) -> dict[str, np.ndarray]:
        # Plain arrays, not faiss's own binary format (its C++ reader trusts the file's sizes): the codebooks and
        # the codes (any bytes decode to codewords in range), restored into a new IndexPQ.
        pq = self._pq
        codebooks = faiss.vector_to_array(pq.pq.centroids).reshape(pq.pq.M, pq.pq.ksub, pq.pq.dsub)
        codes = faiss.vector_to_array(pq.codes).reshape(pq.ntotal, pq.code_size)
        return {"codebooks": codebooks, "codes": codes, "keys": self._keys}

    def _restore(self, arrays: dict[str, np.ndarray]) -> None:
        refuse_faiss_payload(arrays)
        M, nbits, d = self.params["M"], self.params["nbits"], self.dim
        self.check_dim(d)
        pq = faiss.IndexPQ(d, M, nbits, faiss.METRIC_INNER_PRODUCT)
        codebooks = expect(arrays, "codebooks", np.float32, (M, 2 ** nbits, d // M), finite=True)
        codes = expect(arrays, "codes", np.uint8, (self.n_keys, pq.code_size))
        faiss.copy_array_to_vector(codebooks.ravel(), pq.pq.centroids)
        faiss.copy_array_to_vector(codes.ravel(), pq.codes)
        pq.ntotal, pq.is_trained = self.n_keys, True
        self._pq = pq
        self._hold_keys(expect(arrays, "keys", np.float32, (self.n_keys, self.dim), finite=True))
        # Not saved: the build's scale from the keys it held (the same unless later adds passed a power of two above
        # SAFE, where only the adds after a load would be encoded at another scale)
        self._scale = code_scale(self._keys)
