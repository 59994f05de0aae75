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
        self._cos, self._sin = rope_tables(self.inv_freq, self.rope_scale, 256)
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

    @torch.no_grad()
    def rewrite(self, names: set[str]) -> None:
        """Copy the parameters ``names`` (HF names, changed in place) into the fused weights, in place.

        An adapter reload changes a few projections: re-concatenating every layer (``refresh``)
        would allocate and fill all the fused QKV and gate/up tensors again. o_proj, down_proj, the
        norms, the embedding and the LM head are the model's own tensors here, so they need nothing.
        A name this decoder does not know falls back to ``refresh``."""
        m = self.model.model
        for name in names:
            parts = name.split(".")  # model.layers.<i>.<self_attn|mlp>.<proj>.weight
            if parts[:2] != ["model", "layers"] or len(parts) != 6 or parts[5] != "weight":
                return self.refresh()
            i, proj = int(parts[2]), parts[4]
            if proj in ("o_proj", "down_proj"):
                continue
            a, mlp = m.layers[i].self_attn, m.layers[i].mlp
            rows = {"q_proj": (a.q_proj, a.k_proj, a.v_proj), "k_proj": (a.k_proj, a.v_proj),
                    "v_proj": (a.v_proj,), "gate_proj": (mlp.gate_proj, mlp.up_proj), "up_proj": (mlp.up_proj,)}
            if proj not in rows:
                return self.refresh()
            fused = self.layers[i].wqkv if proj in ("q_proj", "k_proj", "v_proj") else self.layers[i].wgu
            # a projection's rows end where the fused tensor's tail (itself and what follows) begins
            start = fused.shape[0] - sum(p.weight.shape[0] for p in rows[proj])
            fused[start:start + rows[proj][0].weight.shape[0]].copy_(rows[proj][0].weight)
        return None

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # as HF's RMSNorm: normalise in float32, scale in the weight's dtype; the fused op
        # replaces five dispatched ones (8 against 11 us at batch 32, hidden 64)
        if w.dtype == x.dtype == torch.float32:  # one op: scaling inside it is the same product
            return F.rms_norm(x, x.shape[-1:], w, self.eps)
        return w * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(w.dtype)

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope_tables`` covering positions below ``length`` (grown by doubling on demand)."""
        if length > self._cos.shape[0]:
            self._cos, self._sin = rope_tables(self.inv_freq, self.rope_scale, 2 * length)
        # in the model's dtype, as HF's rotary embedding hands them over (computed in float32): a
        # bfloat16 K must stay bfloat16 to go into a bfloat16 cache; a no-op for float32
        return self._cos.to(self.embed.dtype), self._sin.to(self.embed.dtype)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: list[int], cache: SlotCache, slots: list[int],
             span: int) -> torch.Tensor:
        """tokens (b,), positions ``pos`` (b ints) -> logits (b, V); writes each sequence's K/V at
        its position and attends over positions ``< span``."""
        b, nh, nkv, d = tokens.shape[0], self.heads, self.kv_heads, self.head_dim
        cache.view(slots, pos, span)
        positions = cache.positions  # the same ints as a tensor, made once by the view
        cos, sin = self.rope(span)
        cos, sin = cos[positions][:, None, :], sin[positions][:, None, :]  # (b, 1, d)
        mask = (torch.arange(span)[None, :] <= positions[:, None])[:, None, None, :]
        h = self.embed[tokens]
        for i, L in enumerate(self.layers):
            qkv = F.linear(self._rms(h, L.ln1), L.wqkv, L.bqkv)
            qk, v = qkv.split([(nh + nkv) * d, nkv * d], dim=-1)
            qk, v = qk.view(b, nh + nkv, d), v.view(b, nkv, d)
            if L.qn is not None:
                qk = torch.cat([self._rms(qk[:, :nh], L.qn), self._rms(qk[:, nh:], L.kn)], dim=1)
            qk = qk * cos + qk.roll(d // 2, -1) * sin  # rotate q and k in one go; sin carries the sign
            q, k = qk[:, :nh], qk[:, nh:]
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
    cos, sin = (t[:length][None, None] for t in dec.rope(length))  # (1, 1, L, d)
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
        q = q * cos + q.roll(d // 2, -1) * sin
        k = k * cos + k.roll(d // 2, -1) * sin
        cache.update(k, v, i)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=d ** -0.5)
        h = h + F.linear(attn.transpose(1, 2).reshape(b, length, nh * d), L.wo)
        gate, up = F.linear(dec._rms(h, L.ln2), L.wgu).split(dec.ffn, dim=-1)
        h = h + F.linear(F.silu(gate) * up, L.wdown)
    last = h[torch.arange(b), torch.tensor(lengths) - 1]
    return F.linear(dec._rms(last, dec.norm), dec.lm_head)


def rope_tables(inv_freq: torch.Tensor, scale: float, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin (length, d) of RoPE at positions 0..length-1, so that the rotation of x
    (..., d) at position p is ``x * cos[p] + x.roll(d // 2, -1) * sin[p]``: HF's
    ``x * cos + rotate_half(x) * sin`` with rotate_half's negation moved into sin's first half
    (exact: a sign flip does not round)."""
    freqs = torch.arange(length, device=inv_freq.device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    half = inv_freq.shape[0]
    sin = emb.sin() * scale
    return emb.cos() * scale, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)

