"""A lean prefill and decode step for Qwen2 / Qwen3 / Llama decoders, from the HF model's weights.

Decoding one token per sequence is dominated, on small models and CPUs, by per-call
overhead: HF runs seven projections and dozens of module calls per layer. This path runs
the same math with the QKV projections fused into one matmul and gate/up into another,
plain-tensor RMSNorm and RoPE, and attention straight over the slot cache. It reads the
HF module weights (``refresh()`` after a weight swap), so it stays exact: the engine's
tests compare its logprobs with a plain HF forward pass. Models it does not recognise,
sliding-window attention and 3-D rope (media models) keep the HF path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from relax.engines.native.kv_cache import SlotCache

SUPPORTED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    wgu: torch.Tensor
    wdown: torch.Tensor
    qn: torch.Tensor | None
    kn: torch.Tensor | None


class FusedDecoder:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.ffn = cfg.intermediate_size
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.float()
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.refresh()

    @staticmethod
    def maybe(model: torch.nn.Module) -> FusedDecoder | None:
        cfg = model.config
        if type(model).__name__ not in SUPPORTED or getattr(cfg, "use_sliding_window", False):
            return None
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
            return None
        return FusedDecoder(model)

    @torch.no_grad()
    def refresh(self) -> None:
        """(Re)build the fused weights from the model's current parameters."""
        m = self.model.model
        self.embed = m.embed_tokens.weight
        self.norm = m.norm.weight
        self.lm_head = self.model.lm_head.weight
        self.layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
            self.layers.append(_Layer(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                wqkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                bqkv=torch.cat(biases) if all(b is not None for b in biases) else None,
                wo=a.o_proj.weight, wgu=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                wdown=mlp.down_proj.weight,
                qn=a.q_norm.weight if hasattr(a, "q_norm") else None,
                kn=a.k_norm.weight if hasattr(a, "k_norm") else None))

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # as HF's RMSNorm: normalise in float32, scale in the weight's dtype
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(w.dtype)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: SlotCache, slots: list[int],
             span: int) -> torch.Tensor:
        """tokens, positions (b,) -> logits (b, V); writes each sequence's K/V at its position."""
        b, nh, nkv, d = tokens.shape[0], self.heads, self.kv_heads, self.head_dim
        cache.view(slots, positions.tolist(), span)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.rope_scale)[:, None, :]  # (b, 1, d)
        sin = (emb.sin() * self.rope_scale)[:, None, :]
        mask = (torch.arange(span)[None, :] <= positions[:, None])[:, None, None, :]
        h = self.embed[tokens]
        for i, L in enumerate(self.layers):
            qkv = F.linear(self._rms(h, L.ln1), L.wqkv, L.bqkv)
            q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
            q, k, v = q.view(b, nh, d), k.view(b, nkv, d), v.view(b, nkv, d)
            if L.qn is not None:
                q, k = self._rms(q, L.qn), self._rms(k, L.kn)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = cache.update(k[:, :, None], v[:, :, None], i)  # write at each row's position, read span
            attn = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask, enable_gqa=True,
                                                  scale=d ** -0.5)
            h = h + F.linear(attn.reshape(b, nh * d), L.wo)
            gate, up = F.linear(self._rms(h, L.ln2), L.wgu).split(self.ffn, dim=-1)
            h = h + F.linear(F.silu(gate) * up, L.wdown)
        return F.linear(self._rms(h, self.norm), self.lm_head)


@torch.no_grad()
def prefill(dec: FusedDecoder, tokens: torch.Tensor, lengths: list[int], cache: SlotCache,
            slots: list[int]) -> torch.Tensor:
    """Prompts (b, L) right-padded to the longest -> logits (b, V) at each prompt's last token.

    Writes every row's K/V into its slot from position 0; pad positions hold junk that the
    key mask hides and decode overwrites.
    """
    b, length = tokens.shape
    nh, nkv, d = dec.heads, dec.kv_heads, dec.head_dim
    cache.view(slots, [0] * b, length)
    freqs = torch.arange(length).float()[:, None] * dec.inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = (emb.cos() * dec.rope_scale)[None, None], (emb.sin() * dec.rope_scale)[None, None]  # (1,1,L,d)
    valid = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    mask = (torch.ones(length, length, dtype=torch.bool).tril_()[None] & valid[:, None, :])[:, None]
    h = dec.embed[tokens]
    for i, L in enumerate(dec.layers):
        qkv = F.linear(dec._rms(h, L.ln1), L.wqkv, L.bqkv)
        q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
        q, k, v = q.view(b, length, nh, d), k.view(b, length, nkv, d), v.view(b, length, nkv, d)
        if L.qn is not None:
            q, k = dec._rms(q, L.qn), dec._rms(k, L.kn)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        cache.update(k, v, i)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=d ** -0.5)
        h = h + F.linear(attn.transpose(1, 2).reshape(b, length, nh * d), L.wo)
        gate, up = F.linear(dec._rms(h, L.ln2), L.wgu).split(dec.ffn, dim=-1)
        h = h + F.linear(F.silu(gate) * up, L.wdown)
    last = h[torch.arange(b), torch.tensor(lengths) - 1]
    return F.linear(dec._rms(last, dec.norm), dec.lm_head)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
