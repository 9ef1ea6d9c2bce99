"""A factor's refresh in pieces: the work of one ``inv_kron_X`` refresh split so that it fits bubbles.

A whole refresh (a damped inverse, or an eigenbasis under ``kfac.update: soap``) of a 512- to 4096-wide
factor lasts longer than most pipeline bubbles, so a packer that must place it whole stretches the K-FAC
cycle. :class:`Refresh` holds one factor's refresh in flight and runs it in ``p`` pieces of about equal
time, its state carried between them (and into a checkpoint), giving what the whole refresh gives:

- ``cholesky``: ``(F + damping I)^-1`` by a left-looking Cholesky by column blocks, then the inverse by
  column blocks from the last one back, each from the inverse of the Schur complement right of it (block
  elimination: one large product per block): ``n^3`` flops in all, as torch's two whole calls
  (``cholesky`` and ``cholesky_inverse``), cut where a calibrated cost model (:func:`cholesky_plan`) says
  the time splits evenly, the same cut on every rank and after a resume (no timing decides it); exact up
  to rounding, with the findings :func:`pipefisher.kfac.factors.inverse_findings` gives (the Cholesky failure
  column included), so bad factors, ``on_bad_factor`` and the fallback work as for a whole inverse.
- ``eigenbasis``: SOAP's refresh from the previous basis, one power-iteration step ``Y = F Q_prev`` and an
  orthogonalisation, by column blocks from the largest eigenvalues down (each block orthogonalised against
  the blocks done by block Gram-Schmidt and a thin QR of its own, twice), every column kept in its
  place with its sign towards the previous column, so Adam's moments in the basis stay meaningful
  (:class:`pipefisher.kfac.eigenbasis.EigenbasisAdam` rotates the first moment by ``Q_new^T Q_old``, near
  the identity). The first refresh (no previous basis) is the whole ``eigh``, in its first piece.
- ``eigenbasis`` of a factor cut into diagonal blocks (``kfac.basis_block``): each block's ``eigh``, the
  blocks grouped into pieces of about equal work (``b^3`` each); exact, as the whole blocked refresh. A
  factor no wider than the block is one block, its ``eigh`` in its first piece (exact, as 1 piece gives),
  not the power step's approximate basis. What it was seen to cost (docs/benchmarks.md, "Factors averaged
  across refreshes under soap"): at 300 steps in the bubbles, 2 pieces (the 129-wide attention factors by
  the power step) ended 0.025 / 0.019 / 0.003 above 1 piece with about the same factor average; the race
  with exact bases brought back seed 1 only, so its worth there is within the run-to-run noise.

``p = 1`` is the whole refresh exactly as before (:func:`pipefisher.kfac.factors.inverse_findings`);
``eigen`` is never split (:data:`PIECE_METHODS`).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from pipefisher.kfac import factors as fx
from pipefisher.kfac.factors import column_blocks, diagonal_blocks

PIECE_METHODS = ("cholesky", "eigenbasis")
"""The refreshes that run in pieces; ``eigen`` (a whole ``eigh`` per refresh) is not split."""

AUTO_COLUMNS = 512
"""``kfac.refresh_pieces: auto`` gives a factor one piece per this many columns (rounded up): from
the figures in docs/benchmarks.md ("A refresh in pieces"): from about 500 columns on,
2 pieces cost at most 1.1x the whole inverse in all (below, 256: 1.25x)."""

BLOCKS_PER_PIECE = 3
"""Column blocks per piece of the eigenbasis power step: more blocks balance the pieces better, fewer run as
larger (faster) matrix products."""


def pieces_for(width: int, setting: int | str, method: str) -> int:
    """How many pieces a ``width``-wide factor's refresh runs in: ``setting`` (``kfac.refresh_pieces``),
    an integer, or ``auto`` (:data:`AUTO_COLUMNS`); never more than its columns, and 1 for a method that
    is not split."""
    if method not in PIECE_METHODS:
        return 1
    p = max(1, math.ceil(width / AUTO_COLUMNS)) if setting == "auto" else int(setting)
    return max(1, min(p, width))


def split_costs(costs: list[float], p: int) -> list[tuple[int, int]]:
    """``p`` contiguous ranges of the tasks whose costs are ``costs``, each of about ``sum / p``: a task
    goes into the piece its cost's midpoint falls in."""
    total, acc, i = sum(costs), 0.0, 0
    bounds = [0]
    for piece in range(1, p):
        while i < len(costs) and acc + costs[i] / 2 <= total * piece / p:
            acc += costs[i]
            i += 1
        bounds.append(i)
    bounds.append(len(costs))
    return list(zip(bounds[:-1], bounds[1:]))


