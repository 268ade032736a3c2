"""The target's recent hidden states, for an EAGLE head's catch-up.

A head's first pass takes, per token, the target's hidden state there and the
next token. When goodput control skips the head's forward (nobody drafts),
or runs it without catching a request up (paused, or a probe catching up
part of its gap), the hidden states the target just computed would be lost;
this keeps, every step, the last ``capacity`` positions of each request (a
ring per request slot), so a later forward catches the request up as a draft
model's does, from token ids and these. Allocated at model load, before vLLM
measures free memory: ``max_num_reqs x capacity x width`` in the target's
dtype.

Every token of a step is written at its position, rejected drafts
too: a position is written again when it is verified again, so what a
position holds when it is caught up is its verified token's hidden state.
"""

from __future__ import annotations

import torch

from vllm_specextend.control.catch_up import ring_rows


class PausedHiddenStates:

    def __init__(self, max_num_reqs: int, capacity: int, width: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.capacity = capacity
        self.width = width
        self.states = torch.zeros(max_num_reqs * capacity, width, dtype=dtype, device=device)

    def record(self, token_slots: torch.Tensor, positions: torch.Tensor,
               hidden_states: torch.Tensor) -> None:
        """Keep ``hidden_states[i]`` (a step's flat query tokens) for
        request slot ``token_slots[i]`` (device, staged) at ``positions[i]``."""
        num_tokens = token_slots.shape[0]
        rows = ring_rows(token_slots, positions[:num_tokens].long(), self.capacity)
        self.states.index_copy_(0, rows, hidden_states[:num_tokens].to(self.states.dtype))

    def gather(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The kept hidden states of request slots ``slots`` at ``positions``
        (device, staged; each within its request's last ``capacity``
        recorded positions)."""
        return self.states[ring_rows(slots, positions.long(), self.capacity)]
