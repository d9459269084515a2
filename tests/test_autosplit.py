"""Splitting unmodified models (in one process): initial weights, keys, shares, side inputs,
and the errors for what cannot be split. Engine runs on gloo: tests/test_autosplit_engine.py."""

from __future__ import annotations

import pytest
import torch
from byom_models import GPT, MODELS, GPTConfig, lm_batch, model_fn, nanogpt_step, reference_step
from torch import nn

from lightning_pp.autosplit import (
    PhantomValueError,
    SplitError,
    SplitLayout,
    StagedModel,
    meta_build,
)
from lightning_pp.runtime.microbatch import split_microbatches

pytest.importorskip("transformers")

SEED = 7


def _build_all(name: str, num_stages: int):
    fn, split, step = model_fn(name)
    torch.manual_seed(SEED)
    plain = fn()
    staged = [
        StagedModel.build(fn, split=split, stages=[s], num_stages=num_stages, seed=SEED)
        for s in range(num_stages)
    ]
    return plain, staged, step


def _sequential_step(staged, step, batch, m):
    """Run every stage in turn, per microbatch (what the engine does across ranks), then
    backward stage by stage; tied copies' gradients are summed afterwards."""
    size = batch[0].shape[0]
    total = torch.zeros(())
    for mb in split_microbatches(batch, m):
        saved, h = [], None
        for st in staged:
            x = None if h is None else h.detach().requires_grad_(True)
            h = st.run(0, x, mb, step)
            saved.append((x, h))
        loss = h * (mb[0].shape[0] / size)
        total += loss.detach()
        grad = None
        for x, out in reversed(saved):
            (loss if grad is None else out).backward(grad)
            grad = x.grad if x is not None else None
    return total


def _tie_sum(staged):
    """Sum the gradients of each tied weight's copies (TiedParameterSync does this across ranks)."""
    copies: dict[tuple, list] = {}
    for st in staged:
        for t in st.tied:
            copies.setdefault(t.all_names, []).append(t.param)
    for params in copies.values():
        total = sum(p.grad for p in params)
        for p in params:
            p.grad = total.clone()


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# Llama (untied and tied) gets the same per-parameter gradient check on gloo in
# tests/test_autosplit_engine.py; Qwen2 and the tied models run here, in one process.
@pytest.mark.parametrize("name", [m for m in MODELS if not m.startswith("llama")])
def test_init_keys_share_and_gradients(name):
    plain, staged, step = _build_all(name, 4)
    ref = dict(plain.named_parameters(remove_duplicate=False))
    plain_keys = list(plain.state_dict())
    seen: list[str] = []
    for s, st in enumerate(staged):
        keys = list(st.model.state_dict())
        seen += keys
        # a rank's model holds exactly its stage's share, under the plain model's names
        mine = {n for n in ref if st.layout.stage_of(n) == s}
        assert {n for n, _ in st.model.named_parameters(remove_duplicate=False)} == mine
        want = sum({id(ref[n]): ref[n].numel() for n in mine}.values())
        assert sum(p.numel() for p in st.model.parameters()) == want
        for n, p in st.model.named_parameters(remove_duplicate=False):
            assert torch.equal(p, ref[n]), f"stage {s}: {n} differs from the plain build"
    assert sorted(seen) == sorted(plain_keys), "stage keys must partition the plain keys"
    assert len(seen) == len(set(seen))
    # two steps with different sequence lengths (and padding): loss and every gradient
    for i, seq in enumerate((9, 5)):
        batch = lm_batch(100 + i, 4, seq)
        plain.zero_grad()
        for st in staged:
            st.model.zero_grad()
        want = reference_step(plain, step, batch, m=2)
        got = _sequential_step(staged, step, batch, m=2)
        _tie_sum(staged)
        assert _rel(got, want) <= 1e-6
        for st in staged:
            for n, p in st.model.named_parameters(remove_duplicate=False):
                assert _rel(p.grad, ref[n].grad) <= 1e-6, (name, n)


def test_ties_are_found_from_shared_parameters():
    _, staged, _ = _build_all("gpt2", 2)
    assert [t.names for t in staged[0].tied] == [("transformer.wte.weight",)]
    assert [t.names for t in staged[1].tied] == [("lm_head.weight",)]
    assert staged[0].tied[0].stages == (0, 1)
    _, staged, _ = _build_all("llama", 2)
    assert all(not st.tied for st in staged)