CHOL_WEIGHT = 1.15
"""The Cholesky stage's time per flop against the inverse stage's: its blocks spend more of their flops
in the panel's triangular solve, slower than a product (each piece's minimum time on one thread, n = 1024
and 2048, put it at 1.1 to 1.3: docs/benchmarks.md, "A refresh in pieces")."""

MAX_BLOCK = {"cpu": 128, "cuda": 1024}
"""The widest column block one task runs, by device type (others: the CPU's). On a CPU core a block's own
work (its panel's solve, its diagonal block's inverse) grows with its width and runs slower than the
large products; narrower blocks make smaller, slower products (128 and 256 timed alike at n = 1024). On
a GPU every block pays fixed costs (the small factorisations' launches and latency) that blocks of 128
multiplied: on an H200, a 4096-wide inverse in 16 pieces cost 3.51x the whole in all with blocks of 128,
its largest piece 0.76x, and 1.41x and 0.22x with 1024 (docs/benchmarks.md, "A refresh in pieces")."""


def max_block(device: torch.device) -> int:
    """The widest column block of a Cholesky refresh on ``device`` (:data:`MAX_BLOCK`)."""
    return MAX_BLOCK.get(device.type, MAX_BLOCK["cpu"])

PLAN = 2
"""The cut of a ``cholesky`` refresh into pieces (:func:`cholesky_plan`): a checkpoint holds it, so that a
resumed refresh runs the remaining pieces exactly as planned; a checkpoint without it was cut by the first
plan (equal column blocks), which :meth:`Refresh.from_state` continues from the columns it factored."""


def _stage_flops(n: int, p: int, start: float, block: int = MAX_BLOCK["cpu"]) -> float:
    """The flops of the blocked inverse before position ``start`` of ``0..2n``: the Cholesky factor's first
    ``start`` columns (left-looking), then the inverse's last ``start - n`` columns, with the terms of the
    blocks' own work (the panel's solve, the diagonal block's inverse) at the width the plan's blocks have
    (about ``2n / p``, at most ``block``), the Cholesky's weighted by :data:`CHOL_WEIGHT`."""
    b = min(block, 2.0 * n / p)
    c = min(start, float(n))
    chol = CHOL_WEIGHT * (n * c * c - 2.0 * c ** 3 / 3.0 + b * (n * c - c * c / 2.0) + b * b * c / 3.0)
    d = max(start - n, 0.0)  # the inverse's columns are done from the last one back
    return chol + 2.0 * d ** 3 / 3.0 + 1.5 * b * d * d + b * b * d


