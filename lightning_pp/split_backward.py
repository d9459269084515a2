"""Split one stage backward into ``I`` (input gradient) and ``W`` (weight gradients).

Zero-bubble schedules run a stage's backward in two steps: ``I`` computes only the gradient
of the stage INPUTS (what the previous stage waits for) and ``W``, later, the gradients of the
weights (what nothing waits for). Both halves together must cost what one fused backward
costs: every backward function runs once per output it computes, no second traversal.

How (:func:`backward_input`, then :meth:`WeightWork.run`):

1. One walk over the autograd graph from the stage outputs marks each node that leads to a
   stage input (the *input path*) and each that leads to a weight (any other leaf that requires
   grad, parameters in practice).
2. A node on the input path with an edge to a node OFF the input path that leads to weights is
   an *intermediate*: e.g. a Linear's ``AddmmBackward`` (edges to the input path, to ``TBackward``
   of the weight and to the bias). ``I`` hooks a pre-hook on each intermediate to keep the
   gradient that flows INTO it, and runs the autograd engine from the outputs to the stage
   inputs only (``inputs=``): the engine then computes only the outputs of each node whose edges
   lead to an input, so an ``AddmmBackward`` computes ``dX`` and skips ``dW``. The graph is
   retained.
3. ``W`` runs the engine from each intermediate's kept gradient (a
   :class:`~torch.autograd.graph.GradientEdge` root) to the weights, accumulating into
   ``.grad``. The engine re-enters the intermediate and computes only the outputs that lead to
   weights (``dW``, ``db``), then the weight-only nodes below. One engine call per group of
   intermediates that share weights (usually one per layer): within a call, a root whose input
   path reaches another root of the same group would recompute that path, so the other roots'
   pre-hooks clamp their gradient to the kept one. Groups never share weights, so no gradient is
   counted twice. Dropping the :class:`WeightWork` releases the graph (and the activations it
   saved).

Falls back to one fused backward in ``I`` (and a no-op ``W``) where splitting would not pay or
could be wrong: an intermediate that is a custom :class:`torch.autograd.Function` (its backward
computes every gradient whatever is asked, so it would run twice, and a reentrant checkpoint
would recompute its forward twice), unless its class sets ``split_backward_safe = True``. With
no weight on the path ``W`` is a no-op; with no input that requires grad (the first stage) ``I``
is a no-op and ``W`` runs the whole backward (nothing waits for the first stage's ``I``, and the
schedule places ``W``'s to fill idle time).

Example:
    >>> lin = torch.nn.Linear(3, 3)
    >>> x = torch.randn(2, 3, requires_grad=True)
    >>> y = torch.tanh(lin(x))
    >>> dx, work = backward_input((y,), (torch.ones_like(y),), (x,))
    >>> lin.weight.grad is None and dx[0] is not None
    True
    >>> work.run(); lin.weight.grad.shape
    torch.Size([3, 3])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = [
    "SPLIT_SAFE_ATTR",
    "WeightWork",
    "backward_input",
    "fused_backward",
    "weight_nodes",
]

SPLIT_SAFE_ATTR = "split_backward_safe"
"""A custom ``autograd.Function`` class attribute: ``True`` says its backward may run in both
``I`` and ``W`` (it is cheap, or it computes only what ``ctx.needs_input_grad`` asks for at
run time); without it, a Function at an intermediate makes that microbatch's backward fused."""

_run_backward = torch.autograd.Variable._execution_engine.run_backward  # type: ignore[attr-defined]


def fused_backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """The plain backward: every leaf's ``.grad`` (stage inputs included). The autograd engine
    directly, because ``torch.autograd.backward`` rejects a released output whose storage no
    longer matches its gradient's shape."""
    if outputs:
        _run_backward(tuple(outputs), tuple(grads), False, False, (), True, True)


@dataclass
class _Group:
    """Intermediates that share weights: ``roots[i]`` is a node and ``grads[i]`` the gradient
    that flowed into it during ``I`` (one entry per node input, ``None`` where none did)."""

    roots: list[Node] = field(default_factory=list)
    grads: list[list[torch.Tensor | None]] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)
    accumulators: list[Node] = field(default_factory=list)


