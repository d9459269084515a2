"""The planner at tensor-parallel sizes: which sizes a model allows (the numbers named), what
one tp rank holds (the model's own plan, read from its hook), its bytes and collectives, the
search over ``tp``, and ``lightning-pp plan`` with ``strategy.tp``.

Pure Python on the meta device: no process group, no large tensor.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_pp.layout.rules import PreflightError, check_tp_sizes, check_world
from lightning_pp.models.decoder import DecoderLM
from lightning_pp.models.gpt import GPT
from lightning_pp.planner import LayerCost, ModelProfile, SearchSpace, chosen_config, search
from lightning_pp.planner.meta_profile import layer_tensor_shapes, meta_layer_costs, meta_layers
from lightning_pp.planner.sharding import rank_state_bytes
from lightning_pp.planner.tensor_parallel import (
    TpLayer,
    TpSizes,
    check_model_tp,
    local_layer,
    model_tp_sizes,
    record_tp_styles,
    tp_layer_cost,
    tp_layers,
    tp_options,
)

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
GPT_70B = str(ROOT / "configs" / "gpt_70b_pp8.yaml")
DEMO = str(ROOT / "configs" / "demo_cpu.yaml")
DECODER = "model.class_path=lightning_pp.models.decoder.DecoderLM"
C, V, T = 32, 64, 8


def _model(cls=DecoderLM, **kw):
    args = {"vocab_size": V, "n_layer": 2, "n_head": 4, "n_embd": C, "block_size": T, **kw}
    with torch.device("meta"):
        model = cls(**args)
        model.configure_model()
    return model


# ---- the sizes tp must divide -------------------------------------------------------------------


def test_sizes_not_divisible_are_named_with_the_fix():
    check_tp_sizes(8, heads=64, kv_heads=8, hidden=8192, ffn=28672, vocab=32000)
    with pytest.raises(PreflightError) as e:
        check_tp_sizes(8, heads=12, kv_heads=12, hidden=768, ffn=3072, vocab=50257)
    msg = str(e.value)
    assert e.value.key == "tp"
    assert "heads=12, kv_heads=12" in msg and "vocab=50257" in msg and "hidden=" not in msg
    assert "vocab 50257 -> 50264" in msg  # the padded size, a multiple of 8
    assert "[1, 2, 4]" in msg  # the tp sizes that divide heads, hidden and FFN
    with pytest.raises(PreflightError, match=r"vocab=50257.*pad the vocabulary"):
        check_tp_sizes(2, heads=12, vocab=50257)


def test_world_is_pp_dp_tp_with_the_numbers():
    assert check_world(16, 2, tp=4) == 2
    with pytest.raises(PreflightError, match=r"pp\(4\) \* tp\(4\) does not divide .* 24"):
        check_world(24, 4, tp=4)


def test_model_sizes_from_gpt_hparams_and_from_a_hugging_face_config():
    assert model_tp_sizes(_model()) == TpSizes(4, 4, C, 4 * C, V)
    hf = SimpleNamespace(
        config=SimpleNamespace(
            num_attention_heads=32,
            num_key_value_heads=8,
            hidden_size=4096,
            intermediate_size=14336,
            vocab_size=128256,
        )
    )
    sizes = model_tp_sizes(hf)
    assert (sizes.heads, sizes.kv_heads, sizes.ffn) == (32, 8, 14336)
    sizes.check(8)
    with pytest.raises(PreflightError, match="kv_heads=8"):
        sizes.check(16)


# ---- the model's own plan, one tp rank's shapes -------------------------------------------------


def test_the_plan_is_read_from_the_models_hook():
    model = _model()
    layers = meta_layers(model)
    styles = record_tp_styles(model, layers, 2)
    assert styles is not None
    emb, block, head = styles[0], styles[1], styles[-1]
    assert {n: s.kind for n, s in emb.items()} == {"wte": "rowwise"}  # wpe stays whole
    assert {n: s.kind for n, s in block.items()} == {
        "q": "colwise",
        "k": "colwise",
        "v": "colwise",
        "fc": "colwise",
        "proj": "rowwise",
        "fc_proj": "rowwise",
    }
    assert head["head"].kind == "colwise" and head["head"].gathered
    assert record_tp_styles(_model(GPT), meta_layers(_model(GPT)), 2) is None  # no hook
    with pytest.raises(PreflightError, match=r"n_head\(4\) is not divisible by tp\(8\)"):
        record_tp_styles(model, layers, 8)


def test_one_tp_rank_holds_the_sharded_linears_and_the_whole_norms():
    model = _model()
    layers = meta_layers(model)
    styles = record_tp_styles(model, layers, 2)
    block = local_layer(layers[1], styles[1], 2)
    qkv = 3 * (C * C + C)
    fc = C * 4 * C + 4 * C
    whole = qkv + (C * C + C) + fc + (4 * C * C + C) + 4 * C  # + two LayerNorms
    half = qkv // 2 + (C * C // 2 + C) + fc // 2 + (4 * C * C // 2 + C) + 4 * C
    assert sum(p.numel() for p in layers[1].parameters()) == whole
    assert sum(p.numel() for p in block.parameters()) == half
    assert tuple(block.k.weight.shape) == (C // 2, C) and tuple(block.fc_proj.bias.shape) == (C,)
    emb = local_layer(layers[0], styles[0], 2)
    assert tuple(emb.wte.weight.shape) == (V // 2, C) and tuple(emb.wpe.weight.shape) == (T, C)
    # the planner's state formula on the local shapes: parameter-sized states shrink as held
    full = rank_state_bytes([[layer_tensor_shapes(layers[1])]])
    local = rank_state_bytes([[layer_tensor_shapes(block)]])
    assert local.numel == half and local.optimizer * whole == full.optimizer * half
    assert layers[1].q.weight.shape == (C, C)  # the model itself is untouched


def test_activations_shrink_inside_the_block_not_at_its_boundary():
    model = _model()
    layers = meta_layers(model)
    styles = record_tp_styles(model, layers, 4)
    x0 = torch.randint(0, V, (2, T), device="meta")
    whole = meta_layer_costs(layers, x0)
    local = meta_layer_costs([local_layer(la, s, 4) for la, s in zip(layers, styles)], x0)
    block_w, block_l = whole[1], local[1]
    assert block_l.boundary_bytes == block_w.boundary_bytes == 2 * T * C * 4
    assert block_l.input_bytes == block_w.input_bytes
    assert block_l.saved_bytes < block_w.saved_bytes
    # what stays whole: the block's input and its LayerNorms' outputs, the residual
    assert block_l.saved_bytes > block_w.saved_bytes / 4


def test_tp_shares_and_collectives_of_each_layer():
    model = _model()
    layers = meta_layers(model)
    styles = record_tp_styles(model, layers, 2)
    x0 = torch.randint(0, V, (1, T), device="meta")
    shares = tp_layers(layers, styles, x0, 2)
    act = T * C * 4  # one sample's hidden activation, fp32
    emb, block, head = shares[0], shares[1], shares[-1]
    assert emb.fwd_all_reduce == (act,) and not emb.bwd_all_reduce  # vocabulary-parallel
    assert block.fwd_all_reduce == (act, act)  # proj, fc_proj
    assert block.bwd_all_reduce == (act,) * 4  # q, k, v, fc: the input gradient
    assert head.all_gather == (T * V * 4,) and head.bwd_all_reduce == (act,)
    assert 0.5 < block.param_ratio < 0.52 and block.saved_ratio < 1
    fwd, bwd = block.comm_seconds(4, latency_s=1e-4, bandwidth=1e9)
    assert fwd == pytest.approx(2 * (4 * act / 1e9 + 2e-4))  # 2 (tp-1)/tp = 1 at tp = 2
    assert bwd == pytest.approx(2 * fwd)


def test_sequence_parallelism_cuts_the_boundary_the_planner_counts(capsys):
    """DecoderLM(sequence_parallel=True): the styles read from its hook say which layers'
    inputs and outputs hold T / tp positions (the embedding's output, each block's input and
    output, the head's input; not the tokens, not the logits), as the runtime measured them
    (tests/test_tensor_parallel.py); a profiled layer's boundary and input then shrink by tp,
    and `plan` halves the P2P buffers at tp 2."""
    from lightning_pp.planner.tensor_parallel import sequence_cuts

    model = _model(sequence_parallel=True)
    layers = meta_layers(model)
    styles = record_tp_styles(model, layers, 2)
    assert sequence_cuts(styles) == [(False, True), (True, True), (True, True), (True, False)]
    plain = _model()
    assert not any(a or b for a, b in sequence_cuts(record_tp_styles(plain, layers, 2)))
    x0 = torch.randint(0, V, (1, T), device="meta")
    shares = tp_layers(layers, styles, x0, 2)
    cost = LayerCost(t_f=1.0, t_i=1.0, t_w=1.0, params=100, boundary_bytes=64, input_bytes=64)
    block = tp_layer_cost(cost, shares[1], samples=1, latency_s=0.0, bandwidth=1.0)
    emb = tp_layer_cost(cost, shares[0], samples=1, latency_s=0.0, bandwidth=1.0)
    assert (block.boundary_bytes, block.input_bytes) == (32, 32)
    assert (emb.boundary_bytes, emb.input_bytes) == (32, 64)  # the tokens are not cut
    buffers = {}
    for sp in ("false", "true"):
        code, out, err = _plan(
            capsys, DEMO, DECODER, "strategy.tp=2", f"+model.init_args.sequence_parallel={sp}"
        )
        assert code == 0, err
        table = out.split("--- memory per pipeline rank")[1]
        buffers[sp] = [line.split()[11:13] for line in table.splitlines()[5:7]]  # buffers
    for (size, unit), (half, half_unit) in zip(buffers["false"], buffers["true"]):
        assert (size, unit) == ("1.00", "MiB") and (half, half_unit) == ("512.00", "KiB")


def test_a_profiled_layer_on_one_tp_rank():
    cost = LayerCost(
        t_f=1.0, t_i=1.0, t_w=1.0, t_fused=1.8, saved_bytes=800, params=100, param_bytes=400,
        boundary_bytes=64, input_bytes=64,
    )  # fmt: skip
    share = TpLayer(4, 26, 100, saved_ratio=0.5, fwd_all_reduce=(16,), bwd_all_reduce=(16,))
    got = tp_layer_cost(cost, share, samples=2, latency_s=0.0, bandwidth=1.0)
    assert (got.params, got.param_bytes, got.saved_bytes) == (26, 104, 400)
    assert (got.boundary_bytes, got.input_bytes) == (64, 64)  # the stage boundary stays whole
    ar = 2 * 3 / 4 * 16 * 2  # ring all-reduce of 32 bytes over 4 ranks, 1 byte/s
    assert got.t_f == pytest.approx(0.26 + ar) and got.t_w == pytest.approx(0.26)
    assert got.t_i == pytest.approx(0.26 + ar) and got.t_fused == pytest.approx(0.468 + ar)
    assert tp_layer_cost(cost, TpLayer(1, 100, 100), 2, 0.0, 1.0) is cost


def test_tp_options_name_why_a_size_is_left_out():
    model = _model()
    options = dict(tp_options(model, meta_layers(model), world=8, pp=2))
    assert options[1] is None and options[2] is None and options[4] is None
    assert options[8] == "world 8 % (pp 2 x tp 8) = 8"
    options = dict(tp_options(model, meta_layers(model), world=16, pp=2))
    assert "heads=4" in options[8]
    gpt = _model(GPT)
    assert "no pipeline_tensor_parallel hook" in check_model_tp(gpt, meta_layers(gpt), 2)


# ---- the search over tp -------------------------------------------------------------------------


def _profile() -> ModelProfile:
    layer = LayerCost(
        t_f=4e-3, t_i=4e-3, t_w=4e-3, saved_bytes=40_000, param_bytes=4_000_000,
        params=1_000_000, boundary_bytes=1000, input_bytes=1000,
    )  # fmt: skip
    return ModelProfile(
        {4: [layer] * 6}, tokens_per_sample=16, latency_s=1e-5, bandwidth=1e10, overhead_s=1e-4
    )


def test_search_tries_tp_where_the_world_allows_with_every_sharding():
    shares = {
        tp: [TpLayer(tp, 1_000_000 // tp, 1_000_000, 1 / tp, (250,), (250,))] * 6 for tp in (2, 4)
    }
    space = SearchSpace(recomputes=(None,), splits=("uniform",), tps=(1, 2, 4, 8))
    result = search(_profile(), world=8, global_batch=16, space=space, tp_layers=shares)
    seen = {(p.candidate.tp, p.candidate.pp, p.candidate.dp) for p in result.ranked}
    assert {tp for tp, _, _ in seen} == {1, 2, 4}
    assert all(tp * pp * dp == 8 for tp, pp, dp in seen)
    assert ("tp=8", "no tensor-parallel shares of the layers (tp_layers)") in result.rejected
    tp_rows = [p for p in result.ranked if p.candidate.tp > 1]
    # zero and fsdp both shard each tp share over dp
    assert {p.candidate.sharding_label for p in tp_rows if p.candidate.dp > 1} == {
        "none",
        "zero=1",
        "fsdp",
    }
    assert {p.candidate.sharding_label for p in tp_rows if p.candidate.dp == 1} == {"none"}
    assert {p.candidate.sharding_label for p in result.ranked if p.candidate.tp == 1} == {
        "none",
        "zero=1",
        "fsdp",
    }
    # the same pipeline with tp 2 instead of dp 2: half the states per rank
    by = {(p.candidate.tp, p.candidate.pp, p.candidate.microbatches): p for p in result.ranked
          if p.candidate.sharding_label == "none" and p.candidate.schedule == "1f1b"}  # fmt: skip
    one, two = by[(1, 2, 2)], by[(2, 2, 2)]
    assert two.heaviest.params * 2 == one.heaviest.params
    assert "tp2" in two.candidate.shape
    strategy = chosen_config({"strategy": {}}, two, world=8)["strategy"]
    assert strategy["tp"] == 2 and strategy["zero"] == 0
    # fsdp and zero=1 at tp 2 (dp 2): the tp share's optimizer state split over the two
    # replicas; under zero the parameters stay whole tp shares
    for label, fsdp, zero in (("fsdp", True, 0), ("zero=1", False, 1)):
        sharded = next(
            p for p in result.ranked
            if (p.candidate.tp, p.candidate.pp, p.candidate.microbatches) == (2, 2, 2)
            and p.candidate.sharding_label == label and p.candidate.schedule == "1f1b"
        )  # fmt: skip
        assert sharded.heaviest.optimizer * 2 == two.heaviest.optimizer
        assert zero == 0 or sharded.heaviest.params == two.heaviest.params
        strategy = chosen_config({"strategy": {}}, sharded, world=8)["strategy"]
        assert (strategy["tp"], strategy["fsdp"], strategy["zero"]) == (2, fsdp, zero)
    plain = search(_profile(), world=8, global_batch=16, space=SearchSpace(recomputes=(None,)))
    assert {p.candidate.tp for p in plain.ranked} == {1}


# ---- lightning-pp plan --------------------------------------------------------------------------


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    from lightning_pp.commands.cli import main

    code = main(["plan", *args])
    got = capsys.readouterr()
    return code, got.out, got.err


def test_plan_refuses_a_tp_the_model_cannot_take(capsys):
    for how in (["strategy.tp=2"], ["--tp", "2"]):  # --tp N is the override strategy.tp=N
        code, _, err = _plan(capsys, DEMO, *how)
        assert code == 2 and "strategy.tp" in err and "no pipeline_tensor_parallel hook" in err
    code, _, err = _plan(
        capsys, DEMO, DECODER, "strategy.tp=8", "strategy.pp=1", "trainer.devices=8"
    )
    assert code == 2 and "heads=4, kv_heads=4" in err
    code, _, err = _plan(capsys, DEMO, DECODER, "strategy.tp=2", "+strategy.tp_plan=auto")
    assert code != 0 and "tp_plan" in err


def test_plan_prints_per_rank_bytes_at_the_configs_tp_and_each_other(capsys):
    code, out, err = _plan(capsys, DEMO, DECODER, "strategy.tp=2")
    assert code == 0, err
    assert "pipeline: pp=2 x dp=1 x tp=2 (world 4)" in out
    assert "tensor-parallel rank of tp=2" in out
    section = out.split("--- tensor parallel:")[1]
    rows = {line.split()[0]: line.split() for line in section.splitlines()[3:7]}
    assert rows["1"][1] == "2" and rows["2"][1:3] == ["*", "1"]
    assert "world 4 % (pp 2 x tp 4) != 0" in section


def test_70b_per_rank_bytes_at_each_tp(capsys):
    code, out, err = _plan(capsys, GPT_70B, DECODER)
    assert code == 0, err
    section = out.split("--- tensor parallel:")[1]
    peaks = {}
    for line in section.splitlines()[3:7]:
        m = re.match(
            r"\s*(\d+)( \*)?\s+(\d+)\s+(\S+)\s+\d+\s+([\d.]+) GiB.*\s([\d.]+) GiB\s+(yes|NO)", line
        )
        assert m, line
        tp, dp, sharding, params, peak, fits = (m[1], m[3], m[4], m[5], m[6], m[7])
        peaks[int(tp)] = (int(dp), sharding, float(params), float(peak), fits)
    # a sharded config (zero=1) keeps its sharding at tp > 1 (zero composes with tp)
    assert peaks[1][:2] == (8, "zero=1") and peaks[2][:2] == (4, "zero=1")
    assert peaks[4][:2] == (2, "zero=1") and peaks[8][:2] == (1, "none")
    # the bf16 parameters of the heaviest rank: 16.50 GiB whole, / tp (norms, wpe: whole);
    # zero keeps them whole on every replica
    for tp in (2, 4, 8):
        assert peaks[tp][2] == pytest.approx(16.50 / tp, rel=0.01)
    assert peaks[1][3] > peaks[2][3] > peaks[4][3] > peaks[8][3]
    assert all(p[4] == "yes" for p in peaks.values())
    # with fsdp the config's sharding is fsdp at every tp: the peak holds the 1/dp shard and
    # the gathered tp share (S p + N p)
    code, out, err = _plan(capsys, GPT_70B, DECODER, "strategy.zero=0", "strategy.fsdp=true")
    assert code == 0, err
    section = out.split("--- tensor parallel:")[1]
    for line in section.splitlines()[4:6]:  # tp 2 and 4
        m = re.match(r"\s*(\d+)( \*)?\s+(\d+)\s+(\S+)\s+\d+\s+([\d.]+) GiB", line)
        assert m, line
        tp, dp = int(m[1]), int(m[3])
        assert m[4] == "fsdp"
        assert float(m[5]) == pytest.approx(16.50 / tp * (1 + 1 / dp), rel=0.01)


def test_70b_activations_fall_as_one_over_tp_with_sequence_parallelism(capsys):
    """Without recompute, under sequence parallelism every saved activation of a block holds
    ``T / tp`` positions or ``heads / tp`` heads, the projections' gathered inputs included
    (they keep the rank's part: ColwiseFromSequence), so the heaviest rank's activations fall
    as ``1 / tp`` (the embedding's and head's few whole tensors aside: within 10 %). With
    torch's ColwiseParallel keeping those inputs whole they would not: 45.04 GiB at tp 2
    against 80.08 / 2."""
    code, out, err = _plan(
        capsys,
        GPT_70B,
        DECODER,
        "+model.init_args.sequence_parallel=true",
        "strategy.recompute=null",
    )
    assert code == 0, err
    section = out.split("--- tensor parallel:")[1]
    acts = {}
    for line in section.splitlines()[3:7]:
        cols = re.findall(r"([\d.]+) GiB", line)
        acts[int(line.split()[0])] = float(cols[4])  # params grads master optimizer activations
    for tp in (2, 4, 8):
        assert 0.9 * acts[1] / tp <= acts[tp] <= acts[1] / tp, (tp, acts)
