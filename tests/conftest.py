"""Shared fixtures: the published tool's test vectors and small hand-made jobs."""
from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

DATA = Path(__file__).parent / "data"
COMPAT_CASES = sorted(p for p in (DATA / "compat").iterdir() if p.is_dir())


@pytest.fixture(autouse=True, scope="session")
def _temporary_files_stay_in_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Runs that fail on purpose keep their worker log in the temp folder (the launcher names it); let
    that be the session's own, so the suite leaves nothing behind in /tmp."""
    folder = str(tmp_path_factory.mktemp("tmp"))
    before = (os.environ.get("TMPDIR"), tempfile.tempdir)
    os.environ["TMPDIR"], tempfile.tempdir = folder, folder
    yield
    if before[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before[0]
    tempfile.tempdir = before[1]


@pytest.fixture
def cli_lines() -> Iterator[None]:
    """What the runtime logs shown as the CLI shows it (its handler on the ``pipefisher`` logger), for tests
    that read what a library call of the runtime says on stdout: alone, it says nothing."""
    from pipefisher.cli._progress import CliLines
    from pipefisher.runtime.job.progress import showing

    with showing(CliLines()):
        yield


def case_timelines(case: Path) -> list[str]:
    return sorted(str(p) for p in case.glob("job_node*_timeline.pickle"))


@pytest.fixture
def write_pickle(tmp_path: Path) -> Callable[[str, Any], str]:
    """Write ``obj`` as a pickle named ``name`` in a temp folder and return its path."""

    def write(name: str, obj: Any) -> str:
        path = tmp_path / name
        path.write_bytes(pickle.dumps(obj))
        return str(path)

    return write


def small_node(offset: int = 0, m: int = 2, module: str = "layer.0") -> dict[str, list[tuple[int, int]]]:
    """A hand-made node: m forwards, m backwards with gaps, and one layer's K-FAC work."""
    t = offset
    d: dict[str, list[tuple[int, int]]] = {"start_end": [], "call_forward": [], "call_backward": []}
    for _ in range(m):
        d["call_forward"].append((t, t + 100))
        t += 150
    for _ in range(m):
        d["call_backward"].append((t, t + 200))
        t += 300
    for kind in ("cov_kron_A", "cov_kron_B", "sync_kron_A", "sync_kron_B", "inv_kron_A", "inv_kron_B"):
        d[f"{kind}:{module}"] = [(t, t + 20)]
        t += 20
    d["start_end"] = [(offset, t)]
    return d


@pytest.fixture
def small_job(write_pickle: Callable[[str, Any], str]) -> list[str]:
    """Two nodes of a tiny job, written as pickles."""
    return [write_pickle(f"run_node{i}_timeline.pickle", small_node(offset=i * 50, module=f"layer.{i}"))
            for i in range(2)]


def dead_unit_factors(scale: float) -> Iterator[tuple[str, Any]]:
    """K-FAC factors ``X^T X`` (64 x 64, float32) of a few rows of ``scale`` with half the units exactly
    zero (dead): low rank, zero rows. float32's ``eigh`` returned NaN for, or did not converge on, 16 of
    the 120 made with scales 1e-8, 3e-10 and 1e-10 (the tiny config's factor B at lr 0.1 was one such,
    of 1e-21). Yields (a name for assertion messages, the factor)."""
    import torch

    for rank in range(1, 5):
        for seed in range(10):
            g = torch.Generator().manual_seed(seed)
            out = torch.randn(rank, 64, generator=g) * scale
            out[:, torch.rand(64, generator=g) < 0.5] = 0
            yield f"rank {rank} seed {seed}", out.t() @ out


DEAD_UNIT_SCALES = [1e-8, 3e-10, 1e-10]


def overlapping_node() -> dict[str, list[tuple[int, int]]]:
    """A node whose refresh (three pieces of 80) fits after its factor's completion only in three bubbles
    of 100, one more than the cycle holds after the completion: non-overlapping, its cycle is 3
    iterations (also its bound); overlapping, the third piece goes into iteration 0's first bubble, 2.

    Bubbles [10, 110], [120, 130], [140, 240]; the factor's second covariance piece follows backward 1
    (at 240), so it completes in iteration 1 at the earliest.
    """
    return {"start_end": [(0, 1000)], "call_forward": [(0, 10), (130, 140)],
            "call_backward": [(110, 120), (240, 250)], "cov_kron_B:l": [(0, 10)], "sync_kron_B:l": [(0, 4)],
            "inv_kron_B:l": [(0, 80), (0, 80), (0, 80)]}


@pytest.fixture
def switch_through(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[Any]], None]:
    """``switch_through(plans)``: ``--adapt``'s scheduler switches to each of ``plans`` in turn, one per
    decision, then keeps the last: a closed loop whose choices the test names."""
    def install(plans: list[Any]) -> None:
        from pipefisher.loop import closed_loop
        from pipefisher.loop.closed_loop import Scheduler

        later = list(plans)

        class Switcher(Scheduler):
            name = "switcher"

            def observe(self, records: Any) -> None:
                return None

            def next_schedule(self) -> Any:
                if later:
                    self.current = later.pop(0)
                return self.current

        monkeypatch.setattr(closed_loop, "make_scheduler", lambda name, plan, nodes, **_: Switcher(plan))
    return install
