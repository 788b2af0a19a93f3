"""anns-lab: attention-query to key retrieval, from captured Q/K/V to a RetrievalAttention decoder.

Floors, bottom to top; a module imports only from its own floor and those below it
(``tests/test_layering.py`` checks every import):

0. ``errors``, ``version``, ``io`` (atomic writes), ``window``, ``cli_types``, ``processes`` (workers that end with
   their parent), ``stops`` (Ctrl-C and SIGTERM recorded);
1. ``dumps``: models and prompts (used by the decoder too), capture and the Parquet format;
2. ``indexes``: the protocol, the registry and the zoo, and ``testing`` (the conformance kit, which
   ``anns-lab indexes --check`` runs);
3. ``eval``: head data, metrics, the sweep, its results table (``eval.table``) and the report;
4. ``decode``: the RetrievalAttention decoder;
5. this package root and ``cli``.
"""

from anns_lab.errors import AnnsLabError
from anns_lab.version import __version__

__all__ = ["AnnsLabError", "open_dump", "__version__"]


def __getattr__(name: str):
    # open_dump lives with the Parquet store; importing it lazily keeps `import anns_lab` light.
    if name == "open_dump":
        from anns_lab.dumps.store import open_dump

        return open_dump
    raise AttributeError(name)
