"""Decode batches for ``benchmarks.gpu_kernels``: rows of given lengths under a
server's ``max_model_len``, their keys scattered over the key buffer, and
float32 dense references of what retrieval scores on them
(``tests/dense_reference.py``).

A batch is written ``PART+PART...[@MAX_MODEL_LEN]``, each part
``COUNTxLENGTH`` (rows of one length) or ``COUNTxLOW-HIGH`` (lengths drawn
log-uniformly, seed 0): ``8x32768`` is the grid's uniform batch (under
``max_model_len`` = its length + 64), ``1x131072+63x1024-32768@131072`` a
server's mixed batch under 128K, ``256x4096@131072`` short rows under 128K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tests.dense_reference import attention_scores, chunk_scores, context_keys
from vllm_specextend.common.planning_batch import PlanningBatch

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK_SIZE, K, CHUNK = 16, 4, 32
QUERY_ROWS = K + 1  # a request's verification step: K drafts and one token
UNIFORM_HEADROOM = 64
"""A uniform batch's max_model_len beyond its length, unless given."""


@dataclass(frozen=True)
class BatchSpec:
    text: str
    lengths: tuple[int, ...]
    max_model_len: int

    @property
    def uniform(self) -> bool:
        return len(set(self.lengths)) == 1

    @property
    def label(self) -> str:
        return self.text

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def parse_batch(text: str) -> BatchSpec:
    """A batch from its text (see the module docstring)."""
    body, _, max_model_len = text.partition("@")
    rng = np.random.default_rng(0)
    lengths: list[int] = []
    for part in body.split("+"):
        count, _, length = part.partition("x")
        low, _, high = length.partition("-")
        if high:
            drawn = np.exp(rng.uniform(math.log(int(low)), math.log(int(high)), int(count)))
            lengths += [int(v) for v in np.clip(np.round(drawn), int(low), int(high))]
        else:
            lengths += [int(low)] * int(count)
    limit = int(max_model_len) if max_model_len else max(lengths) + UNIFORM_HEADROOM
    if max(lengths) > limit:
        raise ValueError(f"{text}: a row of {max(lengths)} tokens past max_model_len {limit}")
    return BatchSpec(text, tuple(lengths), limit)


def parse_grid(text: str) -> list[BatchSpec]:
    return [parse_batch(item) for item in text.split(",")]


def make_inputs(spec: BatchSpec, device: torch.device, seed: int = 0) -> dict:
    """One decode step, made on the device: each row's keys in blocks
    scattered over the key buffer (table entries past a row's blocks: 0)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    lengths = np.array(spec.lengths, dtype=np.int64)
    batch = len(lengths)
    row_blocks = -(-lengths // BLOCK_SIZE)
    num_blocks = int(row_blocks.sum())
    num_slots = num_blocks * BLOCK_SIZE
    keys = torch.empty(num_slots, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    for start in range(0, num_slots, 1 << 18):  # in pieces: float32 noise of GiBs is wasteful
        end = min(num_slots, start + (1 << 18))
        keys[start:end] = torch.randn(end - start, KV_HEADS, HEAD_DIM, generator=generator,
                                      device=device)
    queries = torch.randn(batch * QUERY_ROWS, HEADS, HEAD_DIM, generator=generator,
                          device=device).bfloat16()
    blocks = torch.randperm(num_blocks, generator=generator, device=device).int()
    table = torch.zeros(batch, int(row_blocks.max()), dtype=torch.int32, device=device)
    first = 0
    for row, count in enumerate(row_blocks.tolist()):
        table[row, :count] = blocks[first : first + count]
        first += count
    query_lens = np.full(batch, QUERY_ROWS)
    return {
        "keys": keys, "queries": queries, "table": table, "lengths": lengths,
        "query_lens": query_lens,
        "query_start": np.concatenate([[0], np.cumsum(query_lens)]),
    }


def key_bytes(spec: BatchSpec) -> int:
    """The scoring layer's keys of the batch (bf16)."""
    return spec.tokens * KV_HEADS * HEAD_DIM * 2


