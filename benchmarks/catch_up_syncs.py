"""Host syncs of goodput control's per-step device work on a GPU: the plan
(kept hidden states of an EAGLE head) and the catch-up after paused steps
(``SpeculationControl.plan``, ``SpeculationControl.catch_up`` and the V1 runner's inputs
rewritten by ``drafters/v1_catch_up.py``), under
``torch.cuda.set_sync_debug_mode("warn")``. Needs torch only (no vLLM): the
V1 attention metadata is a stand-in with the fields the catch-up reads and
``replace``. The steps are ``tests/drafters/test_adapter_host_syncs.py``'s:
a decode step, two paused steps, a step that catches up beside a new prompt
chunk, a decode step (the controller's choices scripted, its bookkeeping
running).

    python -m benchmarks.catch_up_syncs --out DIR    # on CUDA; writes DIR/catch-up-syncs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from benchmarks.sync_sites import SyncSites
from vllm_specextend.common.planning_batch import PlanningBatch
from vllm_specextend.control.goodput import DraftPlan
from vllm_specextend.control.speculation_control import SpeculationControl
from vllm_specextend.drafters.v1_catch_up import with_catch_up

K, BLOCK_SIZE, MAX_REQS, MAX_BLOCKS, HIDDEN = 4, 16, 8, 256, 64
REPO = Path(__file__).resolve().parent.parent
PROMPTS = {"a": 1500, "b": 1500, "c": 1500, "d": 64}
STEPS = [  # (drafts planned, {request: (query tokens, context tokens)})
    (K, {"a": (1, 2000), "b": (1, 2500), "c": (1, 1800)}),
    (0, {"a": (K + 1, 2001), "b": (K + 1, 2501), "c": (K + 1, 1801)}),
    (0, {"a": (1, 2003), "b": (1, 2503), "c": (1, 1803)}),
    (K, {"a": (1, 2004), "b": (1, 2504), "c": (1, 1804), "d": (64, 0)}),
    (K, {"a": (K + 1, 2005), "b": (K + 1, 2505), "c": (K + 1, 1805), "d": (K + 1, 64)}),
]


@dataclasses.dataclass
class AttentionMetadata:
    """The fields of vLLM's ``CommonAttentionMetadata`` the catch-up reads."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    _num_computed_tokens_cache: object = None

    def replace(self, **changes) -> AttentionMetadata:
        return dataclasses.replace(self, **changes)


def step_inputs(rows: dict, device: torch.device) -> tuple[PlanningBatch, dict]:
    """A step's planning batch and ``propose`` arguments, made before the check."""
    query_lens = np.array([q for q, _ in rows.values()])
    context_lens = np.array([c for _, c in rows.values()])
    num_reqs, num_tokens = len(rows), int(query_lens.sum())
    query_start = np.concatenate([[0], np.cumsum(query_lens), [num_tokens]]).astype(np.int32)
    positions = torch.cat([torch.arange(c, c + q) for q, c in rows.values()]).to(device)
    cad = AttentionMetadata(
        query_start_loc=torch.from_numpy(query_start).to(device),
        query_start_loc_cpu=torch.from_numpy(query_start),
        seq_lens=torch.from_numpy(np.append(context_lens + query_lens, 0)).int().to(device),
        num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=int(query_lens.max()),
        block_table_tensor=torch.arange((num_reqs + 1) * MAX_BLOCKS, dtype=torch.int32,
                                        device=device).view(num_reqs + 1, -1),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),
    )
    batch = PlanningBatch(
        req_ids=list(rows), query_start_loc=cad.query_start_loc[: num_reqs + 1],
        seq_lens=cad.seq_lens, block_table=cad.block_table_tensor,
        last_token_indices=cad.query_start_loc[1: num_reqs + 1] - 1, positions=positions,
        query_lens_cpu=query_lens, context_lens_cpu=context_lens,
        prompt_lens_cpu=np.array([PROMPTS[r] for r in rows]),
    )
    kwargs = dict(
        target_token_ids=torch.zeros(num_tokens, dtype=torch.int32, device=device),
        target_positions=positions,
        target_hidden_states=torch.randn(num_tokens, HIDDEN, device=device),
        token_indices_to_sample=cad.query_start_loc[1: num_reqs + 1] - 1,
        common_attn_metadata=cad,
    )
    return batch, kwargs


def run(device: torch.device) -> dict:
    control = SpeculationControl.for_drafter(
        method="eagle3", num_speculative_tokens=K, keeps_hidden_states=True,
        compact_positions=False, steps_in_flight=2, full_graph_query_len=None,
        max_num_reqs=MAX_REQS, max_num_tokens=512, device=device)
    control.allocate_paused_hidden_states(HIDDEN, torch.float32)
    controller = control.controller
    stock_choose, planned = controller.choose, [k for k, _ in STEPS]

    def scripted(req_ids, *args, **kwargs):
        stock_choose(req_ids, *args, **kwargs)
        k = planned.pop(0)
        return DraftPlan(np.full(len(req_ids), k), k, 0.0)

    controller.choose = scripted
    host_table = np.arange(MAX_REQS * MAX_BLOCKS, dtype=np.int32).reshape(MAX_REQS, -1)
    token_ids = np.arange(MAX_REQS * 4096, dtype=np.int32).reshape(MAX_REQS, -1)
    inputs = [step_inputs(rows, device) for _, rows in STEPS]
    sites, caught_up = [], 0
    for batch, kwargs in inputs:
        with SyncSites(sites):
            steps = control.plan(batch, host_table[: batch.num_reqs], BLOCK_SIZE,
                                 kwargs["target_hidden_states"])
            catch_up = None if steps is None else control.catch_up(batch, token_ids)
            if catch_up is not None:
                moved = with_catch_up(kwargs, catch_up, BLOCK_SIZE)
                caught_up += (moved["common_attn_metadata"].num_actual_tokens
                              - kwargs["common_attn_metadata"].num_actual_tokens)
    stats = controller.stats
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "steps": len(STEPS),
            "skipped_draft_forwards": stats.skipped_draft_forwards,
            "catch_up_tokens": stats.catch_up_tokens, "tokens_inserted": caught_up,
            "sync_sites": sites}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=REPO / "build")
    args = parser.parse_args(argv)
    result = run(torch.device(args.device))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "catch-up-syncs.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "sync_sites"}),
          f"sync sites: {len(result['sync_sites'])}",
          *sorted({s["site"] for s in result["sync_sites"]}), sep="\n")


if __name__ == "__main__":
    main()
