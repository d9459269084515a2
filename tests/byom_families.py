"""Decoder families of the installed transformers, each from a tiny config (random init, no
download), for the breadth tests of ``PipelineStrategy(split=...)`` (issue 34).

``FAMILIES[name] = (constructor, split)``: the constructor builds the unmodified
``*ForCausalLM``; ``split`` is the ModuleList of its blocks relative to that model. Chosen to
cover what differs between families: rotary / ALiBi / learned positions, blocks returning one
tensor or ``(hidden, attention weights)``, an output projection registered before the blocks,
mixture-of-experts blocks (top-2 routing), sliding windows, parallel attention.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

VOCAB, HIDDEN, LAYERS, HEADS = 64, 32, 4, 4
_COMMON = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_LLAMA_LIKE = dict(
    hidden_size=HIDDEN,
    intermediate_size=2 * HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=2,
    max_position_embeddings=64,
    **_COMMON,
)
_MOE = dict(num_experts_per_tok=2, **_LLAMA_LIKE)

#: what each family exercises (the docs table's "notes")
NOTES = {
    "mistral": "rotary, sliding window",
    "gemma2": "rotary, logit soft-capping, sandwich norms",
    "phi3": "rotary, fused qkv",
    "qwen3": "rotary, q/k norm",
    "gpt_neox": "rotary (partial), parallel attention",
    "falcon": "ALiBi (alibi=True), parallel attention",
    "bloom": "ALiBi; blocks return (hidden, attention weights)",
    "mpt": "ALiBi; blocks return (hidden, attention weights)",
    "gpt_neo": "learned positions; blocks return (hidden, attention weights)",
    "opt": "learned positions; project_out registered before the blocks, called after",
    "mixtral": "mixture of experts, top-2 of 4",
    "qwen2_moe": "mixture of experts, top-2 of 4, shared expert",
    "olmoe": "mixture of experts, top-2 of 4",
}


def _family(name: str) -> Callable[[], nn.Module]:
    import transformers as tf

    if name == "mistral":
        cfg = tf.MistralConfig(sliding_window=8, **_LLAMA_LIKE)
        return lambda: tf.MistralForCausalLM(cfg)
    if name == "gemma2":
        cfg = tf.Gemma2Config(head_dim=8, **_LLAMA_LIKE)
        return lambda: tf.Gemma2ForCausalLM(cfg)
    if name == "phi3":
        cfg = tf.Phi3Config(**_LLAMA_LIKE)
        return lambda: tf.Phi3ForCausalLM(cfg)
    if name == "qwen3":
        cfg = tf.Qwen3Config(head_dim=8, **_LLAMA_LIKE)
        return lambda: tf.Qwen3ForCausalLM(cfg)
    if name == "gpt_neox":
        cfg = tf.GPTNeoXConfig(
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=64,
            **_COMMON,
        )
        return lambda: tf.GPTNeoXForCausalLM(cfg)
    if name == "falcon":
        cfg = tf.FalconConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            alibi=True,
            **_COMMON,
        )
        return lambda: tf.FalconForCausalLM(cfg)
    if name == "bloom":
        cfg = tf.BloomConfig(hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, **_COMMON)
        return lambda: tf.BloomForCausalLM(cfg)
    if name == "mpt":
        cfg = tf.MptConfig(
            d_model=HIDDEN, n_layers=LAYERS, n_heads=HEADS, max_seq_len=64, **_COMMON
        )
        return lambda: tf.MptForCausalLM(cfg)
    if name == "gpt_neo":
        cfg = tf.GPTNeoConfig(
            hidden_size=HIDDEN,
            num_layers=LAYERS,
            num_heads=HEADS,
            attention_types=[[["global", "local"], LAYERS // 2]],
            max_position_embeddings=64,
            window_size=8,
            **_COMMON,
        )
        return lambda: tf.GPTNeoForCausalLM(cfg)
    if name == "opt":
        cfg = tf.OPTConfig(
            hidden_size=HIDDEN,
            ffn_dim=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=64,
            word_embed_proj_dim=16,  # project_in / project_out exist
            dropout=0.0,  # OPT's default 0.1: dropout masks differ from a plain run's
            **_COMMON,
        )
        return lambda: tf.OPTForCausalLM(cfg)
    if name == "mixtral":
        cfg = tf.MixtralConfig(num_local_experts=4, **_MOE)
        return lambda: tf.MixtralForCausalLM(cfg)
    if name == "mixtral-aux":  # the router's auxiliary loss on: refused (cannot be split)
        cfg = tf.MixtralConfig(num_local_experts=4, output_router_logits=True, **_MOE)
        return lambda: tf.MixtralForCausalLM(cfg)
    if name == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            num_experts=4,
            moe_intermediate_size=HIDDEN,
            shared_expert_intermediate_size=HIDDEN,
            **_MOE,
        )
        return lambda: tf.Qwen2MoeForCausalLM(cfg)
    if name == "olmoe":
        cfg = tf.OlmoeConfig(num_experts=4, **_MOE)
        return lambda: tf.OlmoeForCausalLM(cfg)
    raise KeyError(name)


_SPLIT = {
    "gpt_neox": "gpt_neox.layers",
    "falcon": "transformer.h",
    "bloom": "transformer.h",
    "mpt": "transformer.blocks",
    "gpt_neo": "transformer.h",
    "opt": "model.decoder.layers",
}

FAMILIES = tuple(NOTES)


def family_fn(name: str) -> tuple[Callable[[], nn.Module], str]:
    """``(constructor, split relative to the model)`` of a family."""
    return _family(name), _SPLIT.get(name.split("-")[0], "model.layers")
