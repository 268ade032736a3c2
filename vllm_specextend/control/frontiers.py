"""Each request's draft KV frontier: every position before it holds the
draft's KV of the target's tokens. A step whose draft forward is skipped
(or that catches up only part of a gap) leaves a request behind it; the
next forward that runs prepends the missing tokens to the request's query,
up to the drafter's token budget and, for a head, the positions whose hidden
states are kept (older ones stay holes: the draft reads stale KV there, the
target's output does not change).

Blocks whose draft KV lacks tokens (deferred prompts, pauses, holes) can
reach the prefix cache: a request whose cache hit holds one starts behind
from it, so its draft never reads them as its own. Per-row work compiled by
numba (``frontier_kernels.py``).
"""

from __future__ import annotations

import numpy as np

from vllm_specextend.control.frontier_kernels import (
    advance_frontiers,
    block_ranges,
    catch_up_rows,
    end_step,
    filled_blocks,
    forget,
    new_rows,
)
from vllm_specextend.control.kernel_state import BlockTable, FrontierState

_NO_LIMITS = np.zeros(0, dtype=np.int64)
_NO_TABLE = BlockTable(np.zeros((0, 0), dtype=np.int64), 1)


class DraftKvFrontiers:
    """The draft KV frontier of each request, by request slot, and the KV
    blocks whose draft KV is stale."""

    def __init__(self, max_num_reqs: int, synced_lead: int, max_catch_up: int | None) -> None:
        """Args:
            synced_lead: draft KV positions past the verified tokens that a
                forward leaves right (a draft model's writes the sampled
                token's; a head's needs the token after it: 0).
            max_catch_up: most tokens a request catches up (a head: the
                positions whose hidden states are kept; None: no cap).
        """
        self.synced_lead = synced_lead
        self.max_catch_up = max_catch_up
        self.state = FrontierState.new(max_num_reqs)
        """Each request's frontier, by slot (``FrontierState``). A deferred
        request (its draft prefill skipped) is probed with all of its gap
        (with holes in the prompt a probe would not measure the draft). A
        lagging one, left behind its frontier by the last step, has its
        blocks from the frontier's on turn stale when it leaves behind; a
        prefix hit on them meanwhile is stale too."""
        self._blocks: BlockTable | None = None
        """This step's host block table rows and block size (None: not kept)."""
        self._stale_blocks: set[int] = set()
        """KV blocks whose draft KV lacks tokens the target wrote, left so by
        requests that finished behind their frontier or caught up with holes:
        a request that finds one in the prefix cache catches up from it."""
        self._holes: list[int] = []
        """Blocks this step's catch-up leaves holes in (stale from the next step)."""

    def keep_block_table(self, block_table: np.ndarray | None, block_size: int) -> None:
        """This step's rows' KV block ids on the host (None: not kept), to
        keep prefix cache hits on blocks without the draft's KV right."""
        self._blocks = (None if block_table is None
                        else BlockTable(_table(block_table), int(block_size)))

    def forget(self, left: list[str], slots: np.ndarray) -> None:
        """Requests that left the batch: the blocks of one that left behind
        its frontier turn stale."""
        stale = forget(slots, self.state)
        if stale.size:
            self._stale_blocks.update(stale.tolist())

    def advance(self, slots: np.ndarray, context_lens: np.ndarray,
                prompt_lens: np.ndarray) -> tuple:
        """Each request's frontier after the last step; blocks the last
        forward filled leave the stale set, its holes join it. Returns per
        row its frontier, its gap (the verified tokens its draft KV lacks,
        for a head at most the positions kept) and whether its prompt was
        deferred, and whether a row is prefilling."""
        new = new_rows(slots, self.state)
        new_starts = np.empty(len(new), dtype=np.int64)
        if self._stale_blocks and self._blocks is not None:
            # The last forward wrote the verified tokens (and, for a draft
            # model, the token at ``context_len``): in row order, as a new
            # request's first stale block is looked up among them.
            start = 0
            for i, row in enumerate([*new.tolist(), len(slots)]):
                self._stale_blocks.difference_update(filled_blocks(
                    self._blocks, slots, context_lens, self.state, self.synced_lead, start,
                    row).tolist())
                if row < len(slots):
                    new_starts[i] = self._first_stale(row, int(context_lens[row]))
                start = row
        else:
            for i, row in enumerate(new.tolist()):
                new_starts[i] = self._first_stale(row, int(context_lens[row]))
        frontiers = advance_frontiers(
            slots, context_lens, prompt_lens, new_starts, self.state, self.synced_lead,
            self._cap())
        self._stale_blocks.update(self._holes)
        self._holes = []
        return frontiers

    def defer(self, slots: np.ndarray) -> None:
        """Requests whose prompt chunks skipped the draft this step."""
        self.state.deferred[slots] = True

    def _first_stale(self, row: int, context_len: int) -> int:
        """New: its draft KV is right up to ``context_len``, or up to the
        start of the first block before it whose draft KV is stale (left so,
        or lagging in a live request) that its prefix cache hit holds."""
        if self._blocks is None or not context_len:
            return context_len
        state = self.state
        lagging = np.flatnonzero(state.lagging)
        if not (self._stale_blocks or lagging.size):
            return context_len
        table, size = self._blocks
        stale = np.fromiter(self._stale_blocks, dtype=np.int64)
        live = block_ranges(state.lag_table, lagging, state.lag_start[lagging],
                            state.lag_end[lagging])
        hits = np.flatnonzero(np.isin(table[row, :-(-context_len // size)],
                                      np.concatenate([stale, live])))
        return int(hits[0]) * size if hits.size else context_len

    def end_step(self, slots: np.ndarray, runs: bool, starts: np.ndarray,
                 context_lens: np.ndarray, query_lens: np.ndarray, limits: np.ndarray | None,
                 gaps: np.ndarray) -> None:
        """Only the requests of a forward that runs are synced; with block
        tables kept, per request left behind its frontier (``starts``) by
        this step (its forward did not run, or its catch-up ``limits``
        leave part of its ``gaps``): its blocks from the frontier's on (the
        others' are written by this step). One compiled call
        (:func:`~vllm_specextend.control.frontier_kernels.end_step`)."""
        blocks = _NO_TABLE if self._blocks is None else self._blocks
        width = blocks.table.shape[1]
        if self._blocks is not None and self.state.lag_table.shape[1] != width:
            self.state = self.state._replace(
                lag_table=np.zeros((len(self.state.lagging), width), dtype=np.int64))
        end_step(slots, runs, self.state, blocks, starts, context_lens + query_lens,
                 _NO_LIMITS if limits is None else limits, gaps)

    def catch_up(self, slots: np.ndarray, context_lens: np.ndarray, limits: np.ndarray | None,
                 budget: int) -> tuple[np.ndarray, int]:
        """Per row, the first position this step's first pass processes, and
        the tokens caught up (-1: nothing is), within each row's ``limits``
        and ``budget`` tokens for all rows (see
        :func:`~vllm_specextend.control.frontier_kernels.catch_up_rows`).
        The blocks it leaves holes in turn stale at the next step."""
        starts, tokens, holes = catch_up_rows(
            slots, context_lens, self.state, self._cap(),
            _NO_LIMITS if limits is None else limits, budget,
            _NO_TABLE if self._blocks is None else self._blocks)
        if tokens >= 0:
            self._holes += holes.tolist()
        return starts, tokens

    def of(self, slots: np.ndarray) -> np.ndarray:
        """Per row, its draft KV frontier (every position before it is right)."""
        return self.state.frontier[slots]

    def _cap(self) -> int:
        return -1 if self.max_catch_up is None else self.max_catch_up


def _table(block_table: np.ndarray) -> np.ndarray:
    """A host block table as the kernels take it: contiguous, int32 (vLLM's)
    or int64 (no copy when already so)."""
    dtype = block_table.dtype if block_table.dtype in (np.int32, np.int64) else np.int64
    return np.ascontiguousarray(block_table, dtype=dtype)
