"""Moving draft keys to compact positions, as pure tensor functions.

RoPE rotates each pair of a key's rotary dimensions by ``position * inv_freq``,
so a key rotated at position ``o`` becomes the key at position ``c`` by one
more rotation by ``c - o``; values carry no position. The draft's plain KV
copy stores keys rotated back to position 0, so laying a working cache out at
positions ``0..W-1`` is a gather plus one rotation, with no model forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RotaryLayout:
    """How a model's rotary embedding pairs and turns key dimensions."""

    inv_freq: torch.Tensor
    """``[rotary_dim // 2]`` float32 inverse frequencies (scaled RoPE included)."""
    rotary_dim: int
    """Leading dimensions of each head that rotate; the rest pass through."""
    is_neox_style: bool
    """Neox pairs dimension ``i`` with ``i + rotary_dim // 2``; GPT-J pairs
    ``2i`` with ``2i + 1``."""

    @classmethod
    def of_module(cls, rotary_emb: torch.nn.Module) -> RotaryLayout:
        """The layout of one of vLLM's rotary embedding modules."""
        inv_freq = rotary_emb._compute_inv_freq(rotary_emb.base)
        return cls(
            inv_freq=inv_freq.float(),
            rotary_dim=int(rotary_emb.rotary_dim),
            is_neox_style=bool(rotary_emb.is_neox_style),
        )

    def to(self, device: torch.device) -> RotaryLayout:
        return RotaryLayout(self.inv_freq.to(device), self.rotary_dim, self.is_neox_style)


def rotation_angles(positions: torch.Tensor,
                    layout: RotaryLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of ``positions * inv_freq``, each ``[num_tokens, rotary_dim // 2]``.

    Negative positions rotate backwards (used to store keys at position 0).
    """
    angles = positions.float().unsqueeze(-1) * layout.inv_freq.unsqueeze(0)
    return angles.cos(), angles.sin()


def rotate_keys(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: RotaryLayout
) -> torch.Tensor:
    """Rotate ``keys`` ``[num_tokens, num_heads, head_dim]`` by per-token angles.

    Computes in float32 and returns the keys' dtype.
    """
    rot = layout.rotary_dim
    x = keys[..., :rot].float()
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    if layout.is_neox_style:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        rotated = rotated.flatten(-2)
    if rot == keys.shape[-1]:
        return rotated.to(keys.dtype)
    return torch.cat((rotated.to(keys.dtype), keys[..., rot:]), dim=-1)


def rotation_angles_into(positions: torch.Tensor, layout: RotaryLayout, angles: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor) -> None:
    """:func:`rotation_angles` written into ``cos`` and ``sin`` through
    ``angles`` (each ``[num_tokens, rotary_dim // 2]`` float32): no allocation."""
    torch.mul(positions.unsqueeze(-1), layout.inv_freq.unsqueeze(0), out=angles)
    torch.cos(angles, out=cos)
    torch.sin(angles, out=sin)


def rotate_keys_into(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: RotaryLayout,
    out: torch.Tensor, work: torch.Tensor,
) -> None:
    """:func:`rotate_keys` written into ``out`` (the keys' shape and dtype),
    computing in float32 through ``work`` (``[4, num_tokens, num_heads,
    rotary_dim // 2]``): the same operations, no allocation."""
    rot, half = layout.rotary_dim, layout.rotary_dim // 2
    if layout.is_neox_style:
        first, second = slice(0, half), slice(half, rot)
    else:
        first, second = slice(0, rot, 2), slice(1, rot, 2)
    x1, x2, rotated, product = work
    x1.copy_(keys[..., first])
    x2.copy_(keys[..., second])
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    torch.mul(x1, cos, out=rotated)
    torch.mul(x2, sin, out=product)
    out[..., first].copy_(rotated.sub_(product))
    torch.mul(x2, cos, out=rotated)
    torch.mul(x1, sin, out=product)
    out[..., second].copy_(rotated.add_(product))
    if rot < keys.shape[-1]:
        out[..., rot:].copy_(keys[..., rot:])


def token_rows(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Batch row of each of ``num_tokens`` flat tokens (``query_start_loc``: ``[batch + 1]``).

    Tokens past the last row (padding) get the index ``batch``.
    """
    tokens = torch.arange(num_tokens, device=query_start_loc.device)
    return torch.searchsorted(query_start_loc[1:].contiguous(), tokens, right=True)


def working_cache_slots(
    compact_table: torch.Tensor,
    context_lens: torch.Tensor,
    window: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KV slots of compact positions ``0..window-1`` of each row.

    Args:
        compact_table: ``[rows, max_blocks]`` kept blocks first, in context order.
        context_lens: ``[rows]`` compact positions holding context (the rest
            of the window is left alone).
    Returns:
        ``(slots, valid)``, each ``[rows, window]``: the slot that holds compact
        position ``c`` of the row, and whether ``c`` is a context position.
    """
    compact_positions = torch.arange(window, device=compact_table.device)
    block_index = (compact_positions // block_size).clamp(max=compact_table.shape[1] - 1)
    blocks = compact_table[:, block_index].long()
    slots = blocks * block_size + compact_positions % block_size
    valid = compact_positions.view(1, -1) < context_lens.view(-1, 1)
    return slots, valid


def streaming_recent_start_block(
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    lookahead: int,
    sink_blocks: int,
    window: int,
    block_size: int,
) -> torch.Tensor:
    """First recent block kept so that sink + recent blocks + the query and
    ``lookahead`` draft positions fit in ``window`` (prefill of long prompts)."""
    overflow = query_start + query_lens + lookahead + sink_blocks * block_size - window
    start = torch.div(overflow + block_size - 1, block_size, rounding_mode="floor")
    return start.clamp(min=sink_blocks)
