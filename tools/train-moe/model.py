"""A qwen3moe decoder in PyTorch, computed as llama.cpp computes a qwen3moe GGUF
(src/models/qwen3moe.cpp, llm_build_qwen3moe), so the trained weights mean the same
there: RMSNorm (eps 1e-6, weight a plain multiplier); attention with RMS-normed q and
k per head (attn_q_norm, attn_k_norm) before NeoX RoPE (rotate the halves, base
freq_base), grouped KV heads, scale 1/sqrt(head_dim), causal; the MoE FFN
(build_moe_ffn: softmax over all experts' logits, top-k, the k weights normalized to
sum 1, each expert down(silu(gate x) * up x)); residuals around both; the output
norm; logits by the token embedding (tied: no output.weight).
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


class Config:
    def __init__(self, **kw):
        self.vocab, self.n_embd, self.n_layer = kw["vocab"], kw["n_embd"], kw["n_layer"]
        self.n_head, self.n_head_kv, self.head_dim = kw["n_head"], kw["n_head_kv"], kw["head_dim"]
        self.n_expert, self.top_k, self.n_ff = kw["n_expert"], kw["top_k"], kw["n_ff"]
        self.ctx, self.rope_base, self.eps = kw["ctx"], kw.get("rope_base", 1e6), 1e-6


class RmsNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, cos, sin):
    """NeoX rotation of x [..., T, head_dim]: element i pairs with i + head_dim / 2."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.q = nn.Linear(c.n_embd, c.n_head * c.head_dim, bias=False)
        self.k = nn.Linear(c.n_embd, c.n_head_kv * c.head_dim, bias=False)
        self.v = nn.Linear(c.n_embd, c.n_head_kv * c.head_dim, bias=False)
        self.o = nn.Linear(c.n_head * c.head_dim, c.n_embd, bias=False)
        self.q_norm, self.k_norm = RmsNorm(c.head_dim, c.eps), RmsNorm(c.head_dim, c.eps)

    def forward(self, x, cos, sin):
        c, (B, T, _) = self.c, x.shape
        q = self.q_norm(self.q(x).view(B, T, c.n_head, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(B, T, c.n_head_kv, c.head_dim)).transpose(1, 2)
        v = self.v(x).view(B, T, c.n_head_kv, c.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        group = c.n_head // c.n_head_kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(c.head_dim)
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        y = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, c.n_head * c.head_dim))


class Moe(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.router = nn.Linear(c.n_embd, c.n_expert, bias=False)
        scale = 1 / math.sqrt(c.n_embd)
        self.gate = nn.Parameter(torch.randn(c.n_expert, c.n_ff, c.n_embd) * scale)
        self.up = nn.Parameter(torch.randn(c.n_expert, c.n_ff, c.n_embd) * scale)
        self.down = nn.Parameter(torch.randn(c.n_expert, c.n_embd, c.n_ff) / math.sqrt(c.n_ff))

    def forward(self, x):
        """(output, the load-balancing loss (Switch Transformer's: n_expert x the sum over
        experts of the fraction of routings it got times its mean probability))."""
        c, shape = self.c, x.shape
        x = x.reshape(-1, c.n_embd)
        probs = self.router(x).softmax(-1)
        weight, expert = probs.topk(c.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        flat = expert.flatten()
        order = flat.argsort()
        token = order // c.top_k
        counts = torch.bincount(flat, minlength=c.n_expert).tolist()
        # split and unbind: views whose gradients are joined once (a slice or an index
        # per expert would add a whole zero-filled gradient per expert).
        rows = x[token].split(counts)
        gates, ups, downs = self.gate.unbind(0), self.up.unbind(0), self.down.unbind(0)
        outs = [(F.silu(h @ gates[e].T) * (h @ ups[e].T)) @ downs[e].T
                for e, h in enumerate(rows) if len(h)]
        y = torch.cat(outs) * weight.flatten()[order].unsqueeze(1)
        out = torch.zeros_like(x).index_add_(0, token, y)
        share = torch.tensor(counts, dtype=x.dtype) / flat.numel()
        balance = c.n_expert * (share * probs.mean(0)).sum()
        return out.view(shape), balance


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attn_norm, self.attn = RmsNorm(c.n_embd, c.eps), Attention(c)
        self.ffn_norm, self.moe = RmsNorm(c.n_embd, c.eps), Moe(c)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        y, balance = self.moe(self.ffn_norm(x))
        return x + y, balance


class Qwen3Moe(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.norm = RmsNorm(c.n_embd, c.eps)
        nn.init.normal_(self.embed.weight, std=0.02)
        for b in self.blocks:
            for lin in (b.attn.q, b.attn.k, b.attn.v, b.attn.o, b.moe.router):
                nn.init.normal_(lin.weight, std=0.02)
            nn.init.normal_(b.attn.o.weight, std=0.02 / math.sqrt(2 * c.n_layer))
        freqs = c.rope_base ** (-torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        angles = torch.arange(c.ctx).float()[:, None] * freqs[None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, ids):
        """(logits [B, T, vocab], the mean load-balancing loss)."""
        T = ids.shape[1]
        x = self.embed(ids)
        cos, sin = self.cos[:T], self.sin[:T]
        balance = 0
        for b in self.blocks:
            x, bl = b(x, cos, sin)
            balance = balance + bl
        return self.norm(x) @ self.embed.weight.T, balance / len(self.blocks)
