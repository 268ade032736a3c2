"""Stand-ins the drafter adapter tests share: the target's last attention
layer as the tap sees it, and a Model Runner V2 input batch (the fields
vLLM's ``InputBatch`` carries that the speculators read)."""

import types

import numpy as np
import torch


def input_batch(query_lens, context_lens, prompt_lens):
    query_lens, context_lens = np.array(query_lens), np.array(context_lens)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens = (context_lens + query_lens).astype(np.int32)
    num_tokens = int(query_start_loc[-1])
    return types.SimpleNamespace(
        num_reqs=len(query_lens), num_tokens=num_tokens, num_tokens_after_padding=num_tokens,
        num_scheduled_tokens=query_lens, decode_graph_eligible=False,
        req_ids=[f"req-{i}" for i in range(len(query_lens))],
        idx_mapping=torch.arange(len(query_lens)),
        input_ids=torch.arange(num_tokens, dtype=torch.int32),
        query_start_loc=torch.from_numpy(query_start_loc),
        query_start_loc_np=query_start_loc,
        seq_lens=torch.from_numpy(seq_lens),
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens),
        positions=torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)]),
        num_computed_tokens_np=context_lens,
        prefill_len_np=np.array(prompt_lens),
        is_prefilling_np=context_lens + query_lens < np.array(prompt_lens),
    )


class FakeImpl:
    """An attention impl: the tap swaps its class and calls these."""

    def __init__(self, scale: float):
        self.scale = scale

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        return query

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        return None


class FakeAttention:
    """The target's (or draft's) attention layer as the tap sees it."""

    num_heads, num_kv_heads, head_size = 4, 2, 16
    kv_sharing_target_layer_name = None

    def __init__(self, scale: float = 0.125, device: str | torch.device = "cpu"):
        self.impl = FakeImpl(scale)
        self.kv_cache = torch.zeros(1, device=device)

    def get_attn_backend(self):
        return types.SimpleNamespace(forward_includes_kv_cache_update=False,
                                     get_name=lambda: "FAKE")
