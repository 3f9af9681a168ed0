"""Drafting methods. Importing this package registers every built-in proposer."""

# Importing the modules registers their proposers under their method names.
from speculant.proposers import draft_model as _draft_model  # noqa: F401
from speculant.proposers import eagle as _eagle  # noqa: F401
from speculant.proposers import layer_skip as _layer_skip  # noqa: F401
from speculant.proposers import ngram as _ngram  # noqa: F401
from speculant.proposers import suffix as _suffix  # noqa: F401
from speculant.proposers.base import (
    EMPTY_DRAFT,
    CachesPrompt,
    Draft,
    DraftsTogether,
    NoProposer,
    Proposer,
    Spawns,
    UsesFeatures,
    available_methods,
    make_proposer,
    register,
    spawn_proposer,
)
from speculant.proposers.draft_model import DraftModelProposer, TokenizerMismatchError

__all__ = [
    "EMPTY_DRAFT",
    "CachesPrompt",
    "Draft",
    "DraftModelProposer",
    "DraftsTogether",
    "NoProposer",
    "Proposer",
    "Spawns",
    "UsesFeatures",
    "TokenizerMismatchError",
    "available_methods",
    "make_proposer",
    "register",
    "spawn_proposer",
]