def cholesky_plan(n: int, p: int, start: int = 0, first: int = 0, block: int = MAX_BLOCK["cpu"]) \
        -> tuple[list[tuple[str, int, int, float]], list[tuple[int, int]]]:
    """The blocked inverse of an ``n``-wide factor cut into pieces ``first..p-1`` from position ``start``
    (of ``0..2n``: the Cholesky columns, then the inverse's columns): each piece's weighted flops
    (:func:`_stage_flops`) as equal as whole columns allow. Returns the tasks ``(stage, first column, end
    column, cost)`` in order and each piece's range of them (pieces before ``first``: none); no block
    wider than ``block`` columns."""
    flops = lambda at: _stage_flops(n, p, at, block)
    base, total = flops(start), flops(2 * n)
    cuts = [start]
    for k in range(1, p - first):
        target = base + (total - base) * k / (p - first)
        lo, hi = cuts[-1], 2 * n  # the first position whose cost reaches the target, or the one before
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if flops(mid) < target else (lo, mid)
        if lo > cuts[-1] and target - flops(lo - 1) < flops(lo) - target:
            lo -= 1
        cuts.append(lo)
    cuts.append(2 * n)
    tasks: list[tuple[str, int, int, float]] = []
    ranges = [(0, 0)] * first
    for s0, s1 in zip(cuts[:-1], cuts[1:]):
        begin = len(tasks)
        for stage, a, b in (("chol", s0, min(s1, n)), ("inv", max(s0, n), s1)):
            count = -(-(b - a) // block)
            edges = [a + round((b - a) * i / count) for i in range(count + 1)] if b > a else []
            for e0, e1 in zip(edges[:-1], edges[1:]):
                j0, j1 = (e0, e1) if stage == "chol" else (2 * n - e1, 2 * n - e0)
                tasks.append((stage, j0, j1, flops(e1) - flops(e0)))
        ranges.append((begin, len(tasks)))
    return tasks, ranges


def _power_tasks(n: int, p: int) -> list[tuple[str, int, int, float]]:
    """The power step's tasks in order (the blocks of the largest eigenvalues first)."""
    tasks = []
    for j0, j1 in reversed(column_blocks(n, BLOCKS_PER_PIECE * p)):
        b, done = j1 - j0, n - j1
        tasks.append(("power", j0, j1, 2.0 * n * n * b + 8.0 * n * done * b + 2.0 * n * b * b))
    return tasks


class Refresh:
    """One factor's refresh in flight: :meth:`step` runs its next piece, :meth:`result` is what the whole
    refresh would give (``(inverse or basis, findings, honest)``, as
    :func:`pipefisher.kfac.factors.inverse_findings`). ``basis`` is the previous eigenbasis (``eigenbasis``;
    None: the first refresh, a whole ``eigh``). Nothing is read back to the host."""

    def __init__(self, f: torch.Tensor, damping: torch.Tensor | float, *, method: str, dtype: torch.dtype,
                 pieces: int, kept: torch.Tensor | None = None, basis: torch.Tensor | None = None,
                 block: int = 0) -> None:
        if method not in fx.INVERSE_METHODS:
            raise ValueError(f"inverse method must be one of {', '.join(fx.INVERSE_METHODS)}, not {method!r}")
        if pieces > 1 and method not in PIECE_METHODS:
            raise ValueError(f"a {method} refresh is not split into pieces ({', '.join(PIECE_METHODS)} are)")
        self.method, self.dtype, self.pieces, self.done = method, dtype, int(pieces), 0
        self.out_dtype, self.damping, self.kept = f.dtype, damping, kept
        self.chol_block = max_block(f.device)  # a cholesky refresh's plan (kept with it into a checkpoint)
        # under kfac.basis_block every eigenbasis refresh is exact, block by block: a factor one block
        # covers is one eigh (in the first of its pieces), cheap at that width, never the power step
        blocked = method == "eigenbasis" and block > 0 and (pieces > 1 or len(diagonal_blocks(f.shape[0], block)) > 1)
        self.block = block if blocked else 0
        self.mode = "blocks" if self.block else "whole" if pieces == 1 else \
            "cholesky" if method == "cholesky" else "eigh" if basis is None else "power"
        self.t: dict[str, Any] = {"f": f} if self.mode in ("whole", "eigh") else {}
        self._result: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if self.mode == "cholesky":
            m = f.to(self.dtype)
            m = m.clone() if m is f else m
            m.diagonal().add_(damping)
            self.t = {"m": m, "l": torch.zeros_like(m), "x": torch.zeros_like(m),
                      "first": torch.zeros((), dtype=torch.int32, device=m.device), "finite": fx.all_finite(f)}
        elif self.mode == "power":
            m = torch.nan_to_num(f.to(self.dtype), nan=0.0, posinf=0.0, neginf=0.0)
            low = m.tril()  # the lower triangle, as eigh reads it, made whole
            s, _ = fx.scaled_factor(low + low.tril(-1).t())
            self.t = {"s": s, "q_prev": basis.to(self.dtype), "q": torch.zeros_like(s), "finite": fx.all_finite(f)}
        elif self.mode == "blocks":
            self.t = {"f": f, "q": torch.zeros_like(f), "finite": fx.all_finite(f)}  # f is not changed
        self._plan()

    @classmethod
    def nothing(cls, pieces: int) -> "Refresh":
        """A refresh with nothing to compute (fp16: every micro-batch of the factor overflowed), still
        ``pieces`` labels long, so the labels that follow are its pieces, not a new refresh."""
        self = cls.__new__(cls)
        self.method, self.dtype, self.pieces, self.done = "none", torch.float32, int(pieces), 0
        self.out_dtype, self.damping, self.kept, self.mode, self.t = torch.float32, 0.0, None, "none", {}
        self.block, self.chol_block = 0, MAX_BLOCK["cpu"]
        self._result = None
        self._plan()
        return self

    def _plan(self, start: int | None = None) -> None:
        """The tasks and each piece's range of them; ``start``: a first-plan refresh continued from there."""
        if self.mode == "cholesky":
            first = 0 if start is None else self.done
            self.tasks, self.ranges = cholesky_plan(self.t["l"].shape[0], self.pieces, start or 0, first,
                                                    self.chol_block)
            return
        if self.mode == "blocks":
            self.tasks = [("block", j0, j1, float(j1 - j0) ** 3)
                          for j0, j1 in diagonal_blocks(self.t["q"].shape[0], self.block)]
        else:
            self.tasks = _power_tasks(self.t["s"].shape[0], self.pieces) if self.mode == "power" else []
        self.ranges = split_costs([c for *_, c in self.tasks], self.pieces)

    @property
    def finished(self) -> bool:
        return self.done >= self.pieces

    def step(self) -> bool:
        """Run the next piece; True once the refresh is complete (its :meth:`result` ready)."""
        if self.finished:
            raise RuntimeError("this refresh has run all its pieces")
        piece, self.done = self.done, self.done + 1
        if self.mode in ("whole", "eigh", "none"):
            if piece == 0 and self.mode != "none":
                self._result = fx.inverse_findings(self.t.pop("f"), self.damping, method=self.method,
                                                   dtype=self.dtype, pieces=self.kept)
        else:
            start, end = self.ranges[piece]
            for stage, j0, j1, _ in self.tasks[start:end]:
                getattr(self, "_" + stage)(j0, j1)
        if self.finished and self._result is None and self.mode != "none":
            self._result = self._findings()
        return self.finished

    def finish(self) -> None:
        """Run every piece left at once (a schedule switch: the new schedule knows nothing of this one)."""
        while not self.finished:
            self.step()

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self._result is not None, "the refresh has pieces left"
        return self._result

    # -- the blocked damped inverse ------------------------------------------------------------------

    def _chol(self, j0: int, j1: int) -> None:
        m, low = self.t["m"], self.t["l"]
        col = m[j0:, j0:j1] - low[j0:, :j0] @ low[j0:j1, :j0].t()  # only M's lower triangle is read
        b = j1 - j0
        top, info = torch.linalg.cholesky_ex(col[:b])
        pivots = top.diagonal()  # a failed block: non-positive pivots become 1, as the whole inverse does
        pivots.copy_(torch.where(pivots > 0, pivots, torch.ones_like(pivots)))
        first = self.t["first"]
        self.t["first"] = torch.where((first == 0) & (info > 0), info + j0, first).to(torch.int32)
        low[j0:j1, j0:j1] = top
        if j1 < m.shape[0]:
            low[j1:, j0:j1] = torch.linalg.solve_triangular(top.t(), col[b:], upper=True, left=False)
        if j1 == m.shape[0]:
            del self.t["m"]  # factored: the damped matrix is no longer needed

    def _inv(self, j0: int, j1: int) -> None:
        """Columns ``j0:j1`` of ``X = (L L^T)^-1`` (and their mirror), the columns right of them done: the
        inverse of the Schur complement ``L[j0:, j0:] L[j0:, j0:]^T`` from that of ``L[j1:, j1:]``, which
        is ``X[j1:, j1:]`` (block elimination), by one large product; with the Cholesky factor ``n^3``
        flops, as torch's two whole calls."""
        low, x = self.t["l"], self.t["x"]
        top = low[j0:j1, j0:j1]
        inner = torch.cholesky_inverse(top)
        if j1 < low.shape[0]:
            g = torch.linalg.solve_triangular(top, low[j1:, j0:j1], upper=False, left=False)  # L21 L11^-1
            y = x[j1:, j1:] @ g
            inner = inner + g.t() @ y
            x[j1:, j0:j1] = -y
            x[j0:j1, j1:] = -y.t()
        x[j0:j1, j0:j1] = inner

    # -- the diagonal blocks ---------------------------------------------------------------------------

    def _block(self, j0: int, j1: int) -> None:
        block = torch.nan_to_num(self.t["f"][j0:j1, j0:j1], nan=0.0, posinf=0.0, neginf=0.0)  # the block only
        self.t["q"][j0:j1, j0:j1] = fx.eigenbasis(block, self.dtype)

    # -- the power step ------------------------------------------------------------------------------

    def _power(self, j0: int, j1: int) -> None:
        s, q = self.t["s"], self.t["q"]
        y = s @ self.t["q_prev"][:, j0:j1]
        done = q[:, j1:]  # the blocks of larger eigenvalues, already orthonormal
        sign = torch.ones(j1 - j0, dtype=y.dtype, device=y.device)
        # block Gram-Schmidt, then a thin QR, twice: the second pass orthogonalises unit columns. A factor of
        # lower rank than its width (fewer rows than columns) leaves the blocks past its rank rounding noise
        # once the blocks done are taken out; two passes before one QR kept that noise's own component along
        # the blocks done, and normalising it made the basis no basis (||Q^T Q - I|| 2.8 at 4096 wide, 2048
        # rows, 16 pieces: docs/benchmarks.md, "A refresh in pieces")
        for _ in range(2):
            y = y - done @ (done.t() @ y)
            y, r = torch.linalg.qr(y.flip(1))  # the block's largest eigenvalue first, as across blocks
            y = y.flip(1)
            sign = sign * torch.where(r.diagonal() < 0, -1.0, 1.0).to(y.dtype).flip(0)
        q[:, j0:j1] = y * sign  # each column towards its predecessor

    def _findings(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole refresh's findings (:data:`pipefisher.kfac.factors.FINDINGS`) of the pieces' result."""
        out = self.t["x"] if self.mode == "cholesky" else self.t["q"]
        dev = out.device
        finite, out_finite = self.t["finite"], fx.all_finite(out)
        first = self.t["first"] if self.mode == "cholesky" else torch.zeros((), dtype=torch.int32, device=dev)
        ok = finite & out_finite & (first == 0)
        kept = torch.ones((), device=dev) if self.kept is None else self.kept.to(dev)
        if self.kept is not None:
            ok = ok & (kept > 0)
        findings = torch.stack([v.to(torch.float64) for v in (
            finite, torch.as_tensor(self.damping, device=dev), first, torch.zeros((), device=dev), out_finite, kept)])
        self.t = {}
        return out.to(self.out_dtype), findings, ok

    # -- checkpoints ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """All a resumed run needs to run the remaining pieces exactly as this one would."""
        return {"method": self.method, "dtype": self.dtype, "pieces": self.pieces, "done": self.done,
                "mode": self.mode, "out_dtype": self.out_dtype, "damping": self.damping, "kept": self.kept,
                "tensors": dict(self.t), "result": self._result, "plan": PLAN, "block": self.block,
                "chol_block": self.chol_block}

    def _legacy_start(self) -> int:
        """Where a refresh the first plan cut continues: after the columns it factored (their pivots are
        positive, a failed one's made 1), or with the inverse stage from its start (its partial ``W`` and
        ``X`` dropped: recomputed whole)."""
        self.t.pop("w", None)
        low = self.t["l"]
        if "m" not in self.t:
            self.t["x"].zero_()
            return low.shape[0]
        return int((low.diagonal() > 0).to(torch.int64).cumprod(0).sum())

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Refresh":
        self = cls.__new__(cls)
        self.method, self.dtype, self.pieces = state["method"], state["dtype"], int(state["pieces"])
        self.done, self.mode, self.out_dtype = int(state["done"]), state["mode"], state["out_dtype"]
        self.damping, self.kept, self.t = state["damping"], state["kept"], dict(state["tensors"])
        self._result, self.block = state["result"], int(state.get("block", 0))
        # the width it was planned with, on whatever device; before the width was kept, it was always 128
        self.chol_block = int(state.get("chol_block", 128))
        if self.mode == "cholesky" and self.t and state.get("plan") != PLAN:
            self._plan(self._legacy_start())
        elif self.t:
            self._plan()
        else:
            self.tasks, self.ranges = [], []
        return self
