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
4. With ``free_graph=True``, where every group is one Linear, LayerNorm or parameter scale
   (an RMSNorm's) on the input path,
   ``I`` first captures what their weight gradients read
   (:func:`~lightning_pp.runtime.weight_grad_direct.capture`) and then runs with the graph freed as
   it
   goes, as a fused backward does; ``W`` computes those gradients directly, with the engine's
   own operators and no engine call (:mod:`~lightning_pp.runtime.weight_grad_direct`).

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

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

from .weight_grad_direct import (
    DIRECT_KINDS,
    NONE,
    DirectJob,
    capture,
    direct_allowed,
    weight_slots,
)

__all__ = [
    "SPLIT_SAFE_ATTR",
    "autocast_off",
    "WeightWork",
    "backward_input",
    "fused_backward",
    "weight_nodes",
]

SPLIT_SAFE_ATTR = "split_backward_safe"
"""A custom ``autograd.Function`` class attribute: ``True`` says its backward may run in both
``I`` and ``W`` (it is cheap, or it computes only what ``ctx.needs_input_grad`` asks for at
run time); without it, a Function at an intermediate makes that microbatch's backward fused."""

DIRECT_WEIGHT_GRADS = True
"""Whether ``backward_input(free_graph=True)`` may free the graph at ``I`` and compute a Linear's
or a LayerNorm's weight gradients directly in ``W``
(:mod:`~lightning_pp.runtime.weight_grad_direct`:
the same operators, no engine call per layer). Off only to measure the difference; a retained
graph's ``W`` always runs the engine (measured: computing its layers directly saved nothing
there, the engine's calls free what each layer saved as they go)."""

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
    # whether W's call for this group must retain the graph: some node it runs runs in another
    # group's call too (a weight used twice, with another layer between its uses)
    retain: bool = True
    # per root, whether its kept gradient is its whole gradient (an intermediate: I's engine
    # call summed every path into it) rather than one output's share (a root off the input
    # path, given the caller's gradient: W's call must add what other roots send it)
    complete: list[bool] = field(default_factory=list)


@dataclass
class WeightWork:
    """What ``W`` needs from one ``I``: the kept gradients at the intermediates (which keep the
    retained graph alive) grouped by the weights they reach. ``fused``: the backward already ran
    whole in ``I`` (``run`` is a no-op)."""

    groups: list[_Group] = field(default_factory=list)
    fused: bool = False
    reason: str = ""
    # every node of the graph (scan order) and the positions of those W runs: the nodes are
    # held so their ids stay unique until W (saved_for_w keys node users by id)
    graph_nodes: list[Node] | None = None
    run_positions: tuple[int, ...] = ()
    # the graph-free form (``backward_input(free_graph=True)``): one captured layer per W
    # group and the gradient I kept for it; ``groups`` is then empty and no node is held
    jobs: list[tuple[DirectJob, torch.Tensor | None]] = field(default_factory=list)
    #: whether ``I`` freed the graph (``W`` holds only :meth:`held`)
    graph_freed: bool = False

    def held(self) -> list[torch.Tensor]:
        """The saved tensors a graph-free ``W`` keeps alive until it runs: each layer's input
        (and a norm's statistics). Not counted here, as a retained graph's are not either: the
        gradient that flowed into each layer during ``I`` (one per layer, the size of its
        output)."""
        return [t for job, _ in self.jobs for t in job.held()]

    def nodes(self) -> set[Node]:
        """The nodes :meth:`run` will execute (empty once run, or with nothing to run): a
        saved tensor that only other nodes unpack can be freed now (what
        :meth:`RecomputeOnce.trim <lightning_pp.runtime.recompute.RecomputeOnce.trim>` does). A
        superset where some intermediate got no gradient in ``I`` (never fewer: the trim
        must not free what ``W`` reads)."""
        if self.graph_nodes is None or not self.groups:
            return set()
        nodes = self.graph_nodes
        return {nodes[p] for p in self.run_positions}

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad``, then drop the graph.

        A group's engine call frees what its nodes saved as they run (as a fused backward
        does) unless one of them runs in another group's call too (``_Group.retain``).
        """
        groups, self.groups = self.groups, []
        jobs, self.jobs = self.jobs, []
        self.graph_nodes = None
        if jobs:
            # The graph is gone: no engine to fall back to, so W's operators must run as the
            # engine's would, whatever grad mode and autocast the caller has on around W.
            with torch.no_grad(), autocast_off():
                for job, g in jobs:
                    if g is not None:
                        job.run(g)
            return
        for group in groups:
            if len(group.roots) == 1 and len(group.grads[0]) == 1:
                # the common case (a Linear's or a norm's node): one root, one gradient, no
                # clamp to install
                g = group.grads[0][0]
                if g is not None:
                    edge = GradientEdge(group.roots[0], 0)
                    _run_backward(
                        (edge,), (g,), group.retain, False, tuple(group.weights), True, True
                    )
                continue
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
                # recomputed share to that root's kept gradient: clamp each intermediate to
                # what I kept, its whole gradient. Not a root off the input path (the first
                # stage's outputs): it holds only its output's gradient, and what the other
                # roots send it (an output that another output was computed from) is the rest.
                whole = group.complete or [True] * len(group.roots)  # unset: clamp every root
                for node, node_grads, complete in zip(group.roots, group.grads, whole):
                    if complete:
                        kept = tuple(node_grads)
                        handles.append(node.register_prehook(lambda _g, kept=kept: kept))
            try:
                _run_backward(
                    tuple(edges),
                    tuple(grads),
                    group.retain,
                    False,
                    tuple(group.weights),
                    True,
                    True,
                )
            finally:
                for h in handles:
                    h.remove()


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Autocast off on every device type that has it on (a no-op, and free, when none has).

    A backward runs under it: Lightning calls ``loss.backward()`` outside the precision
    plugin's forward context, and the autograd engine runs each backward op with the calling
    thread's autocast state, so a backward inside ``autocast`` would cast an fp32 matmul of the
    backward (a region the forward ran with autocast disabled) to bf16.
    """
    if not torch._C._is_any_autocast_enabled():
        yield
        return
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda", "xpu", "mps", "hpu"):
            try:
                on = torch.is_autocast_enabled(device)
            except RuntimeError:  # a device type this build does not know
                continue
            if on:
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _node_of(t: torch.Tensor) -> Node | None:
    """The node a tensor's gradient flows into: its ``grad_fn``, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return torch.autograd.graph.get_gradient_edge(t).node


# -- the graph's shape, and its analysis cached per shape -----------------------------------------
#
# Every microbatch of a chunk builds a new autograd graph, but (same code, same input shapes) of
# the same shape. The walk over it cannot be skipped (W needs this microbatch's nodes), but it
# is all the per-microbatch Python work there is: it numbers the nodes and yields a signature
# (every node's type, every edge, which positions are the outputs and the inputs) that
# determines the whole analysis -- which nodes are on the input path, the intermediates, the
# groups, the nodes W runs -- as positions. Two graphs with equal signatures get the same
# positions, so the analysis of the first is exact for the second; a graph that differs in
# anything the analysis reads (a branch taken differently, another sequence length that changes
# an op, a frozen weight) has another signature and is analysed afresh. Nothing but types and
# integers is cached (no node, no tensor).

_Signature = tuple[tuple[type, ...], tuple[tuple[int, ...], ...], tuple[int, ...], tuple[int, ...]]


_ACCUMULATE_GRAD = type(
    torch.autograd.graph.get_gradient_edge(torch.zeros(1, requires_grad=True)).node
)


def _scan(
    root_nodes: Sequence[Node | None], inputs: Sequence[torch.Tensor]
) -> tuple[list[Node], _Signature]:
    """Number every node below the roots (breadth-first discovery order); return the nodes and
    the graph's :data:`_Signature` ``(types, children, root positions, input positions)``
    (``-1``: an output with no node). ``inputs``: the tensors that want a gradient; a leaf's
    node is the accumulator whose ``variable`` it is (found here rather than by
    ``get_gradient_edge``, which builds a throwaway view per call); an input not in the graph
    is left out."""
    index: dict[Node, int] = {}
    nodes: list[Node] = []
    for n in root_nodes:
        if n is not None and n not in index:
            index[n] = len(nodes)
            nodes.append(n)
    kids: list[tuple[int, ...]] = []
    get, append = index.get, nodes.append
    for node in nodes:  # breadth-first: the loop reaches the nodes appended below
        ks = []
        for child, _ in node.next_functions:
            if child is None:
                continue
            j = get(child)
            if j is None:
                j = index[child] = len(nodes)
                append(child)
            ks.append(j)
        kids.append(tuple(ks))
    roots = tuple(-1 if n is None else index[n] for n in root_nodes)
    types = tuple(map(type, nodes))
    leaves = {id(t) for t in inputs if t.grad_fn is None}
    found = {index[t.grad_fn] for t in inputs if t.grad_fn is not None and t.grad_fn in index}
    if leaves:
        for i, t in enumerate(types):
            if t is _ACCUMULATE_GRAD and id(nodes[i].variable) in leaves:  # type: ignore[attr-defined]
                found.add(i)
    return nodes, (types, tuple(kids), roots, tuple(sorted(found)))


@dataclass(frozen=True)
class _Plan:
    """The analysis of one graph shape, in node positions (:func:`_scan`'s numbering).

    ``reason``: why the backward must stay fused (empty: split). ``inter``: the intermediates
    (on the input path, with an edge off it that leads to weights). ``in_root``: per output,
    whether its node is on the input path (an ``I`` root). ``direct``: outputs' nodes off the
    input path that lead to weights (``W`` starts there with the caller's gradient).
    ``groups``: ``(root positions, weight accumulator positions)`` per set of roots that share
    weights. ``run``: the nodes ``W``'s engine calls execute when every root has a gradient.
    ``retain``: per group, whether a node its call runs runs in another group's call too.
    ``captures``: per group, ``(kind, weight, bias)`` where the group is one intermediate of a
    :data:`~lightning_pp.runtime.weight_grad_direct.DIRECT_KINDS` type whose weights sit at the
    accumulator positions ``weight`` and ``bias``
    (:func:`~lightning_pp.runtime.weight_grad_direct.weight_slots`), ``None`` otherwise. Only an
    intermediate: any weight below its input edge would belong to another intermediate of the
    same group, so its weight edges reach all the group's weights; a root off the input path
    (the first stage's) reaches more weights through its input edge too. ``all_direct``: every
    group has one and no output starts ``W`` off the input path, so ``W`` can run from what
    :func:`~lightning_pp.runtime.weight_grad_direct.capture` keeps, without the graph.
    """

    reason: str = ""
    inter: tuple[int, ...] = ()
    in_root: tuple[bool, ...] = ()
    direct: frozenset[int] = frozenset()
    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    run: tuple[int, ...] = ()
    retain: tuple[bool, ...] = ()
    captures: tuple[tuple[str, int, int] | None, ...] = ()
    all_direct: bool = False


_PLANS: dict[_Signature, _Plan] = {}
_PLANS_MAX = 64  # shapes kept (a chunk has one per input shape; a few chunks per rank)


def _plan_for(
    root_nodes: Sequence[Node | None], inputs: Sequence[torch.Tensor]
) -> tuple[list[Node], _Plan]:
    nodes, sig = _scan(root_nodes, inputs)
    plan = _PLANS.get(sig)
    if plan is None:
        plan = _analyse(*sig)
        if len(_PLANS) >= _PLANS_MAX:
            del _PLANS[next(iter(_PLANS))]  # the oldest
        _PLANS[sig] = plan
    return nodes, plan


def _is_weight(t: type) -> bool:
    """An ``AccumulateGrad`` (a leaf's accumulator: a weight unless it is a stage input)."""
    return hasattr(t, "variable")


def _analyse(
    types: tuple[type, ...],
    kids: tuple[tuple[int, ...], ...],
    roots: tuple[int, ...],
    ins: tuple[int, ...],
) -> _Plan:
    n = len(types)
    # post-order (children first)
    order: list[int] = []
    seen = [False] * n
    stack: list[tuple[int, bool]] = [(r, False) for r in reversed(roots) if r >= 0]
    while stack:
        i, expanded = stack.pop()
        if expanded:
            order.append(i)
            continue
        if seen[i]:
            continue
        seen[i] = True
        stack.append((i, True))
        stack.extend((k, False) for k in kids[i] if not seen[k])
    is_in = set(ins)
    reach_in = [False] * n
    reach_w = [False] * n
    for i in order:
        if i in is_in:
            reach_in[i] = True
        elif not kids[i] and _is_weight(types[i]):
            reach_w[i] = True
        else:
            reach_in[i] = any(reach_in[k] for k in kids[i])
            reach_w[i] = any(reach_w[k] for k in kids[i])

    inter: list[int] = []
    for i in order:
        if reach_in[i] and any(not reach_in[k] and reach_w[k] for k in kids[i]):
            t = types[i]
            if issubclass(t, torch.autograd.function.BackwardCFunction) and not getattr(
                getattr(t, "_forward_cls", None), SPLIT_SAFE_ATTR, False
            ):
                return _Plan(
                    reason=f"custom autograd.Function {getattr(t, '_forward_cls', t).__name__}"
                )
            inter.append(i)
    in_root = tuple(r >= 0 and reach_in[r] for r in roots)
    direct = [r for r in dict.fromkeys(roots) if r >= 0 and not reach_in[r] and reach_w[r]]
    all_roots = list(dict.fromkeys([*inter, *direct]))

    # -- groups: roots connected by shared weights (union-find) -------------------------------
    parent = list(range(len(all_roots)))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    owner: dict[int, int] = {}  # weight accumulator -> a root that reaches it
    weights_of: list[list[int]] = []
    for a, r in enumerate(all_roots):
        # the weights below this root's edges off the input path (a root off the input path,
        # as on the first stage: below the root itself)
        todo = [k for k in kids[r] if not reach_in[k] and reach_w[k]] if reach_in[r] else [r]
        done: set[int] = set()
        found: list[int] = []
        while todo:
            j = todo.pop()
            if j in done:
                continue
            done.add(j)
            if not kids[j] and _is_weight(types[j]):
                found.append(j)
            todo.extend(k for k in kids[j] if reach_w[k] and not reach_in[k])
        weights_of.append(found)
        for acc in found:
            b = owner.setdefault(acc, a)
            if b != a:
                parent[find(a)] = find(b)
    members: dict[int, tuple[list[int], list[int]]] = {}
    for a, r in enumerate(all_roots):
        rs, accs = members.setdefault(find(a), ([], []))
        rs.append(r)
        accs.extend(acc for acc in weights_of[a] if acc not in accs)
    groups = tuple((tuple(rs), tuple(accs)) for rs, accs in members.values())

    # -- the nodes W runs: in group g's call, a node a root of g reaches that reaches a weight
    #    of g. Two linear passes with a bit per group: what each node reaches (post-order), and
    #    which roots reach it (reverse post-order, parents first).
    to = [0] * n
    for g, (_, group_accs) in enumerate(groups):
        for acc in group_accs:
            to[acc] |= 1 << g
    for i in order:
        bits = to[i]
        for k in kids[i]:
            bits |= to[k]
        to[i] = bits
    frm = [0] * n
    for g, (group_roots, _) in enumerate(groups):
        for r in group_roots:
            frm[r] |= 1 << g
    run: list[int] = []
    shared = 0  # the groups whose call runs a node that another group's call runs too
    for i in reversed(order):
        bits = frm[i]
        if not bits:
            continue
        calls = bits & to[i]
        if calls:
            run.append(i)
            if calls & (calls - 1):
                shared |= calls
        for k in kids[i]:
            frm[k] |= bits
    captures: list[tuple[str, int, int] | None] = []
    for group_roots, group_accs in groups:
        root = group_roots[0]
        kind = DIRECT_KINDS.get(types[root].__name__) if len(group_roots) == 1 else None
        where = weight_slots(kind, root, types, kids, reach_in) if kind and reach_in[root] else None
        if kind and where and {p for p in where if p != NONE} == set(group_accs):
            captures.append((kind, *where))
        else:
            captures.append(None)
    return _Plan(
        inter=tuple(inter),
        in_root=in_root,
        direct=frozenset(direct),
        groups=groups,
        run=tuple(run),
        retain=tuple(bool(shared >> g & 1) for g in range(len(groups))),
        captures=tuple(captures),
        # W needs no node at all: every group is one Linear or norm on the input path (so
        # every intermediate is a group's root) and no output starts W off that path
        all_direct=bool(groups) and not direct and all(c is not None for c in captures),
    )


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    free_graph: bool = False,
) -> tuple[tuple[torch.Tensor | None, ...], WeightWork]:
    """``I``: the gradients of ``inputs`` (``None`` for one that gets none) and the
    :class:`WeightWork` for ``W``. ``outputs`` are the stage outputs that take part in backward
    (or the scaled loss) and ``grads`` their gradients.

    ``free_graph``: where every layer ``W`` would run is a Linear or a LayerNorm on the input
    path (:mod:`~lightning_pp.runtime.weight_grad_direct`), keep just what their weight gradients
    read
    (each one's input, a norm's statistics, the gradient into it) and let ``I`` free the graph
    as it runs, as a fused backward does: nothing else the forward saved outlives ``I``, and
    ``W`` makes no engine call. Off for a graph whose saved tensors must stay readable after
    ``I`` (a recomputed region that ``W`` would recompute again); otherwise, or where a layer
    does not qualify, the graph is retained for ``W`` as usual.
    """
    want = [t for t in inputs if t.requires_grad]
    root_nodes = [_node_of(t) for t in outputs]

    # -- 1. the walk (numbers this graph's nodes), and the analysis of its shape ---------------
    nodes, plan = _plan_for(root_nodes, want)
    if plan.reason:
        fused_backward(outputs, grads)
        dx = tuple(t.grad if t.requires_grad else None for t in inputs)
        return dx, WeightWork(fused=True, reason=plan.reason)
    if not plan.groups:  # no weight below: the whole backward is the input gradient
        if not want:
            return tuple(None for _ in inputs), WeightWork()
        dx = _run_backward(tuple(outputs), tuple(grads), False, False, tuple(want), True, False)
        return _scatter(inputs, want, dx), WeightWork()
    if free_graph and plan.all_direct and want and DIRECT_WEIGHT_GRADS and direct_allowed():
        freed = _backward_input_freeing(outputs, grads, inputs, want, nodes, plan)
        if freed is not None:
            return freed

    # -- 2. I: the engine from the outputs to the inputs only, capturing the gradient that
    #       flows into each intermediate (an ``inputs=`` edge: the engine keeps it, in C++,
    #       and still runs the node for the input gradient below it) ---------------------------
    kept: dict[int, list[torch.Tensor | None]] = {}
    in_outs = [t for t, ok in zip(outputs, plan.in_root) if ok]
    got: tuple[torch.Tensor | None, ...] = ()
    if want and in_outs:
        edges: list[GradientEdge] = []
        spans: list[int] = []
        for p in plan.inter:
            node = nodes[p]
            k = len(node._input_metadata)  # type: ignore[attr-defined]
            edges.extend(GradientEdge(node, i) for i in range(k))
            spans.append(k)
        got = _run_backward(
            tuple(in_outs),
            tuple(g for g, ok in zip(grads, plan.in_root) if ok),
            True,  # retain: W runs the intermediates again
            False,
            (*want, *edges),
            True,
            False,
        )
        a = len(want)
        for p, k in zip(plan.inter, spans):
            kept[p] = list(got[a : a + k])
            a += k
        got = got[: len(want)]
    dx = _scatter(inputs, want, got) if got else tuple(None for _ in inputs)
    # Outputs off the input path that lead to weights (all of them on the first stage): W
    # starts there, with the gradient the caller gave.
    if plan.direct:
        for t, g, r in zip(outputs, grads, _scan_roots(root_nodes, nodes)):
            if r in plan.direct:
                node = nodes[r]
                slot = kept.setdefault(r, [None] * len(node._input_metadata))  # type: ignore[attr-defined]
                nr = t.output_nr if t.grad_fn is not None else 0
                prev = slot[nr]
                slot[nr] = g if prev is None else prev + g

    # -- 3. W's groups: this graph's nodes at the plan's positions -----------------------------
    groups = []
    for (rs, accs), retain in zip(plan.groups, plan.retain):
        acc_nodes = [nodes[p] for p in accs]
        groups.append(
            _Group(
                roots=[nodes[p] for p in rs],
                grads=[kept.get(p, []) for p in rs],
                weights=[acc.variable for acc in acc_nodes],  # type: ignore[attr-defined]
                accumulators=acc_nodes,
                retain=retain,
                complete=[p not in plan.direct for p in rs],
            )
        )
    return dx, WeightWork(groups=groups, graph_nodes=nodes, run_positions=plan.run)


def _backward_input_freeing(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    want: list[torch.Tensor],
    nodes: list[Node],
    plan: _Plan,
) -> tuple[tuple[torch.Tensor | None, ...], WeightWork] | None:
    """``I`` with the graph freed as it runs (``backward_input(free_graph=True)``), or ``None``
    (nothing run) where some layer cannot be captured. Every group is one intermediate here
    (``plan.all_direct``), and every output is on the input path."""
    jobs: list[DirectJob] = []
    edges: list[GradientEdge] = []
    for (rs, _), (kind, w, b) in zip(plan.groups, plan.captures):  # type: ignore[misc]
        node = nodes[rs[0]]
        job = capture(kind, node, _param_at(nodes, w), _param_at(nodes, b))
        if job is None:
            return None
        jobs.append(job)
        # only the node's first input: a Linear has one output, and a norm's backward reads
        # only the gradient of its normalized output (not of its mean and rstd)
        edges.append(GradientEdge(node, 0))
    got = _run_backward(tuple(outputs), tuple(grads), False, False, (*want, *edges), True, False)
    a = len(want)
    return _scatter(inputs, want, got[:a]), WeightWork(
        jobs=list(zip(jobs, got[a:])), graph_freed=True
    )


def _param_at(nodes: list[Node], position: int) -> torch.Tensor | None:
    """The parameter of the accumulator at a plan's ``position`` (``NONE``: absent)."""
    return None if position == NONE else nodes[position].variable  # type: ignore[attr-defined]


def _scan_roots(root_nodes: Sequence[Node | None], nodes: list[Node]) -> list[int]:
    """Each output's node position (``-1``: none); the roots are numbered first."""
    pos: dict[Node, int] = {}
    for n in root_nodes:
        if n is not None and n not in pos:
            pos[n] = len(pos)
    return [-1 if n is None else pos[n] for n in root_nodes]


def weight_nodes(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> set[Node] | None:
    """The nodes a split backward's ``W`` would run for this graph, without running anything
    (``None`` where the backward would stay fused). Every intermediate counts as a root, as if
    ``I`` reached it: a superset of what one ``W`` runs. Used by the recompute planner's probe
    to tell, per saved tensor, whether it must outlive ``I``."""
    want = [t for t in inputs if t.requires_grad]
    nodes, plan = _plan_for([_node_of(t) for t in outputs], want)
    if plan.reason:
        return None
    return {nodes[p] for p in plan.run}


def _scatter(
    inputs: Sequence[torch.Tensor], want: list[torch.Tensor], got: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor | None, ...]:
    by_id = {id(t): g for t, g in zip(want, got)}
    return tuple(by_id.get(id(t)) for t in inputs)