def test_layout_places_prologue_first_and_head_last():
    shape = meta_build(lambda: GPT(GPTConfig()))
    lay = SplitLayout.discover(shape.model, "transformer.h", 4)
    assert lay.units == {
        "transformer.wte": 0,
        "transformer.wpe": 0,
        "transformer.ln_f": 3,
        "lm_head": 3,
    }
    assert [list(r) for r in lay.ranges] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(SplitError, match="8 blocks, fewer than the 16"):
        SplitLayout.discover(shape.model, "transformer.h", 16)
    with pytest.raises(SplitError, match="must name the ModuleList"):
        SplitLayout.discover(shape.model, "transformer", 4)


def test_rotary_tables_are_recomputed_on_every_stage():
    """Llama's rotary module has buffers only: real on every rank, so each stage computes the
    same cos/sin tables from position ids of the microbatch's own length."""
    _, staged, _ = _build_all("llama", 2)
    for st in staged:
        assert not st.model.model.rotary_emb.inv_freq.is_meta
    assert "model.rotary_emb" in staged[0].layout.shared


# -- what cannot be split: a clear error, never a wrong gradient ---------------------------------


class _SkipGPT(GPT):
    """Adds the embedding output to every block's output: a value crossing the cut."""

    def forward(self, idx, targets=None):
        x0 = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        x = x0
        for block in self.transformer.h:
            x = block(x) + 0.1 * x0
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _BranchGPT(GPT):
    """Control flow on the embedding's values."""

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        if x.abs().max() > 100:
            x = x / 2
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _EarlyExitGPT(GPT):
    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.transformer.h):
            if i == 3:
                break
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _HeadFirst(nn.Module):
    """Registers its head before the blocks: the default placement puts it on stage 0. Its loop
    body also applies ``tanh`` between blocks (code that must run once, on the sending stage)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 5)
        self.emb = nn.Embedding(5, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, idx, targets):
        x = self.emb(idx)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _run_stages(fn, split, step, batch, num_stages=2, **kw):
    staged = [
        StagedModel.build(fn, split=split, stages=[s], num_stages=num_stages, seed=0, **kw)
        for s in range(num_stages)
    ]
    h = None
    for st in staged:
        h = st.run(0, None if h is None else h.detach().requires_grad_(True), batch, step)
    return h


def test_value_crossing_the_cut_is_an_error_naming_the_module():
    batch = lm_batch(0, 2, 6)
    with pytest.raises(PhantomValueError, match=r"transformer\.h\.5.*transformer\.wte"):
        _run_stages(lambda: _SkipGPT(GPTConfig()), "transformer.h", nanogpt_step, batch)


def test_control_flow_on_values_across_the_cut_is_an_error():
    batch = lm_batch(0, 2, 6)
    with pytest.raises(PhantomValueError, match=r"`transformer\.wte.*data-dependent control"):
        _run_stages(lambda: _BranchGPT(GPTConfig()), "transformer.h", nanogpt_step, batch)


def test_blocks_skipped_by_the_forward_are_an_error():
    batch = lm_batch(0, 2, 6)
    want = r"stage 0 \(blocks 0-3\): the step returned before block 4 was called.*early exit"
    with pytest.raises(SplitError, match=want):
        _run_stages(lambda: _EarlyExitGPT(GPTConfig()), "transformer.h", nanogpt_step, batch)


def test_misplaced_head_is_an_error_and_placement_fixes_it():
    idx = torch.randint(0, 5, (2, 3))
    batch = (idx, idx)

    def step(m, mb):
        return m(*mb)

    with pytest.raises(PhantomValueError, match=r"computed from `head`.*placement"):
        _run_stages(_HeadFirst, "blocks", step, batch)
    torch.manual_seed(0)
    want = _HeadFirst()(*batch)
    got = _run_stages(_HeadFirst, "blocks", step, batch, placement={"head": "last"})
    assert torch.allclose(got, want, rtol=1e-6, atol=0)


def test_the_plain_model_still_runs_outside_a_stage():
    """Local modules keep their behaviour when no stage is running (e.g. a debug forward)."""
    fn, split, step = model_fn("nanogpt")
    st = StagedModel.build(fn, split=split, stages=[0], num_stages=1, seed=SEED)
    torch.manual_seed(SEED)
    plain = fn()
    batch = lm_batch(3, 2, 6)
    assert torch.equal(step(st.model, batch), step(plain, batch))


def test_a_module_held_under_a_second_name_is_staged_under_both():
    """A model that also keeps its last block as ``model.last`` (as some do, for convenience):
    a rank without that block has no real copy of it under either name (no parameters of
    another rank's block trained or saved here), and the rank with it finds it under both."""
    fn, split, step = model_fn("qwen2-tied")

    def aliased():
        model = fn()
        model.model.last = model.model.layers[-1]
        return model

    def staged(build, stages):
        return StagedModel.build(build, split=split, stages=stages, num_stages=4, seed=SEED)

    plain_first, first = staged(fn, [0]), staged(aliased, [0])
    assert not isinstance(first.model.model.last, type(fn().model.layers[-1]))
    count = lambda st: sum(p.numel() for p in st.model.parameters())  # noqa: E731
    assert count(first) == count(plain_first)
    assert first.model.state_dict().keys() == plain_first.model.state_dict().keys()
    last = staged(aliased, [3])
    assert last.model.model.last is last.model.model.layers[-1]
    batch = lm_batch(3, 2, 6)
    h = None
    ranks = [staged(aliased, [s]) for s in range(3)] + [last]
    for st in ranks:
        h = st.run(0, None if h is None else h.detach().requires_grad_(True), batch, step)
    torch.manual_seed(SEED)
    assert _rel(h.detach(), step(aliased(), batch).detach()) <= 1e-6


def test_a_stage_calls_no_hook_of_its_ranks_other_stages():
    """V placement at pp=2 (rank 0: stages 0 and 3, rank 1: stages 1 and 2): a stage's forward
    still calls blocks it passes through or stops at, and the head's rank calls the embedding.
    Those of the rank's OTHER stage are swapped for stand-ins while it runs, so their hooks
    (FSDP2's lazy init and all-gather) fire only in their own stage; the model is put back."""
    fn, split, step = model_fn("qwen2-tied")
    ranks = [
        StagedModel.build(fn, split=split, stages=s, num_stages=4, seed=SEED)
        for s in ([0, 3], [1, 2])
    ]
    running: list[int] = []
    calls: list[tuple[int, int]] = []  # (stage running, stage of the hooked module)
    for st in ranks:
        for c, stage in enumerate(st.stages):
            for m in st.stage_modules(c):
                m.register_forward_pre_hook(lambda *_, s=stage: calls.append((running[-1], s)))
    before = [{n: id(m) for n, m in st.model.named_modules()} for st in ranks]
    batch = lm_batch(3, 2, 6)
    h = None
    for st, c in ((ranks[0], 0), (ranks[1], 0), (ranks[1], 1), (ranks[0], 1)):
        running.append(st.stages[c])
        h = st.run(c, None if h is None else h.detach().requires_grad_(True), batch, step)
    assert calls and all(run == owner for run, owner in calls), calls
    assert [{n: id(m) for n, m in st.model.named_modules()} for st in ranks] == before
    torch.manual_seed(SEED)
    want = step(fn(), batch)
    assert _rel(h.detach(), want.detach()) <= 1e-6


def test_logs_of_the_last_stage_are_averaged_over_microbatches():
    """``self.log`` inside a split step: weighted by microbatch size like the loss; calls made
    on other stages (weight None) are dropped; non-scalars are refused."""
    from lightning_pp.strategy.split_build import _LogCapture

    cap = _LogCapture()
    cap.weight = 2
    cap("loss", torch.tensor(1.0), sync_dist=True)
    cap.weight = 6
    cap("loss", 3.0, sync_dist=True)
    cap.weight = None
    cap("loss", 100.0)
    assert cap.take() == {"loss": (2.5, (), {"sync_dist": True})}
    assert cap.take() == {}
    cap.weight = 1
    with pytest.raises(ValueError, match="scalars only"):
        cap("x", torch.ones(3))
    with pytest.raises(TypeError, match="not supported"):
        cap("x", object())
