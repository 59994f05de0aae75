"""A slot KV cache that Hugging Face decoder layers write into directly.

HF attention calls ``cache.update(k, v, layer_idx)`` and attends over whatever comes back.
This cache keeps one fixed row ("slot") per running sequence, preallocated to the context
length, so sequences can join and leave a running batch without reshaping anything: a
forward call selects the slots it works on (``view``) and their write positions. The model
code itself is HF's, unchanged, which is why engine logprobs equal a plain forward pass.
"""

from __future__ import annotations

import torch


class SlotCache:
    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.is_compileable = False
        self._slots = torch.zeros(0, dtype=torch.long)
        self._start = torch.zeros(0, dtype=torch.long)
        self._span = 0

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    def view(self, slots: list[int], start: list[int], span: int) -> SlotCache:
        """Select the rows of the next forward: batch row i writes slot ``slots[i]`` from position
        ``start[i]`` on and attends over positions ``< span`` of its slot."""
        self._slots = torch.tensor(slots, dtype=torch.long, device=self.k.device)
        self._start = torch.tensor(start, dtype=torch.long, device=self.k.device)
        self._span = span
        # consecutive slots (the common case: slots are handed out lowest first) read as a view, no copy
        first = slots[0]
        self._range = slice(first, first + len(slots)) if slots == list(range(first, first + len(slots))) else None
        return self

    @property
    def positions(self) -> torch.Tensor:
        """(b,) long: where each selected row writes first (its decode position), from ``view``."""
        return self._start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value (b, kv_heads, q, d) for the selected rows -> (b, kv_heads, span, d) to attend over."""
        q = key_states.shape[2]
        if q == 1:  # decode: one scattered write for the whole batch
            self.k[layer_idx, self._slots, :, self._start] = key_states[:, :, 0]
            self.v[layer_idx, self._slots, :, self._start] = value_states[:, :, 0]
        elif bool((self._start == self._start[0]).all()):  # prefill: every row from the same position
            p = int(self._start[0])
            self.k[layer_idx, self._slots, :, p:p + q] = key_states
            self.v[layer_idx, self._slots, :, p:p + q] = value_states
        else:
            for i in range(key_states.shape[0]):
                s, p = int(self._slots[i]), int(self._start[i])
                self.k[layer_idx, s, :, p:p + q] = key_states[i]
                self.v[layer_idx, s, :, p:p + q] = value_states[i]
        rows = self._range if self._range is not None else self._slots
        return self.k[layer_idx, rows, :, : self._span], self.v[layer_idx, rows, :, : self._span]

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Share a prefilled prompt: n samples of one prompt prefill once."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    # What HF's mask builder asks when it builds the mask itself (a media prompt's prefill, which
    # always starts at position 0 of its slot and attends over its own span)
    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._span, 0


def cache_for(model: torch.nn.Module, slots: int, max_len: int) -> SlotCache:
    """A cache shaped for ``model``'s decoder (text config of multimodal models included)."""
    cfg = model.config
    text = getattr(cfg, "text_config", None) or cfg
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    dtype = next(model.parameters()).dtype
    return SlotCache(text.num_hidden_layers, slots, kv_heads, head_dim, max_len, dtype, next(model.parameters()).device)