def planning_batch(device, inputs, step: int) -> PlanningBatch:
    """The step's PlanningBatch: each row verifies K drafts; at odd steps
    its last token is one earlier (a draft rejected)."""
    query_start, lengths = inputs["query_start"], inputs["lengths"]
    batch = len(lengths)
    positions = np.concatenate([np.arange(n - QUERY_ROWS, n) for n in lengths.tolist()])
    return PlanningBatch(
        req_ids=[f"req-{i}" for i in range(batch)],
        query_start_loc=torch.from_numpy(query_start).int().to(device),
        seq_lens=torch.from_numpy(lengths).int().to(device),
        block_table=inputs["table"],
        last_token_indices=torch.from_numpy(query_start[1:] - 1 - step % 2).int().to(device),
        positions=torch.from_numpy(positions).to(device),
        query_lens_cpu=inputs["query_lens"],
        context_lens_cpu=lengths - QUERY_ROWS,
        prompt_lens_cpu=np.minimum(lengths - QUERY_ROWS, 1000),  # every row decodes
    )


def uniform_query_rows(inputs, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's K + 1 query rows (token indices) and their positions."""
    lengths = torch.from_numpy(inputs["lengths"]).to(device)
    query_index = (torch.from_numpy(inputs["query_start"][1:]).to(device).view(-1, 1)
                   - torch.arange(QUERY_ROWS, 0, -1, device=device).view(1, -1))
    positions = lengths.view(-1, 1) - torch.arange(QUERY_ROWS, 0, -1, device=device).view(1, -1)
    return query_index, positions


def dense_chunk_sums(inputs, query_index, query_positions, context: int) -> torch.Tensor:
    """Float32 dense chunk sums of the given query rows, one row at a time
    (bounded memory)."""
    rows = []
    for row in range(inputs["table"].shape[0]):
        keys = context_keys(inputs["keys"], inputs["table"][row : row + 1], context, BLOCK_SIZE)
        queries = inputs["queries"][query_index[row : row + 1]]
        scores = attention_scores(queries, keys, query_positions[row : row + 1], HEAD_DIM ** -0.5)
        token = scores.sum(dim=1)
        chunks = -(-context // CHUNK)
        token = torch.nn.functional.pad(token, (0, chunks * CHUNK - context))
        rows.append(token.view(1, chunks, CHUNK).sum(dim=-1))
    return torch.cat(rows)


def plan_score_errors(planner, batch: PlanningBatch, inputs) -> dict:
    """The planner's chunk scores after planning ``batch`` (``last_token``:
    each retrieving row's mean per token of each chunk, from its last
    token) against a float32 dense softmax of the same inputs."""
    last = batch.last_token_indices.long()
    worst_abs = worst_rel = 0.0
    checked = 0
    for req_id, slot in planner.tracked_requests().items():
        row = int(req_id.rsplit("-", 1)[1])
        length = int(inputs["lengths"][row])
        keys = context_keys(inputs["keys"], inputs["table"][row : row + 1], length, BLOCK_SIZE)
        token = last[row : row + 1]
        scores = attention_scores(inputs["queries"][token].view(1, 1, HEADS, HEAD_DIM), keys,
                                  batch.positions[token].view(1, 1), HEAD_DIM ** -0.5)
        want = chunk_scores(scores.sum(dim=1), torch.tensor([length], device=keys.device), CHUNK)
        got = planner._score_sums[slot, : want.shape[1]].float()
        error = (got - want[0]).abs()
        worst_abs = max(worst_abs, float(error.max()))
        worst_rel = max(worst_rel, float((error / want[0].abs().clamp(min=1e-6)).max()))
        checked += 1
    return {"plan_max_abs_error_vs_dense": worst_abs, "plan_max_rel_error_vs_dense": worst_rel,
            "plan_rows_checked": checked}
