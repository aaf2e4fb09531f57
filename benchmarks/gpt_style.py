"""A GPT-2 style language model written the way training scripts usually write one.

What makes it "the usual way" (and what memcompile must handle in it, issue 29):
- `forward(idx, targets=None) -> (logits, loss)`: the logits are returned as well as the loss,
  and a training loop (`logits, loss = model(x, y); loss.backward()`) holds them through the
  backward;
- the output projection shares its weight with the token embedding (tied embeddings);
- the loss is `F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-1)`;
- attention is `F.scaled_dot_product_attention(..., is_causal=True)`, dropout is optional.

The defaults are GPT-2 small (124M parameters, vocabulary padded to 50304); tests and benchmarks
build smaller ones: `GPT(GPTConfig(n_layer=2, n_embd=128, vocab_size=8192))`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 1024  # longest sequence: the size of the position embedding
    vocab_size: int = 50304  # GPT-2's 50257 tokens padded up to a multiple of 64 (faster matmuls)
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block (n_embd must divide by it)
    n_embd: int = 768  # width of the residual stream
    dropout: float = 0.0  # on embeddings, attention weights and residual branches; 0 for determinism
    bias: bool = True  # biases in the linear layers and LayerNorms, as GPT-2 has them
    ignore_index: int = -1  # targets with this value do not count towards the loss (padding)


class SelfAttention(nn.Module):
    """Multi-head causal self-attention; one projection makes queries, keys and values."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} must be a multiple of n_head={config.n_head}")
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.out = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.out_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        heads = [t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2)
                 for t in self.qkv(x).split(width, dim=2)]
        y = F.scaled_dot_product_attention(*heads, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.out_dropout(self.out(y.transpose(1, 2).contiguous().view(batch, seq, width)))


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.down = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm residual block: attention, then the feed-forward layer."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm_attn = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = SelfAttention(config)
        self.norm_ff = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.ff = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x))
        return x + self.ff(self.norm_ff(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # tied: one parameter, two uses
        self.apply(self._init_weights)
        # GPT-2's scaling of the residual projections: the residual stream's variance stays
        # about constant with depth (each block adds two branches)
        for name, p in self.named_parameters():
            if name.endswith(("attn.out.weight", "ff.down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence of {seq} tokens is longer than block_size={self.config.block_size}")
        positions = torch.arange(seq, device=idx.device)
        x = self.embedding_dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.final_norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=self.config.ignore_index)
        return logits, loss