@dataclass
class WeightWork:
    """What ``W`` needs from one ``I``: the kept gradients at the intermediates (which keep the
    retained graph alive) grouped by the weights they reach. ``fused``: the backward already ran
    whole in ``I`` (``run`` is a no-op)."""

    groups: list[_Group] = field(default_factory=list)
    fused: bool = False
    reason: str = ""
    graph: _Graph | None = None

    def nodes(self) -> set[Node]:
        """The nodes :meth:`run` will execute (empty once run, or with nothing to run): a
        saved tensor that only other nodes unpack can be freed now (what
        :meth:`RecomputeOnce.trim <lightning_pp.recompute.RecomputeOnce.trim>` does)."""
        if self.graph is None or not self.groups:
            return set()
        return _nodes_run(self.groups, self.graph)

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad``, then drop the graph."""
        groups, self.groups = self.groups, []
        self.graph = None
        for group in groups:
            edges, grads = [], []
            for node, node_grads in zip(group.roots, group.grads):
                for i, g in enumerate(node_grads):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if not edges:
                continue
            handles = []
            if len(group.roots) > 1:
                # A root whose input path reaches another root of this group would add its
                # recomputed share to that root's kept gradient: clamp each to what I kept.
                for node, node_grads in zip(group.roots, group.grads):
                    kept = tuple(node_grads)
                    handles.append(node.register_prehook(lambda _g, kept=kept: kept))
            try:
                _run_backward(
                    tuple(edges), tuple(grads), True, False, tuple(group.weights), True, True
                )
            finally:
                for h in handles:
                    h.remove()


def _node_of(t: torch.Tensor) -> Node | None:
    """The node a tensor's gradient flows into: its ``grad_fn``, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return torch.autograd.graph.get_gradient_edge(t).node


@dataclass
class _Graph:
    """One walk over the autograd graph below a stage's outputs: ``order`` is post-order
    (children first), ``reach_in`` / ``reach_w`` say whether a node leads to a stage input /
    to a weight."""

    order: list[Node]
    children: dict[Node, tuple[Node, ...]]
    reach_in: dict[Node, bool]
    reach_w: dict[Node, bool]


def _walk(root_nodes: Sequence[Node | None], input_nodes: set[Node]) -> _Graph:
    children: dict[Node, tuple[Node, ...]] = {}
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(n, False) for n in root_nodes if n is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        kids = tuple(n for n, _ in node.next_functions if n is not None)
        children[node] = kids
        stack.append((node, True))
        stack.extend((k, False) for k in kids if k not in children)
    reach_in: dict[Node, bool] = {}
    reach_w: dict[Node, bool] = {}
    for node in order:
        if node in reach_in:
            continue
        if node in input_nodes:
            reach_in[node], reach_w[node] = True, False
        elif not children[node] and hasattr(node, "variable"):  # AccumulateGrad of a weight
            reach_in[node], reach_w[node] = False, True
        else:
            kids = children[node]
            reach_in[node] = any(reach_in[k] for k in kids)
            reach_w[node] = any(reach_w[k] for k in kids)
    return _Graph(order, children, reach_in, reach_w)


def _intermediates(graph: _Graph) -> list[Node] | str:
    """Nodes on the input path with an edge off it that leads to weights (``W``'s roots), or
    why the backward must stay fused (a custom Function there that is not split-safe)."""
    inter: list[Node] = []
    for node in graph.order:
        if graph.reach_in[node] and any(
            not graph.reach_in[k] and graph.reach_w[k] for k in graph.children[node]
        ):
            if isinstance(node, torch.autograd.function.BackwardCFunction) and not getattr(
                getattr(node, "_forward_cls", None), SPLIT_SAFE_ATTR, False
            ):
                name = getattr(node, "_forward_cls", type(node)).__name__
                return f"custom autograd.Function {name}"
            inter.append(node)
    return inter


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], WeightWork]:
    """``I``: the gradients of ``inputs`` (``None`` for one that gets none) and the
    :class:`WeightWork` for ``W``. ``outputs`` are the stage outputs that take part in backward
    (or the scaled loss) and ``grads`` their gradients."""
    want = [t for t in inputs if t.requires_grad]
    input_nodes = {n for n in map(_node_of, want) if n is not None}
    root_nodes = [_node_of(t) for t in outputs]

    # -- 1. one walk: post-order over the graph below the outputs ------------------------------
    graph = _walk(root_nodes, input_nodes)
    reach_in = graph.reach_in

    # -- 2. intermediates: on the input path, with an edge off it that leads to weights --------
    inter = _intermediates(graph)
    if isinstance(inter, str):
        fused_backward(outputs, grads)
        dx = tuple(t.grad if t.requires_grad else None for t in inputs)
        return dx, WeightWork(fused=True, reason=inter)
    # Outputs off the input path that lead to weights (all of them on the first stage): W
    # starts there, with the gradient the caller gave.
    direct: dict[Node, list[torch.Tensor | None]] = {}
    for t, g, node in zip(outputs, grads, root_nodes):
        if node is not None and not reach_in[node] and graph.reach_w[node]:
            slot = direct.setdefault(node, [None] * len(node._input_metadata))  # type: ignore[attr-defined]
            nr = t.output_nr if t.grad_fn is not None else 0
            slot[nr] = g if slot[nr] is None else slot[nr] + g
    if not inter and not direct:  # no weight below: the whole backward is the input gradient
        if not want:
            return tuple(None for _ in inputs), WeightWork()
        got = _run_backward(tuple(outputs), tuple(grads), False, False, tuple(want), True, False)
        return _scatter(inputs, want, got), WeightWork()

    # -- 3. I: the engine from the outputs to the inputs only, keeping what flows into each
    #       intermediate ------------------------------------------------------------------------
    kept: dict[Node, list[torch.Tensor | None]] = {}

    def keep(node: Node):
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            kept[node] = list(grad_outputs)

        return hook

    handles = [n.register_prehook(keep(n)) for n in inter]
    try:
        in_roots = [
            (t, g) for t, g, n in zip(outputs, grads, root_nodes) if n is not None and reach_in[n]
        ]
        got: tuple[torch.Tensor | None, ...] = ()
        if want and in_roots:
            got = _run_backward(
                tuple(t for t, _ in in_roots),
                tuple(g for _, g in in_roots),
                True,  # retain: W runs the intermediates again
                False,
                tuple(want),
                True,
                False,
            )
    finally:
        for h in handles:
            h.remove()
    dx = _scatter(inputs, want, got) if got else tuple(None for _ in inputs)

    # -- 4. group the W roots by the weights they reach ----------------------------------------
    roots = [(n, kept[n]) for n in inter if n in kept] + list(direct.items())
    return dx, WeightWork(groups=_group(roots, graph), graph=graph)


