"""The model-author API: how a LightningModule says where it may be cut.

A module that trains under :class:`~lightning_pp.strategy.PipelineStrategy` describes itself as an
ordered list of layers (:class:`PipelineLayers`), each taking the previous layer's output, plus
three small hooks from :class:`PipelineMixin`: the first layer's input, the loss of one
microbatch, and (optionally) evaluation metrics. The same module trains unchanged under a plain
``Trainer``: the mixin's default ``training_step``/``validation_step`` run all layers in order.

Two properties make pipelined runs reproduce plain runs exactly:

* every layer ``i`` is built under its own RNG stream seeded from ``(seed, i)``, so a layer's
  initial weights do not depend on which other layers the process builds;
* parameter names are keyed by the *original* layer index (``layers.3.attn.weight``), whatever the
  pipeline shape, so checkpoints are portable between pipeline shapes and plain training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ..layout.placement import layer_of, split_layer_name

__all__ = [
    "LayerSelector",
    "PipelineLayers",
    "PipelineMixin",
    "layer_of",
    "partition_weights",
    "rebuilt_layers_match",
    "replace_submodule",
    "select_layers",
]


class LayerSelector(Protocol):
    """Decides which layers this process builds, once the layer count is known."""

    def __call__(self, layers: PipelineLayers) -> Sequence[int]: ...


# Set by the strategy around ``configure_model``. A callable rather than a fixed index set: the
# strategy cannot know the number of layers (nor their sizes, for partition="parameters") before
# the module constructs its PipelineLayers, so the container asks the selector at build time.
_SELECTOR: ContextVar[LayerSelector | None] = ContextVar(
    "lightning_pp_layer_selector", default=None
)


@contextlib.contextmanager
def select_layers(selector: LayerSelector | Sequence[int]) -> Iterator[None]:
    """Build only some layers of every :class:`PipelineLayers` created inside this context.

    ``selector`` is a list of original layer indices, or a callable receiving the (not yet built)
    container and returning them.

    Example:
        >>> with select_layers([0, 2]):
        ...     layers = PipelineLayers([lambda: nn.Linear(2, 2)] * 4)
        >>> layers.built_indices
        [0, 2]
    """
    if not callable(selector):
        indices = list(selector)

        def selector(_layers: PipelineLayers) -> Sequence[int]:
            return indices

    token = _SELECTOR.set(selector)
    try:
        yield
    finally:
        _SELECTOR.reset(token)


def _layer_seed(seed: int, index: int) -> int:
    # Distinct, deterministic stream per (seed, layer); a large odd multiplier keeps nearby seeds
    # from sharing streams (seed=0,i=1 vs seed=1,i=0).
    return (seed * 1_000_003 + index * 7919 + 12345) % (2**63 - 1)


@contextlib.contextmanager
def _forked_rng(seed: int) -> Iterator[None]:
    device = torch.get_default_device()
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def partition_weights(
    module: Any, layers: PipelineLayers, partition: Any
) -> tuple[list[int] | None, list[float] | None]:
    """``(layer_params, layer_costs)`` a partition method needs from the module, else ``None``.

    ``"parameters"``: the module's :meth:`PipelineMixin.pipeline_layer_params`, or counted by
    building each layer on the meta device. ``"cost"``: :meth:`PipelineMixin.pipeline_layer_costs`
    (required).
    """
    if partition == "parameters":
        params = getattr(module, "pipeline_layer_params", lambda: None)()
        return (layers.layer_param_counts() if params is None else params), None
    if partition == "cost":
        costs = getattr(module, "pipeline_layer_costs", lambda: None)()
        if costs is None:
            raise ValueError(
                "partition='cost' needs the module to implement pipeline_layer_costs()"
            )
        return None, costs
    return None, None


def rebuilt_layers_match(built: PipelineLayers, rebuilt: PipelineLayers) -> bool:
    """Whether ``rebuilt`` is the same model as ``built``: the same layer count, no layer that
    ``built`` lacks, and the same parameter names and shapes in every layer (so ``built``'s values
    can stand where ``rebuilt``'s freshly initialised ones are)."""
    if built.num_layers != rebuilt.num_layers:
        return False
    if not set(rebuilt.built_indices) <= set(built.built_indices):
        return False
    for i in rebuilt.built_indices:
        shapes = {n: p.shape for n, p in built[i].named_parameters()}
        if shapes != {n: p.shape for n, p in rebuilt[i].named_parameters()}:
            return False
    return True


def replace_submodule(root: nn.Module, old: nn.Module, new: nn.Module) -> bool:
    """Put ``new`` wherever ``old`` is attached under ``root``; ``False`` if ``old`` is not."""
    for name, sub in root.named_modules():
        if sub is old and name:
            parent, _, attr = name.rpartition(".")
            setattr(root.get_submodule(parent) if parent else root, attr, new)
            return True
    return False


class PipelineLayers(nn.Module):
    """Ordered pipeline layers, keyed by their original index.

    Args:
        builders: one zero-argument callable per layer, returning the layer module. Layer ``i``
            receives the output of layer ``i - 1`` (a tensor or a tuple) as its single argument.
        seed: base seed; layer ``i`` is built under an RNG stream seeded from ``(seed, i)``.
        tied: groups of parameter names (relative to this container, starting with the layer
            index, e.g. ``("0.wte.weight", "5.head.weight")``) that are one tensor in the
            unpipelined model. The first name's layer initialises it. Locally built members of a
            group share one ``nn.Parameter``; the strategy keeps copies on different ranks equal.

    Which layers get built comes from :func:`select_layers` (set by the strategy around
    ``configure_model``); by default all of them.

    Example:
        >>> layers = PipelineLayers([lambda: nn.Linear(4, 4) for _ in range(3)], seed=1)
        >>> [name for name, _ in layers.named_parameters()][:2]
        ['0.weight', '0.bias']
        >>> layers(torch.zeros(2, 4)).shape
        torch.Size([2, 4])
    """

    def __init__(
        self,
        builders: Sequence[Callable[[], nn.Module]],
        seed: int = 0,
        tied: Sequence[Sequence[str]] = (),
    ) -> None:
        super().__init__()
        if len(builders) == 0:
            raise ValueError("PipelineLayers needs at least one layer builder, got 0")
        self._builders = list(builders)
        self.seed = int(seed)
        self.tied: list[tuple[str, ...]] = [tuple(group) for group in tied]
        for group in self.tied:
            if len(group) < 2:
                raise ValueError(f"a tied group needs at least two names, got {group!r}")
            for name in group:
                index, _ = split_layer_name(name)
                if not 0 <= index < len(self._builders):
                    raise ValueError(
                        f"tied parameter {name!r} names layer {index}, but there are "
                        f"{len(self._builders)} layers (0..{len(self._builders) - 1})"
                    )
        selector = _SELECTOR.get()
        wanted = range(len(self._builders)) if selector is None else selector(self)
        self.build(wanted)

    # -- structure -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """Number of layers of the whole model (built here or not)."""
        return len(self._builders)

    @property
    def built_indices(self) -> list[int]:
        """Original indices of the layers this process holds, ascending."""
        return sorted(int(name) for name in self._modules)

    def __getitem__(self, index: int) -> nn.Module:
        try:
            return self._modules[str(index)]
        except KeyError:
            raise IndexError(
                f"layer {index} is not held by this process (held: {self.built_indices})"
            ) from None

    def __contains__(self, index: object) -> bool:
        return str(index) in self._modules

    # -- building --------------------------------------------------------------------------
    def build(self, indices: Sequence[int]) -> None:
        """Build the given layers (each under its own RNG stream), then tie local copies."""
        for index in sorted(set(indices)):
            if not 0 <= index < self.num_layers:
                raise ValueError(f"layer index {index} out of range 0..{self.num_layers - 1}")
            if str(index) in self._modules:
                continue
            with _forked_rng(_layer_seed(self.seed, index)):
                layer = self._builders[index]()
            if not isinstance(layer, nn.Module):
                raise TypeError(f"builder {index} returned {type(layer).__name__}, not nn.Module")
            self.add_module(str(index), layer)
        self._tie_local()

    def keep_only(self, indices: Sequence[int]) -> None:
        """Drop every built layer not in ``indices`` (used when all layers were built eagerly)."""
        keep = {str(i) for i in indices}
        for name in list(self._modules):
            if name not in keep:
                del self._modules[name]

    def _tie_local(self) -> None:
        for group in self.tied:
            present = [n for n in group if split_layer_name(n)[0] in self]
            if len(present) < 2:
                continue
            owner = self.get_parameter(present[0])
            for name in present[1:]:
                module_path, _, attr = name.rpartition(".")
                setattr(self.get_submodule(module_path), attr, owner)

    def retie(self) -> None:
        """Make the local members of every tied group one ``Parameter`` again, the first
        member's: after a transform that replaced parameters module by module (tensor
        parallelism swaps each in a new ``DTensor``), a tie held on one rank (V placement's
        embedding and head) would otherwise become two independent weights."""
        self._tie_local()

    def tied_owner(self, group: Sequence[str]) -> str:
        """The name whose layer initialises a tied group (the first listed)."""
        return group[0]

    def layer_param_counts(self) -> list[int]:
        """Parameters per layer, counted by building each layer on the meta device (no memory)."""
        counts = []
        for builder in self._builders:
            with torch.device("meta"):
                layer = builder()
            counts.append(sum(p.numel() for p in layer.parameters()))
        return counts

    # -- running ---------------------------------------------------------------------------
    def forward(self, x: Any) -> Any:
        """Run the built layers in order (all of them in plain, unpipelined training)."""
        for index in self.built_indices:
            x = self._modules[str(index)](x)
        return x


class PipelineMixin:
    """Hooks a LightningModule implements to train under a pipeline (and without one).

    Required: build ``self.layers = PipelineLayers(...)`` in ``configure_model`` (so each rank
    materialises only its own layers; return early if they are built already, as Lightning
    calls ``configure_model`` again in every fit/validate/test/predict), and implement
    :meth:`pipeline_input` and :meth:`pipeline_loss`. The default
    ``training_step``/``validation_step``/``test_step`` run the layers in order on one process;
    under :class:`~lightning_pp.strategy.PipelineStrategy` the
    strategy runs the pipeline instead and calls the same hooks, so both paths log the same names.

    Example:
        >>> import lightning as L
        >>> import torch.nn.functional as F
        >>> class Regressor(PipelineMixin, L.LightningModule):
        ...     def configure_model(self):
        ...         if getattr(self, "layers", None) is not None:
        ...             return  # built already: Lightning calls this again in validate/test
        ...         self.layers = PipelineLayers([lambda: nn.Linear(8, 8) for _ in range(4)])
        ...     def pipeline_input(self, batch):
        ...         return batch[0]
        ...     def pipeline_loss(self, output, batch):
        ...         return F.mse_loss(output, batch[1])
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    """

    #: name under which the training loss is logged, in plain and pipelined runs alike
    train_loss_name: str = "train_loss"

    # -- what the strategy needs -----------------------------------------------------------
    def pipeline_layers(self) -> PipelineLayers:
        """The module's :class:`PipelineLayers` (default: attribute ``self.layers``)."""
        layers = getattr(self, "layers", None)
        if not isinstance(layers, PipelineLayers):
            raise TypeError(
                f"{type(self).__name__}.layers is {type(layers).__name__}, not PipelineLayers: "
                "create it in configure_model() or override pipeline_layers()"
            )
        return layers

    def pipeline_input(self, batch: Any) -> Any:
        """The first layer's input, taken from a (micro)batch."""
        raise NotImplementedError(f"{type(self).__name__} must implement pipeline_input(batch)")

    def pipeline_loss(self, output: Any, batch: Any) -> Tensor:
        """Scalar loss of one (micro)batch from the last layer's output (mean over samples)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement pipeline_loss(output, batch)"
        )

    def pipeline_loss_count(self, batch: Any) -> int | Tensor | None:
        """How many targets the loss of this (micro)batch averages over, or ``None``.

        ``None`` (default): ``pipeline_loss`` is a mean over the batch's samples, and
        microbatches and replicas are weighted by sample count. Return a count when the loss
        means over valid tokens (labels masked with an ignore index): under
        ``PipelineStrategy(loss_normalization="auto" | "tokens")`` each microbatch's loss is
        then weighted by its count, the count summed over the data-parallel replicas, so the
        step's loss and gradients are the token mean over the whole global batch, as in one
        process (docs/strategy.md, "Loss normalization"). Not used by the plain path.

        Example::

            def pipeline_loss(self, output, batch):
                return F.cross_entropy(output.flatten(0, 1), batch[1].flatten(), ignore_index=-100)

            def pipeline_loss_count(self, batch):
                return (batch[1] != -100).sum()
        """
        return None

    def pipeline_tied_parameters(self) -> list[tuple[str, ...]]:
        """Tied parameter groups (names relative to the layers container)."""
        return list(self.pipeline_layers().tied)

    def pipeline_layer_params(self) -> list[int] | None:
        """Optional parameter count per layer for ``partition="parameters"``.

        ``None`` (default) counts them by building each layer on the meta device.
        """
        return None

    def pipeline_layer_costs(self) -> list[float] | None:
        """Optional relative compute cost per layer for ``partition="cost"``."""
        return None

    def pipeline_tensor_parallel(self, layer: nn.Module, index: int, tp_mesh: Any) -> None:
        """Shard one built layer over the stage's tensor-parallel ranks (``tp > 1`` only).

        Called by :class:`~lightning_pp.strategy.PipelineStrategy` at setup, once for every
        layer this rank holds (``index``: its original layer index), with
        ``tp_mesh = self.device_mesh["tensor_parallel"]``, before the optimizer exists, as a
        ``ModelParallelStrategy`` user parallelizes in ``configure_model``. Apply
        ``torch.distributed.tensor.parallel.parallelize_module`` to ``layer`` in place. Keep
        each layer's OUTPUT a plain tensor, replicated over the tp ranks (``use_local_output``,
        the default of torch's styles, after a rowwise layer): that tensor is what the stage
        sends to the next one. Never called in plain, unpipelined training.

        Example::

            def pipeline_tensor_parallel(self, layer, index, tp_mesh):
                if isinstance(layer, Block):
                    parallelize_module(layer, tp_mesh, {
                        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                        "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
                        "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})
        """
        raise NotImplementedError(
            f"{type(self).__name__} is trained with tp > 1 but does not implement "
            f"pipeline_tensor_parallel(layer, index, tp_mesh): the strategy cannot know how to "
            f"shard its layers. Implement it (apply parallelize_module to each layer; see "
            f"docs/strategy.md 'Tensor parallel'), or train with tp=1"
        )

    def pipeline_eval_step(self, output: Any, batch: Any, split: str) -> dict[str, Tensor]:
        """Scalar metrics of one evaluation batch, computed from the last layer's output.

        Runs on the process that holds the last layer (under the pipeline: the last stage, with
        the outputs of all microbatches concatenated). ``split`` is ``"val"`` or ``"test"`` (the
        data split, not a pipeline stage).
        The strategy averages the values over data-parallel replicas and gives them to every
        rank, so monitors (``ModelCheckpoint(monitor="val_loss")``) work on all ranks.
        """
        return {f"{split}_loss": self.pipeline_loss(output, batch)}

    # -- logging, shared by the plain path and the strategy --------------------------------
    def pipeline_log_train_loss(self, loss: Tensor) -> None:
        """Log the training loss (the strategy calls this with the pipeline's loss)."""
        self.log(self.train_loss_name, loss, prog_bar=True, on_step=True, on_epoch=False)

    def pipeline_log_eval(self, values: dict[str, Tensor], split: str) -> None:
        """Log evaluation values (epoch means), identical on every rank; ``split``: ``"val"`` or
        ``"test"``.

        ``sync_dist=True``: under the pipeline the values are already the same on every rank
        (the strategy averaged them over the replicas), so Lightning's epoch-end mean over the
        ranks changes nothing; under another multi-process strategy (DDP) it is the mean over the
        replicas that each saw a shard. Without it Lightning warns on every epoch-level log."""
        self.log_dict(values, prog_bar=True, on_step=False, on_epoch=True, sync_dist=True)

    # -- the plain, single-process path ----------------------------------------------------
    def pipeline_forward(self, batch: Any) -> Any:
        """Run every layer on one process: the unpipelined forward."""
        return self.pipeline_layers()(self.pipeline_input(batch))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self.pipeline_forward(batch), batch)
        self.pipeline_log_train_loss(loss.detach())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.pipeline_log_eval(
            self.pipeline_eval_step(self.pipeline_forward(batch), batch, "val"), "val"
        )

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.pipeline_log_eval(
            self.pipeline_eval_step(self.pipeline_forward(batch), batch, "test"), "test"
        )

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self.pipeline_forward(batch)
