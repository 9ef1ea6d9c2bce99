"""Packing policies, by name. A policy takes a loaded job and returns per-node schedules and figures."""
from __future__ import annotations

from pipefisher.errors import InputError
from pipefisher.policies.bestfit import BestFitPolicy
from pipefisher.policies.base import JobSchedule, NodeFigures, NodeSchedule, Placement, Policy
from pipefisher.policies.compat import CompatPolicy
from pipefisher.policies.tight import TightPolicy

POLICIES: dict[str, type[Policy]] = {
    CompatPolicy.name: CompatPolicy,
    TightPolicy.name: TightPolicy,
    BestFitPolicy.name: BestFitPolicy,
}
DEFAULT_POLICY = TightPolicy.name


def get_policy(name: str) -> Policy:
    """The policy registered under ``name``; an unknown name is an input error listing the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise InputError(None, f"unknown policy '{name}' (known: {', '.join(sorted(POLICIES))})") from None


__all__ = ["DEFAULT_POLICY", "POLICIES", "JobSchedule", "NodeFigures", "NodeSchedule", "Placement", "Policy",
           "get_policy"]
