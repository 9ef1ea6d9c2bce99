"""K-FAC's refresh: turning a factor the statistics hand over into what the update uses (a damped inverse,
or under ``kfac.update: soap`` an eigenbasis), in the factor's ``inv_kron_X:<m>`` labels, and checking it.

A refresh may run in pieces, one per label (``refresh_pieces``, :class:`pipefisher.kfac.refresh.Refresh`;
see :meth:`Refresher.inv` for which label runs which). Damping starts at ``damping`` and is multiplied by
``damping_decay`` after every refresh of a layer, never going below ``damping_min``, split between the
factors by the pi rule. A factor that cannot be inverted honestly stops the run
(:class:`~pipefisher.kfac.factors.BadFactorError`, ``on_bad_factor: stop``) or keeps the previous inverse
(``skip``); the findings of an inverse with one to fall back on are read once per refresh, with the
runtime's next read (``host``), the new inverse used on the device only where they say it is honest.

Whoever follows refreshes is told through :class:`RefreshListener` (one of :attr:`Refresher.listeners`):
the drift (:class:`pipefisher.kfac.drift_meter.DriftMeter`, its ``follow``), and under ``kfac.update:
soap`` the optimizer, which carries its first moment into a new basis there, in the refresh's label
(:meth:`pipefisher.kfac.KFAC.on_refresh`); they read what they need through :meth:`Refresher.installed`,
:meth:`Refresher.inversions` and :meth:`Refresher.honest`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from pipefisher.kfac import factors as fx
from pipefisher.kfac.factors import BadFactorError
from pipefisher.kfac.layers import FACTORS, Bases, LayerState, check_factor
from pipefisher.kfac.refresh import Refresh, pieces_for
from pipefisher.kfac.statistics import CurvatureStats

logger = logging.getLogger(__name__)


class HostReader(Protocol):
    """What K-FAC asks of the runtime's reader of device values (:class:`pipefisher.runtime.job.host.HostReads`,
    one per worker), so that its checks of inverses are read, and counted, with the worker's next read."""

    def values(self, *tensors: torch.Tensor) -> list[float]:
        """The tensors' elements as numbers, in one read (with whatever waited for it)."""
        ...

    def later(self, t: torch.Tensor, then: Callable[[list[float]], None]) -> None:
        """Read ``t`` with the next read and call ``then(values)`` there."""
        ...

    def settle(self) -> None:
        """Read now what waits for the next read, if anything does."""
        ...


class RefreshListener(Protocol):
    """Who follows a layer's refreshes (the drift): told before an inverse is replaced and after each
    factor went through ``inv`` (inverted, or kept)."""

    def replacing(self, name: str, factor: str, old: torch.Tensor | None) -> None:
        """``factor`` of layer ``name`` is about to replace ``old`` (None: there was none)."""
        ...

    def refreshed(self, name: str, factor: str) -> None:
        """``factor`` of layer ``name`` went through ``inv`` (a new inverse installed, or the old one kept)."""
        ...


@dataclass
class LayerRefresh:
    """One layer's refresh state (per factor where a dict)."""

    # what the update uses: the damped inverse, or the eigenbasis (inverse method ``eigenbasis``)
    installed: dict[str, torch.Tensor | None] = field(default_factory=lambda: {"A": None, "B": None})
    last_pi: Any = None  # the pi of the last refresh (a 0-dim tensor)
    inversions: dict[str, int] = field(default_factory=lambda: {"A": 0, "B": 0})
    skipped: int = 0  # refreshes of a factor dropped because it could not be inverted honestly
    # the refresh in flight in pieces (its Refresh and what it installs with), and the factors completed
    # (sync, or last covariance piece) since their last refresh began
    flight: dict[str, dict[str, Any] | None] = field(default_factory=lambda: {"A": None, "B": None})
    completed: set[str] = field(default_factory=set)


def _flight_state(flight: dict[str, Any] | None) -> dict[str, Any] | None:
    """A refresh in flight as a checkpoint holds it."""
    return None if flight is None else {**flight, "refresh": flight["refresh"].state_dict()}


