"""Drafting methods. Importing this package registers every built-in proposer."""

from speculant.proposers import draft_model as _draft_model  # noqa: F401 (registers "draft")
from speculant.proposers.base import (
    EMPTY_DRAFT,
    Draft,
    NoProposer,
    Proposer,
    available_methods,
    make_proposer,
    register,
)
from speculant.proposers.draft_model import DraftModelProposer, TokenizerMismatchError

__all__ = [
    "EMPTY_DRAFT",
    "Draft",
    "DraftModelProposer",
    "NoProposer",
    "Proposer",
    "TokenizerMismatchError",
    "available_methods",
    "make_proposer",
    "register",
]