def weight_nodes(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> set[Node] | None:
    """The nodes a split backward's ``W`` would run for this graph, without running anything
    (``None`` where the backward would stay fused). Every intermediate counts as a root, as if
    ``I`` reached it: a superset of what one ``W`` runs. Used by the recompute planner's probe
    to tell, per saved tensor, whether it must outlive ``I``."""
    want = [t for t in inputs if t.requires_grad]
    input_nodes = {n for n in map(_node_of, want) if n is not None}
    root_nodes = [_node_of(t) for t in outputs]
    graph = _walk(root_nodes, input_nodes)
    inter = _intermediates(graph)
    if isinstance(inter, str):
        return None
    direct = [n for n in root_nodes if n is not None and not graph.reach_in[n] and graph.reach_w[n]]
    roots = [(n, []) for n in dict.fromkeys([*inter, *direct])]
    return _nodes_run(_group(roots, graph), graph)  # type: ignore[arg-type]


def _nodes_run(groups: Sequence[_Group], graph: _Graph) -> set[Node]:
    """The nodes the ``W`` engine calls execute: one call per group, from the group's roots to
    its weights, so a node runs in the call of group g when a root of g reaches it and it
    reaches a weight of g. Two linear passes with a bit per group: what each node reaches
    (post-order), and which roots reach it (reverse post-order, parents first)."""
    to: dict[Node, int] = {}
    for g, group in enumerate(groups):
        for acc in group.accumulators:
            to[acc] = to.get(acc, 0) | (1 << g)
    for node in graph.order:
        bits = to.get(node, 0)
        for k in graph.children[node]:
            bits |= to.get(k, 0)
        to[node] = bits
    frm: dict[Node, int] = {}
    for g, group in enumerate(groups):
        for root in group.roots:
            frm[root] = frm.get(root, 0) | (1 << g)
    run: set[Node] = set()
    for node in reversed(graph.order):
        bits = frm.get(node, 0)
        if not bits:
            continue
        if bits & to.get(node, 0):
            run.add(node)
        for k in graph.children[node]:
            frm[k] = frm.get(k, 0) | bits
    return run


def _scatter(
    inputs: Sequence[torch.Tensor], want: list[torch.Tensor], got: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor | None, ...]:
    by_id = {id(t): g for t, g in zip(want, got)}
    return tuple(by_id.get(id(t)) for t in inputs)


def _group(roots: list[tuple[Node, list[torch.Tensor | None]]], graph: _Graph) -> list[_Group]:
    """One :class:`_Group` per set of roots connected by shared weights (union-find)."""
    children, reach_in, reach_w = graph.children, graph.reach_in, graph.reach_w
    parent = list(range(len(roots)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[Node, int] = {}  # weight accumulator -> a root that reaches it
    weights_of: list[list[Node]] = []
    for i, (node, _) in enumerate(roots):
        # the weights below this root's edges off the input path (the roots of the first stage:
        # below the root itself)
        seen: set[Node] = set()
        stack = [k for k in children[node] if not reach_in[k] and reach_w[k]]
        if not reach_in[node]:
            stack = [node]
        found: list[Node] = []
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if not children[n] and hasattr(n, "variable"):
                found.append(n)
            stack.extend(k for k in children[n] if reach_w[k] and not reach_in[k])
        weights_of.append(found)
        for acc in found:
            j = owner.setdefault(acc, i)
            if j != i:
                parent[find(i)] = find(j)
    groups: dict[int, _Group] = {}
    for i, (node, grads) in enumerate(roots):
        g = groups.setdefault(find(i), _Group())
        g.roots.append(node)
        g.grads.append(grads)
        for acc in weights_of[i]:
            if all(acc is not w for w in g.accumulators):
                g.accumulators.append(acc)
    for g in groups.values():
        g.weights = [acc.variable for acc in g.accumulators]  # type: ignore[attr-defined]
    return list(groups.values())
