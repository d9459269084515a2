"""Models nobody wrote for pipelining, for the split ("bring your own model") tests.

``GPT`` is written the way nanoGPT users write it (ModuleDict transformer, tied head, loss in
``forward``); the Hugging Face models come from tiny configs (random init, no download).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_pp.runtime.microbatch import split_microbatches

VOCAB, HIDDEN, LAYERS, HEADS = 64, 32, 8, 4


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = VOCAB
    n_layer: int = LAYERS
    n_head: int = HEADS
    n_embd: int = HIDDEN
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


def _hf(name: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "gpt2":
        cfg = tf.GPT2Config(
            n_positions=32,
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
        return lambda: tf.GPT2LMHeadModel(cfg)
    llama = dict(
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **common,
    )
    if name == "llama":
        cfg = tf.LlamaConfig(tie_word_embeddings=False, **llama)
        return lambda: tf.LlamaForCausalLM(cfg)
    if name == "llama-tied":
        cfg = tf.LlamaConfig(tie_word_embeddings=True, **llama)
        return lambda: tf.LlamaForCausalLM(cfg)
    if name == "qwen2":
        cfg = tf.Qwen2Config(tie_word_embeddings=False, **llama)
        return lambda: tf.Qwen2ForCausalLM(cfg)
    if name == "qwen2-tied":
        cfg = tf.Qwen2Config(tie_word_embeddings=True, **llama)
        return lambda: tf.Qwen2ForCausalLM(cfg)
    raise KeyError(name)


MODELS = ("gpt2", "llama", "llama-tied", "qwen2-tied", "nanogpt")


def model_fn(name: str):
    """(constructor, split, step) for a model name."""
    if name == "nanogpt":
        return lambda: GPT(GPTConfig()), "transformer.h", nanogpt_step
    return _hf(name), ("transformer.h" if name == "gpt2" else "model.layers"), hf_step


def hf_step(model, mb):
    """The user's training_step body, as written for a plain Trainer."""
    ids, mask, labels = mb
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def nanogpt_step(model, mb):
    ids, _, labels = mb
    _, loss = model(ids, labels.masked_fill(labels == -100, -1))
    return loss


def lm_batch(seed: int, batch: int, seq: int):
    """(input_ids, attention_mask, labels), right-padded to ``seq`` with varying lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    lengths = torch.randint(max(2, seq // 2), seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def reference_step(model, step, batch, m: int) -> torch.Tensor:
    """Unpipelined forward+backward over the same microbatches (mean reduction, as the engine:
    each microbatch loss weighted by its share of the batch). Returns the detached loss."""
    total = torch.zeros(())
    size = batch[0].shape[0]
    for mb in split_microbatches(batch, m):
        loss = step(model, mb) * (mb[0].shape[0] / size)
        loss.backward()
        total += loss.detach()
    return total
