"""Packing policies, by name: a policy takes a loaded job and returns per-node schedules and figures.
Packing only: what a packed schedule must satisfy is :mod:`pipefisher.rules`, which the policies call
(to align sync groups, to check their own output) and never redefine. What a policy returns is
:mod:`pipefisher.schedule.packed`, below the policies, since measurements, objectives and schedule files read it.
"""
from __future__ import annotations

from typing import Any

from pipefisher.errors import InputError
from pipefisher.policies.bestfit import BestFitPolicy
from pipefisher.policies.compat import CompatPolicy
from pipefisher.policies.exact import ExactPolicy
from pipefisher.policies.target import TargetPolicy
from pipefisher.policies.tight import TightPolicy
from pipefisher.schedule.packed import JobSchedule, NodeFigures, NodeSchedule, Placement, Policy

POLICIES: dict[str, type[Policy]] = {
    CompatPolicy.name: CompatPolicy,
    TightPolicy.name: TightPolicy,
    BestFitPolicy.name: BestFitPolicy,
    ExactPolicy.name: ExactPolicy,
    TargetPolicy.name: TargetPolicy,
}
DEFAULT_POLICY = TargetPolicy.name


def packs_overlapping(name: str) -> bool:
    """Whether the policy registered under ``name`` can let cycles overlap (takes the ``overlap`` option:
    ``tight`` and ``target``, by default)."""
    return "overlap" in getattr(POLICIES.get(name), "options", ())


def check_overlap(overlap: bool | None, policy: str | None) -> None:
    """Refuse ``overlap`` (``--overlap``) in one line, before any work, with a policy that cannot pack
    overlapping cycles; ``overlap=False`` is what the other policies do anyway, and None is the policy's default."""
    name = policy or DEFAULT_POLICY
    able = sorted(filter(packs_overlapping, POLICIES))
    if overlap and name in POLICIES and name not in able:
        raise InputError(None, f"--overlap applies to the {' and '.join(map(repr, able))} policies only, "
                               f"not to '{name}'")


def get_policy(name: str, **options: Any) -> Policy:
    """The policy registered under ``name``, made with ``options`` (those given as None are left out);
    an unknown name, or an option the policy does not take, is an input error.

    Options: ``time_limit`` (seconds per job) for ``exact``; ``staleness`` (a
    :class:`pipefisher.cost.objective.StalenessCurve` or its text), ``slowdown``, ``max_cycle`` and
    ``tolerance`` for ``target``; ``overlap`` for ``tight`` and ``target`` (``overlap=False`` is what every
    other policy does, so they take it too); the other policies take none.
    ``exact`` without OR-Tools installed is an input error that says how to install it.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise InputError(None, f"unknown policy '{name}' (known: {', '.join(sorted(POLICIES))})") from None
    given = {k: v for k, v in options.items() if v is not None}
    if given.get("overlap") is False and not packs_overlapping(name):
        del given["overlap"]  # no overlapping cycles: what this policy packs anyway
    accepted = tuple(getattr(cls, "options", ()))
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        takes = f"takes only {', '.join(accepted)}" if accepted else "takes no options"
        raise InputError(None, f"policy '{name}' {takes}, not {', '.join(unknown)}")
    return cls(**given)


__all__ = ["DEFAULT_POLICY", "POLICIES", "JobSchedule", "NodeFigures", "NodeSchedule", "Placement", "Policy",
           "check_overlap", "get_policy", "packs_overlapping"]
