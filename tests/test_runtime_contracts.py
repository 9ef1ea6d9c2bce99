"""The runtime's contracts (:mod:`pipefisher.runtime.pipeline.contracts`): every engine and every K-FAC
holder keeps each protocol it serves, member by member, with signatures a caller of the protocol can
call; and the runtime's callers ask no object whether it has a method."""
from __future__ import annotations

import ast
import inspect
import os
from typing import Any, Protocol

import pytest
from torch import nn

import pipefisher
from pipefisher.kfac import KFAC
from pipefisher.kfac.kfac import HostReader
from pipefisher.runtime.job.host import HostReads
from pipefisher.runtime.pipeline.contracts import Curvature, CurvatureWork, Engine, ForwardCurvature
from pipefisher.runtime.pipeline.copies import StageCopiesEngine, StageCopiesKFAC
from pipefisher.runtime.pipeline.engine import PipelineEngine
from pipefisher.runtime.pipeline.torch_engine import TorchEngine


def _members(protocol: type) -> dict[str, Any]:
    """The protocol's methods and properties by name, its base protocols' included."""
    out: dict[str, Any] = {}
    for base in reversed(protocol.__mro__):
        if base in (object, Protocol) or not getattr(base, "_is_protocol", False):
            continue
        for name, value in vars(base).items():
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
                out[name] = value
    return out


def _callable_as(want: inspect.Signature, got: inspect.Signature) -> str | None:
    """Why a call that fits ``want`` (the protocol's method) would not fit ``got`` (a keeper's), or None."""
    wanted, have = list(want.parameters.values())[1:], list(got.parameters.values())[1:]  # past self
    for i, p in enumerate(wanted):
        if i >= len(have):
            return f"takes no parameter {p.name!r}"
        q = have[i]
        if q.name != p.name or q.kind != p.kind:
            return f"has {q} where the protocol has {p}"
        if p.default is not inspect.Parameter.empty and q.default is inspect.Parameter.empty:
            return f"needs {q.name!r}, which the protocol's callers may leave out"
    extra = [q for q in have[len(wanted):] if q.default is inspect.Parameter.empty
             and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
    return f"needs {', '.join(q.name for q in extra)} beyond the protocol's" if extra else None


def mismatches(keeper: Any, protocol: type) -> list[str]:
    """What ``keeper`` (a class, or an instance where attributes set at construction keep properties)
    lacks of ``protocol``: one line per member."""
    cls = keeper if isinstance(keeper, type) else type(keeper)
    out = []
    for name, member in _members(protocol).items():
        try:
            have = inspect.getattr_static(cls, name)
        except AttributeError:
            if isinstance(member, property) and not isinstance(keeper, type) and name in vars(keeper):
                continue  # an attribute of the instance keeps a read-only property
            out.append(f"{cls.__name__} has no {name}")
            continue
        if isinstance(member, property):
            if not isinstance(have, property) and isinstance(keeper, type):
                out.append(f"{cls.__name__}.{name} is no property")
            continue
        if not inspect.isfunction(have):
            out.append(f"{cls.__name__}.{name} is no method")
            continue
        why = _callable_as(inspect.signature(member), inspect.signature(have))
        if why:
            out.append(f"{cls.__name__}.{name} {why}")
    return out


def _kfac() -> KFAC:
    return KFAC(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))


@pytest.mark.parametrize("engine", [PipelineEngine, StageCopiesEngine, TorchEngine])
def test_every_engine_keeps_the_engine_contract(engine):
    assert mismatches(engine, Engine) == []


@pytest.mark.parametrize("protocol", [CurvatureWork, ForwardCurvature, Curvature])
def test_kfac_keeps_every_curvature_contract(protocol):
    kfac = _kfac()
    assert mismatches(kfac, protocol) == []
    assert isinstance(kfac, protocol)


def test_a_devices_stage_copies_keep_the_curvature_contract():
    copies = StageCopiesKFAC({0: _kfac(), 1: _kfac()}, [0, 1])
    assert mismatches(copies, Curvature) == []
    assert isinstance(copies, Curvature)


def test_the_workers_counter_is_what_kfac_asks_of_a_reader():
    assert mismatches(HostReads, HostReader) == []


def test_the_check_sees_what_a_keeper_lacks():
    class Partial:
        def begin_step(self, step: int, extra: int) -> None: ...

        def op(self, name: str) -> None: ...

        def run(self) -> None: ...

    found = "\n".join(mismatches(Partial, Engine))
    assert "Partial.begin_step needs extra" in found and "Partial.op has name" in found
    assert "Partial.run takes no parameter 'ops'" in found and "Partial has no prepost" in found

    class Holder:  # peak_saved_bytes as an attribute of the instance, as KFAC keeps it
        def __init__(self) -> None:
            self.peak_saved_bytes = 0

    assert "Holder has no peak_saved_bytes" not in mismatches(Holder(), Curvature)
    assert "Holder has no peak_saved_bytes" in mismatches(Holder, Curvature)


CALLERS = ("runtime/pipeline/executor.py", "runtime/train/worker.py", "runtime/train/trainer.py",
           "runtime/train/update.py")


@pytest.mark.parametrize("path", CALLERS)
def test_the_callers_probe_no_engine_or_kfac_for_a_method(path):
    """``getattr`` / ``hasattr`` on an engine or a K-FAC: what the contracts' defaults are for."""
    full = os.path.join(os.path.dirname(pipefisher.__file__), path)
    with open(full, encoding="utf-8") as f:
        tree = ast.parse(f.read(), full)
    probes = [f"{path}:{node.lineno}" for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and node.args
              and any(word in ast.unparse(node.args[0]) for word in ("engine", "kfac"))]
    assert probes == []