def _flight_from_state(state: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if state is None else {**state, "refresh": Refresh.from_state(state["refresh"])}


class Refresher:
    """The refreshes of one stage's K-FAC layers (see the module's docstring); ``warn`` reports a skipped
    refresh (default: a warning of this module's logger)."""

    def __init__(self, layers: dict[str, LayerState], stats: CurvatureStats, *, damping: float,
                 damping_min: float, damping_decay: float, method: str, dtype: torch.dtype,
                 on_bad_factor: str, refresh_pieces: int | str, warn: Callable[[str], None] | None = None,
                 host: HostReader | None = None, basis_block: int = 0) -> None:
        self.layers, self.stats = layers, stats
        self.basis_block = basis_block  # eigenbases of a wider factor's diagonal blocks (fx.diagonal_blocks)
        self.state = {n: LayerRefresh() for n in layers}
        self.damping, self.damping_min, self.damping_decay = damping, damping_min, damping_decay
        self.method, self.dtype, self.on_bad_factor = method, dtype, on_bad_factor
        self.refresh_pieces = refresh_pieces
        self.warn = warn or logger.warning
        self.host = host
        self.listeners: list[RefreshListener] = []  # told in the order they came (the drift first: its follow())
        self._marked = False  # completions are marked (complete) by a schedule's executor: see plan_refresh
        self._told_overflow = False
        # Checking inverses: through the worker's reader (host; None: read at once). An inverse with one to
        # fall back on is used on the device as it is, or passed over for that one where its findings say it
        # is dishonest, and its findings are read once, with the refresh's last inverse (at the next read
        # of the host's); one without is checked at once.
        self._unchecked: list[tuple[str, str, torch.Tensor]] = []  # (layer, factor, findings) not read yet
        self._honest: dict[tuple[str, str], torch.Tensor] = {}  # (layer, factor) -> used or not, not read yet
        self._inverted: set[tuple[str, str]] = set()  # (layer, factor) inverted since the last check

    # -- what others read ---------------------------------------------------------------------------

    def installed(self, name: str, factor: str) -> torch.Tensor | None:
        """The inverse (or eigenbasis) of ``factor`` of layer ``name`` the update uses now."""
        return self.state[name].installed[check_factor(factor)]

    def inversions(self, name: str) -> tuple[int, int]:
        """How many refreshes of factors A and B of layer ``name`` installed what is there now."""
        n = self.state[name].inversions
        return n["A"], n["B"]

    def bases(self, name: str) -> Bases:
        """What layer ``name``'s update uses now, both factors, with their refresh counts."""
        st = self.state[name]
        return st.installed["A"], st.installed["B"], (st.inversions["A"], st.inversions["B"])

    def honest(self, name: str, factor: str) -> torch.Tensor | None:
        """Whether the last installed inverse of ``factor`` is used (a 0-dim bool tensor), while its
        findings are not read yet; None once read (or when read at once)."""
        return self._honest.get((name, factor))

    def damping_of(self, name: str) -> float:
        """The damping of layer ``name``'s next refresh: decayed once per completed refresh, floored."""
        done = min(self.state[name].inversions.values())
        return max(self.damping_min, self.damping * self.damping_decay ** done)

    def pieces(self, name: str, factor: str) -> int:
        """How many pieces (inverse labels) a refresh of ``factor`` of layer ``name`` runs in
        (``refresh_pieces``, :func:`pipefisher.kfac.refresh.pieces_for`)."""
        return pieces_for(self.layers[name].factor_size(check_factor(factor)), self.refresh_pieces, self.method)

    # -- the labels ---------------------------------------------------------------------------------

    def plan_refresh(self) -> None:
        """From now on a refresh begins only where its factor was marked complete (:meth:`complete`):
        a schedule's executor marks each factor's completion label, so an inverse label before it in a
        cycle continues the refresh in flight or does nothing (:meth:`inv`). Without a plan every
        :meth:`inv` with no refresh in flight begins one (direct calls, naive K-FAC)."""
        self._marked = True

    def complete(self, factor: str, name: str) -> None:
        """``factor`` of layer ``name`` holds this cycle's covariance (its sync, or its last covariance
        piece where it has no sync): the next inverse label with no refresh in flight begins one."""
        self.state[name].completed.add(check_factor(factor))

    def inv(self, factor: str, name: str) -> None:
        """One inverse label: the next piece of the factor's refresh in flight; with none in flight, begin
        one (:meth:`_begin`) if the factor completed since the last began (always, without
        :meth:`plan_refresh`), else nothing (an overlapping schedule's first cycle). The last piece installs
        the result (:meth:`_install`); the update always uses the latest installed one."""
        st = self.state[name]
        flight = st.flight[check_factor(factor)]
        if flight is None:
            if self._marked and factor not in st.completed:
                return
            st.completed.discard(factor)
            flight = self._begin(factor, name)
            st.flight[factor] = flight
        if flight["refresh"].step():
            st.flight[factor] = None
            self._install(factor, name, flight)

    def finish_refreshes(self) -> None:
        """A schedule switch: run every refresh in flight to its end at once, and every refresh of a factor
        completed since its last began (an overlapping schedule's refresh whose pieces all come in the next
        cycle) whole, so that the next schedule starts clean: nothing in flight, nothing completed. Its
        labels know nothing of this one's pieces; its inverse labels before a completion then do nothing in
        its first cycle, as at a run's start (:meth:`inv`), and every covariance this schedule completed is
        refreshed once."""
        for name, st in self.state.items():
            for f in FACTORS:
                flight = st.flight[f]
                if flight is None and f in st.completed:
                    st.completed.discard(f)
                    flight = self._begin(f, name)
                if flight is not None:
                    flight["refresh"].finish()
                    st.flight[f] = None
                    self._install(f, name, flight)

    def _begin(self, factor: str, name: str) -> dict[str, Any]:
        """Begin a refresh: take the factor from the statistics (:meth:`CurvatureStats.begin_refresh`),
        take the damping, and keep the matrix to invert (or take the eigenbasis of) in a
        :class:`pipefisher.kfac.refresh.Refresh` of :meth:`pieces` pieces."""
        p = self.pieces(name, factor)
        taken = self.stats.begin_refresh(factor, name)
        if taken is None:  # fp16: no piece of this refresh reached the factor
            return {"refresh": Refresh.nothing(p)}
        f, pi, kept, old_running = taken
        damp_a, damp_b = fx.damping_terms(self.damping_of(name), pi)
        basis = self.state[name].installed[factor] if self.method == "eigenbasis" else None
        refresh = Refresh(f, damp_a if factor == "A" else damp_b, method=self.method, dtype=self.dtype,
                          pieces=p, basis=basis, kept=kept, block=self.basis_block)
        return {"refresh": refresh, "f": f, "pi": pi, "old_running": old_running}

    def _install(self, factor: str, name: str, flight: dict[str, Any]) -> None:
        """Install a finished refresh: the new inverse (or basis), or the previous one where it is not honest.

        A factor that cannot be inverted honestly raises :class:`BadFactorError` (``on_bad_factor:
        stop``) or keeps the previous inverse and drops this refresh of the factor (``skip``). Nothing is
        read back here when there is a previous inverse: the new one is used on the device, or the previous
        one where the new one's findings say it is dishonest, and the findings are read once, for the whole
        refresh, with its last inverse (:meth:`_checked`). A first inverse is checked at once.
        """
        st = self.state[name]
        refresh = flight["refresh"]
        if refresh.mode == "none":  # fp16: every piece overflowed; kept, it counts as unchanged in the drift
            self._overflowed(name, factor)
            self._went_through(name, factor)
            return
        inverse, findings, ok = refresh.result()
        f, pi, old_running = flight["f"], flight["pi"], flight["old_running"]
        old_inverse = st.installed[factor]
        if old_inverse is None or old_running is None:  # nothing to fall back on: read the findings now
            if not self._judge(name, factor, self._read(findings)):
                self.stats.set_running(name, factor, old_running)
                self._went_through(name, factor)
                return
        else:
            inverse = torch.where(ok, inverse, old_inverse)
            f = torch.where(ok, f, old_running)
            if st.last_pi is not None:
                pi = torch.where(ok, torch.as_tensor(pi, dtype=torch.float64, device=ok.device), st.last_pi)
            self._unchecked.append((name, factor, findings))
            self._honest[name, factor] = ok
        st.last_pi = pi
        for listener in self.listeners:
            listener.replacing(name, factor, st.installed[factor])
        st.installed[factor] = inverse
        self.stats.set_running(name, factor, f)
        st.inversions[factor] += 1
        self._went_through(name, factor)

    def _went_through(self, name: str, factor: str) -> None:
        """The factor went through ``inv``: the listeners hear of it, then the refresh's checks may be due."""
        for listener in self.listeners:
            listener.refreshed(name, factor)
        self._inverted_one(name, factor)

    def _read(self, t: torch.Tensor) -> list[float]:
        """``t``'s elements as numbers: through the runtime's reader (counted), else at once."""
        return self.host.values(t) if self.host is not None else t.reshape(-1).tolist()

    def _inverted_one(self, name: str, factor: str) -> None:
        """Once every factor of every layer went through ``inv`` since the last check (the refresh's last
        inverse), its findings go to be read: with the runtime's next read, else at once."""
        self._inverted.add((name, factor))
        if len(self._inverted) == len(FACTORS) * len(self.layers):
            self.check_inverses()

    def check_inverses(self) -> None:
        """Hand the findings of the inverses not checked yet to be read (one read for all of them): with
        the runtime's next read (``host``), else now. A checkpoint and the run's end call it too."""
        batch, self._unchecked, self._inverted = self._unchecked, [], set()
        self._honest = {}
        if not batch:
            return
        flat = torch.stack([findings for _, _, findings in batch])
        if self.host is None:
            self._checked(batch, flat.reshape(-1).tolist())
        else:
            self.host.later(flat, lambda values: self._checked(batch, values))

    def settle(self) -> None:
        """Nothing unchecked, and nothing waiting for the host's next read."""
        self.check_inverses()
        if self.host is not None:
            self.host.settle()

    def _checked(self, batch: list[tuple[str, str, torch.Tensor]], values: list[float]) -> None:
        """The read findings of inverses already in place (each used on the device only where honest):
        a dishonest one stops the run, or counts as the skipped refresh it was (its inversion undone)."""
        n = fx.FINDINGS
        for i, (name, factor, _) in enumerate(batch):
            if not self._judge(name, factor, values[i * n:(i + 1) * n]):
                self.state[name].inversions[factor] -= 1

    def _judge(self, name: str, factor: str, findings: list[float]) -> bool:
        """Whether an inverse with these findings (read) is kept; if not, say why: fp16's overflow once per
        run, ``on_bad_factor: stop`` as :class:`BadFactorError`, ``skip`` as a warning and a skip counted."""
        if findings[-1] <= 0:  # fp16: every piece of this refresh overflowed, on every replica
            self._overflowed(name, factor)
            return False
        reason = fx.bad_factor(findings, self.method, what=f"K-FAC layer {name} factor {factor}")
        if reason is None:
            return True
        if self.on_bad_factor == "stop":
            raise BadFactorError(reason)
        self.state[name].skipped += 1
        self.warn(f"{reason}; kept the previous inverse (kfac.on_bad_factor: skip)")
        return False

    def _overflowed(self, name: str, factor: str) -> None:
        """fp16 left the factor no piece this refresh: the previous inverse stays, said once per run (an
        overflow usually hits every layer together)."""
        if not self._told_overflow:
            self._told_overflow = True
            self.warn(f"K-FAC layer {name} factor {factor}: every piece of this refresh overflowed in "
                      "fp16; kept the previous inverse (said once; CurvatureStats.state[...].overflowed counts them)")

    # -- checkpoints --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Per layer: what is installed, the pi scale, refresh counts, refreshes in flight in pieces and the
        factors completed since their last refresh began. Checks what is unchecked first."""
        self.settle()
        return {name: {"installed": dict(st.installed), "last_pi": st.last_pi, "inversions": dict(st.inversions),
                       "skipped": st.skipped, "flight": {f: _flight_state(st.flight[f]) for f in FACTORS},
                       "completed": sorted(st.completed)}
                for name, st in self.state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, st in self.state.items():
            s = state[name]
            st.installed = {f: s["installed"][f] for f in FACTORS}
            st.last_pi = s["last_pi"]
            st.inversions = {f: int(s["inversions"][f]) for f in FACTORS}
            st.skipped = int(s["skipped"])
            flights = s.get("flight", {})  # a checkpoint from before refreshes in pieces has none in flight
            st.flight = {f: _flight_from_state(flights.get(f)) for f in FACTORS}
            st.completed = set(s.get("completed", ()))
