"""Goodput control's catch-up in vLLM's V1 runner: the first pass's
``propose`` inputs and attention metadata with, before each row's query, the
tokens its draft KV lacks (:class:`~vllm_specextend.control.catch_up.CatchUp`,
staged by control). The runner's state is the adapter's to rewrite; this
module imports no vLLM (it uses the metadata's own ``replace``), so the
host-sync benchmark (``benchmarks/catch_up_syncs.py``) runs it without vLLM.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_specextend.control.catch_up import CatchUp, gap_slot_mapping


def with_catch_up(kwargs: dict, catch_up: CatchUp, block_size: int) -> dict:
    """``propose``'s ``kwargs`` for the first pass with the gaps inserted: the
    tokens and positions, the attention metadata, the rows' moved last
    tokens and, for a head, the gap tokens' kept hidden states."""
    num_tokens, order = catch_up.num_tokens, catch_up.order
    kwargs = dict(kwargs)
    for key, gap_values in (("target_token_ids", catch_up.gap_ids),
                            ("target_positions", catch_up.gap_positions)):
        tokens = kwargs[key][:num_tokens]
        kwargs[key] = torch.cat((tokens, gap_values.to(tokens.dtype)))[order]
    kwargs["common_attn_metadata"] = _metadata(kwargs["common_attn_metadata"], catch_up,
                                               block_size)
    if kwargs.get("token_indices_to_sample") is not None:
        indices = kwargs["token_indices_to_sample"].clone()
        indices[:catch_up.num_rows] += catch_up.row_shift.to(indices.dtype)
        kwargs["token_indices_to_sample"] = indices
    if catch_up.gap_hidden is not None:
        hidden = kwargs["target_hidden_states"][:num_tokens]
        kwargs["target_hidden_states"] = torch.cat((hidden, catch_up.gap_hidden))[order]
    return kwargs


def _metadata(cad, catch_up: CatchUp, block_size: int):
    """The V1 attention metadata (``CommonAttentionMetadata``) of the first
    pass with the gaps inserted."""
    new_query_start = catch_up.layout.query_start_loc
    # Rows vLLM pads the batch with keep an empty query.
    padding = cad.query_start_loc_cpu.shape[0] - (catch_up.num_rows + 1)
    query_start = np.concatenate((new_query_start, np.full(padding, new_query_start[-1])))
    slot_mapping = cad.slot_mapping[:catch_up.num_tokens]
    gap_slots = gap_slot_mapping(cad.block_table_tensor, catch_up.gap_rows,
                                 catch_up.gap_positions, block_size)
    return cad.replace(
        query_start_loc=catch_up.stage(query_start).to(cad.query_start_loc.dtype),
        query_start_loc_cpu=torch.from_numpy(query_start.astype(np.int32)),
        num_actual_tokens=int(new_query_start[-1]),
        max_query_len=int(np.diff(new_query_start).max()),
        slot_mapping=torch.cat((slot_mapping, gap_slots.to(slot_mapping.dtype)))[catch_up.order],
        _num_computed_tokens_cache=None,
    )
