"""A backward in two passes, as zero-bubble schedules run it: input gradients now (B), weight gradients later (W).

The B pass of a micro-batch computes what the previous stage waits for, the gradient of the stage's
input, and stops at the *joins*: the autograd nodes where a parameter's own sub-graph meets the data
path (a linear layer's matmul, a layer norm, the sum of two embeddings). It keeps the gradient that
arrived at each join. The W pass, run later by the schedule, starts one small backward at each join
from that kept gradient and goes down the parameter's side only, so it costs what the weight
gradients cost and nothing of the input side is computed twice. Both passes together give exactly the
gradients of one full backward (the same kernels on the same tensors).

How the graph is cut, in the graph's own terms:

- a node is *weight-only* when everything below it leads to exactly one parameter and to no data
  (the stage's input activation, or any leaf that is not a parameter): a parameter's accumulator, a
  transpose of a weight, an embedding lookup;
- a *join* is a node that is not weight-only with at least one weight-only child;
- a parameter whose weight-only side is also reachable through a join's data side (a module called
  twice in the stage, tied weights) would be counted twice by a per-join backward: its gradient is
  taken in the B pass instead, in full (there are no such parameters in the built-in model).

Hooks on layer outputs (K-FAC's output gradients) see the B pass. The W pass re-enters a join with
its kept gradient, which runs the join's tensor hooks once more: a hook that must see each gradient
once guards itself (:mod:`pipefisher.kfac.statistics` does).

Starting and stopping a backward at a node rather than at a tensor needs ``torch.autograd.grad`` to
take ``torch.autograd.graph.GradientEdge`` outputs and inputs: torch 2.4 and later (:data:`MIN_TORCH`;
the engine imports this module only for zero-bubble orders, so the others run on older torch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

MIN_TORCH = (2, 4)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


if _torch_version() < MIN_TORCH:
    raise ImportError(f"zero-bubble pipeline orders split each backward with torch.autograd.graph.GradientEdge "
                      f"outputs, which need torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (this is torch {torch.__version__})")

from torch.autograd.graph import GradientEdge  # noqa: E402  (after the version check: older torch lacks it)

_ACCUMULATE = "AccumulateGrad"


@dataclass
class DeferredWeights:
    """What one micro-batch's W pass needs: per join, its output edges, the gradients kept for them in
    the B pass, and the parameters on its weight-only side."""

    joins: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.nn.Parameter]]] = field(default_factory=list)

    def run(self) -> None:
        """The W pass: each join's weight gradients, added into ``.grad``; the graph is released after."""
        for edges, grads, params in self.joins:
            dws = torch.autograd.grad(edges, params, grad_outputs=grads, retain_graph=True, allow_unused=True)
            for p, dw in zip(params, dws):
                if dw is not None:
                    _accumulate(p, dw)
        self.joins = []


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g.detach().clone() if g.requires_grad else g
    else:
        p.grad += g


def _walk(roots: Sequence[Any]) -> tuple[list[Any], dict[Any, list[tuple[Any, int]]], dict[Any, set[int]]]:
    """Every node below ``roots`` in post-order (children first), each node's children with the
    output index they feed, and each node's outputs that carry a gradient into the graph."""
    children: dict[Any, list[tuple[Any, int]]] = {}
    used: dict[Any, set[int]] = {}
    order: list[Any] = []
    stack: list[tuple[Any, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        kids = [(c, i) for c, i in node.next_functions if c is not None]
        children[node] = kids
        stack.append((node, True))
        for c, i in kids:
            used.setdefault(c, set()).add(i)
            if c not in children:
                stack.append((c, False))
    return order, children, used


def backward_input(outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.nn.Parameter]
                   ) -> tuple[list[torch.Tensor | None], DeferredWeights]:
    """The B pass: gradients of ``inputs`` (None where an input needs none), and the W pass still owed.

    ``outputs`` are the stage's outputs (or its loss, with ``None`` for its gradient), ``params`` the
    stage's trainable parameters. Nothing of the weight-only side runs here, except the gradients of
    parameters a per-join backward would count twice (see the module's docstring), which are added
    into ``.grad`` now.
    """
    roots = [o for o in outputs if o.grad_fn is not None]
    grads = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, output_grads) if o.grad_fn is not None]
    wanted = [x for x in inputs if x.requires_grad]
    if not roots:
        return [None] * len(inputs), DeferredWeights()
    order, children, used = _walk([o.grad_fn for o in roots])
    for o in roots:
        used.setdefault(o.grad_fn, set()).add(o.output_nr)
    bit = {id(p): 1 << k for k, p in enumerate(params)}
    by_bit = {1 << k: p for k, p in enumerate(params)}
    below: dict[Any, int] = {}  # node -> bitmask of the parameters below it
    data: dict[Any, bool] = {}  # node -> whether anything but parameters lies below it
    for node in order:
        if type(node).__name__ == _ACCUMULATE:
            b = bit.get(id(node.variable), 0)
            below[node], data[node] = b, b == 0
            continue
        mask, has_data = 0, False
        for c, _ in children[node]:
            mask |= below[c]
            has_data = has_data or data[c]
        below[node], data[node] = mask, has_data

    def weight_only(n: Any) -> bool:
        return not data[n] and below[n] != 0 and below[n] & (below[n] - 1) == 0

    joins: list[tuple[Any, int]] = []  # (node, weight-side parameter mask)
    twice = 0  # parameters a per-join backward would count twice
    for node in order:
        if weight_only(node):
            continue
        side = data_side = 0
        for c, _ in children[node]:
            if weight_only(c):
                side |= below[c]
            else:
                data_side |= below[c]
        if side:
            twice |= side & data_side
            joins.append((node, side))
    edges = [GradientEdge(node, i) for node, _ in joins for i in sorted(used.get(node, ()))]
    shared = [by_bit[b] for b in by_bit if b & twice]
    if not (wanted or edges or shared):  # nothing below the outputs needs a gradient
        return [None] * len(inputs), DeferredWeights()
    got = torch.autograd.grad(roots, list(wanted) + edges + shared, grad_outputs=grads,
                              retain_graph=True, allow_unused=True)
    input_grads = dict(zip(map(id, wanted), got[:len(wanted)]))
    for p, g in zip(shared, got[len(wanted) + len(edges):]):
        if g is not None:
            _accumulate(p, g)
    kept = iter(got[len(wanted):len(wanted) + len(edges)])
    deferred = DeferredWeights()
    for node, side in joins:
        outs = [(GradientEdge(node, i), next(kept)) for i in sorted(used.get(node, ()))]
        outs = [(e, g) for e, g in outs if g is not None]
        mine = [by_bit[b] for b in by_bit if b & side & ~twice]
        if outs and mine:
            deferred.joins.append(([e for e, _ in outs], [g for _, g in outs], mine))
    return [input_grads.get(id(x)) for x in inputs], deferred
