"""anns-lab: attention-query to key retrieval, from captured Q/K/V to a RetrievalAttention decoder.

Stages (each imports only from the ones before it): ``dumps`` → ``indexes`` → ``eval`` → ``decode``.
"""

from anns_lab.errors import AnnsLabError

__version__ = "0.1.0"

__all__ = ["AnnsLabError", "open_dump", "__version__"]


def __getattr__(name: str):
    # open_dump lives with the Parquet store; importing it lazily keeps `import anns_lab` light.
    if name == "open_dump":
        from anns_lab.dumps.store import open_dump

        return open_dump
    raise AttributeError(name)
