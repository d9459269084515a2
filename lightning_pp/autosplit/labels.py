"""Find the labels a split model's loss counts, from the model call in the user's own step.

Under ``PipelineStrategy(split=...)`` the user's ``training_step`` computes the loss
(``self.model(input_ids=x, attention_mask=m, labels=y).loss``), so the strategy does not see the
labels. To weight microbatches by their valid targets it must know, before the step's first
backward, how many targets each microbatch's loss averages over. :func:`probe_labels` runs the
step on a microbatch only up to the call of the model (the module holding the split
container), reads the call's keyword arguments there and stops: no forward runs.

Counting is never guessed. Labels are counted only when

- the model is called with ``labels=`` (a tensor), and
- the model is a Hugging Face ``PreTrainedModel`` whose ``loss_function`` is the library's
  causal-LM loss (mean over labels ``!= ignore_index`` after the shift by one; a
  ``shift_labels=`` argument is counted as given) or masked-LM loss (no shift).

Otherwise :func:`probe_labels` says why not (:attr:`LabelProbe.reason`), and the strategy either
weights by samples (``loss_normalization="auto"``) or raises (``"tokens"``) unless the module
names the count itself (``pipeline_loss_count``).

Example::

    probe = probe_labels(lambda: module.training_step(microbatch, 0), module, "model.model.layers")
    probe.count   # valid shifted labels of this microbatch, or None (probe.reason says why)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from ..runtime.loss_weights import valid_targets

__all__ = ["LabelProbe", "probe_labels"]


class _Called(BaseException):
    """Raised from the model's pre-hook: ends the probe at the model call. A BaseException so
    that a user's ``except Exception`` does not swallow it."""

    def __init__(self, name: str, module: nn.Module, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.name, self.module, self.kwargs = name, module, kwargs


@dataclass(frozen=True)
class LabelProbe:
    """What the probe found: ``count`` (valid targets) or ``None`` with the ``reason``;
    ``model``: the name of the module called (relative to the LightningModule)."""

    count: int | None
    model: str | None
    reason: str


def _loss_kind(model: nn.Module) -> str | None:
    """``"causal"`` / ``"masked"`` for a Hugging Face model using the library's causal-LM /
    masked-LM loss; ``None`` for anything else (its loss is not known to mean over labels)."""
    try:
        from transformers import PreTrainedModel
        from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss
    except ImportError:  # pragma: no cover - transformers absent: no HF model either
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    fn = getattr(model, "loss_function", None)
    if fn is ForCausalLMLoss:
        return "causal"
    if fn is ForMaskedLMLoss:
        return "masked"
    return None


def _roots(module: nn.Module, split: str) -> list[tuple[str, nn.Module]]:
    """The modules on the path to the split container, outermost first, without the
    LightningModule itself and without the container."""
    path = split.split(".")
    out = []
    for depth in range(1, len(path)):
        name = ".".join(path[:depth])
        out.append((name, module.get_submodule(name)))
    return out


def probe_labels(step: Callable[[], Any], module: nn.Module, split: str) -> LabelProbe:
    """Run ``step()`` until it calls a module on the path to ``split``; count the call's labels.

    ``step`` is the user's hook on one microbatch (its ``self.log`` should be silenced by the
    caller). Nothing of the model runs: the call is stopped in a forward pre-hook.
    """
    handles = []

    def hook_for(name: str) -> Callable[..., Any]:
        def hook(mod: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            raise _Called(name, mod, kwargs)

        return hook

    for name, root in _roots(module, split):
        handles.append(root.register_forward_pre_hook(hook_for(name), with_kwargs=True))
    try:
        step()
    except _Called as call:
        return _count(call)
    finally:
        for h in handles:
            h.remove()
    return LabelProbe(None, None, f"the step did not call the model holding {split!r}")


def _count(call: _Called) -> LabelProbe:
    kwargs, name = call.kwargs, call.name
    labels = kwargs.get("labels")
    if not isinstance(labels, Tensor):
        return LabelProbe(None, name, f"`{name}` was called without a labels= tensor")
    if kwargs.get("num_items_in_batch") is not None:
        return LabelProbe(
            None,
            name,
            f"`{name}` was called with num_items_in_batch=: its loss is already divided by a "
            f"count the step chose, which the strategy cannot re-weight",
        )
    kind = _loss_kind(call.module)
    if kind is None:
        return LabelProbe(
            None,
            name,
            f"`{name}` ({type(call.module).__name__}) is not a Hugging Face model with the "
            f"library's causal-LM or masked-LM loss, so how its loss counts labels is unknown",
        )
    ignore = kwargs.get("ignore_index", -100)
    shifted = kwargs.get("shift_labels")
    if kind == "causal" and isinstance(shifted, Tensor):
        return LabelProbe(valid_targets(shifted, ignore_index=ignore), name, "shift_labels=")
    count = valid_targets(labels, ignore_index=ignore, shift=kind == "causal")
    return LabelProbe(count, name, f"labels= of `{name}` ({kind} LM loss)")
