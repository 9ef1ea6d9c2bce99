"""One broken schedule rule, as every check reports it.

Its own module, below every rule, so that the per-node rules (dependencies, room) and the rules over
groups of nodes (groups, waits) all report the same thing.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Violation:
    """One broken rule: where (node, iteration, label) and which rule."""

    node: int
    iteration: int | None  # None: the rule is about the whole cycle
    label: str
    rule: str
    detail: str

    def __str__(self) -> str:
        where = "cycle" if self.iteration is None else f"iteration {self.iteration}"
        return f"node{self.node} {where}: {self.label}: {self.rule}: {self.detail}"
