"""ANN indexes for attention-query → key retrieval: the protocol, the registry and the zoo.

Every index, built-in or plugin, is a subclass of :class:`Index` announced in the entry-point
group ``anns_lab.indexes``; look indexes up with :func:`get` / :func:`create`.
"""

from anns_lab.errors import IndexConfigError
from anns_lab.indexes.base import Index, KeyRowsIndex, Param, SearchResult, pad_topk
from anns_lab.indexes.registry import available, broken, create, get

__all__ = ["Index", "IndexConfigError", "KeyRowsIndex", "Param", "SearchResult", "available", "broken", "create", "get", "pad_topk"]
