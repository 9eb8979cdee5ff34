"""Core attention of Megatron's local layer spec through torch's fused
``scaled_dot_product_attention`` (SDPA).

Megatron-Core's local ``DotProductAttention`` computes attention unfused: it materialises the
[b, heads, s, s] score tensor, masks, softmaxes and multiplies it out, op by op, forward and
backward. SDPA computes the same function in one fused kernel (flash or memory-efficient on CPUs
and GPUs alike) with the causal mask built in and grouped-query heads broadcast instead of
copied. Outside what SDPA covers here (attention bias, a learnable or off-by-one softmax, sliding
windows, query-key layer scaling, dropout while training, packed sequences) the module falls back
to Megatron's own forward, so it is a drop-in for every config the local spec accepts.
Parity with the unfused path and with Hugging Face: ``tests/integration/test_megatron_worker.py``.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPADotProductAttention(DotProductAttention):
    """:class:`DotProductAttention` whose plain causal case runs in torch's fused SDPA."""

    def _fused_applies(self, attention_mask, attn_mask_type, attention_bias, packed_seq_params) -> bool:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        return (packed_seq_params is None and attention_bias is None and attention_mask is None
                and mask_type == AttnMaskType.causal and self.softmax_offset is None
                and not self.config.apply_query_key_layer_scaling
                and self.config.window_size is None
                and not (self.training and self.attention_dropout.p > 0))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self._fused_applies(attention_mask, attn_mask_type, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        sq, b = query.size(0), query.size(1)
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale,
            enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition)
        # [b, heads, s, d] -> [s, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
