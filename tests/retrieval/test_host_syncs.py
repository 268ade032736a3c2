"""No host syncs per step, proven without a GPU: the planner, the retrieval
owner and the adapters' per-step paths (the V1 proposer's planning, catch-up,
kept hidden states, positions and metadata; MRV2's staging and positions;
the tap's and the plain draft KV copy's records) run with device tensors on
``meta`` under :class:`~tests.host_sync_check.HostSyncCheck`, which fails on
any op that would wait for the device or copy pageable host memory on CUDA.
Set-up and metrics pulls run under it too, allowed by name (``ALLOWED``)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.host_sync_check import HostSyncCheck, HostSyncError
from tests.retrieval.test_planner import BLOCK_SIZE, ROWS, K, planning_batch, to_device
from vllm_specextend.common.options import SpecExtendConfig
from vllm_specextend.retrieval.planner import PrivateLayouts, RetrievalPlanner
from vllm_specextend.retrieval.target_tap import TargetAttentionTap

META = torch.device("meta")

ALLOWED = {
    # Set-up: buffers and constants made once, before serving.
    "vllm_specextend.common.histograms:DeviceHistogram.__init__",
    "vllm_specextend.retrieval.draft_kv_copy:DraftKVCopy.__init__",
    # Metrics pulls: read the device counters, outside the engine step
    # (goodput control's counters live on the host).
    "vllm_specextend.retrieval.planner:RetrievalPlanner.metrics_snapshot",
}


def meta_planner(options: dict, private_layouts: PrivateLayouts | None = None,
                 num_slots: int = 5 * 256 * BLOCK_SIZE) -> RetrievalPlanner:
    options = dict(options)
    draft_window = options.pop("draft_window", 4096)
    config = SpecExtendConfig(min_context_tokens=1024, sink_tokens=16, recent_tokens=64,
                              chunk_size=32, top_k_chunks=2, retrieval_interval=2, **options)
    planner = RetrievalPlanner(config, max_num_reqs=8, max_model_len=4096,
                               max_num_speculative_tokens=K, draft_window=draft_window,
                               compact_positions=draft_window < 4096, device=META)
    layer = SimpleNamespace(num_heads=4, num_kv_heads=2, head_size=16)
    planner.allocate_scoring_workspace(layer, torch.float32)
    tap = TargetAttentionTap(num_slots=num_slots, max_num_tokens=1024, num_heads=4,
                             num_kv_heads=2, head_dim=16, scale=0.25, dtype=torch.float32,
                             device=META)
    planner.bind_kv_cache(tap, BLOCK_SIZE, private_layouts)
    return planner


PLANNER_OPTIONS = {
    "cmr": {"mode": "cmr"},
    "cmr-accepted-tokens": {"mode": "cmr", "score_aggregation": "accepted_tokens"},
    "cmr-acceptance-refresh": {"mode": "cmr", "retrieval_refresh": "acceptance"},
    "streaming-compact": {"mode": "streaming", "draft_window": 1024},
    "cmr-compact": {"mode": "cmr", "draft_window": 1024},
}


def planner_steps() -> list:
    """Three steps of ``ROWS`` (retrievals due at the first and the third),
    then a step without ``full_k`` (it finishes); made before the check (the
    runner's inputs)."""
    batches = [dict(ROWS, context_lens=[c + step for c in ROWS["context_lens"]])
               for step in range(3)]
    batches.append({key: values[1:] for key, values in ROWS.items()})
    return [to_device(planning_batch(**rows), META) for rows in batches]


def run_planner_steps(planner: RetrievalPlanner, batches: list) -> None:
    for batch in batches:
        view = planner.plan(batch)
        assert view is not None and view.block_table.device == META
    planner.metrics_snapshot()


@pytest.mark.parametrize("options", PLANNER_OPTIONS.values(), ids=PLANNER_OPTIONS.keys())
def test_planning_never_waits_for_the_device(options):
    batches = planner_steps()
    with HostSyncCheck(ALLOWED) as check:
        planner = meta_planner(options)
        run_planner_steps(planner, batches)
    check.assert_none()
    assert sorted(planner.tracked_requests()) == ["reduced_k"]
    assert planner.stats.finished_requests == 1
    assert check.allowed["vllm_specextend.retrieval.planner:RetrievalPlanner.metrics_snapshot"]


def test_planning_with_private_layouts_never_waits_for_the_device():
    layouts = PrivateLayouts(first_block=5 * 256, areas=2, blocks_per_area=1024 // BLOCK_SIZE)
    batches = planner_steps()
    with HostSyncCheck(ALLOWED) as check:
        planner = meta_planner({"mode": "cmr", "draft_window": 1024}, layouts,
                               num_slots=(5 * 256 + 2 * 64) * BLOCK_SIZE)
        run_planner_steps(planner, batches)
    check.assert_none()
    assert planner.private_layouts is not None


def test_the_check_finds_what_it_is_meant_to_find():
    # Each kind of sync once, outside any allowed frame.
    device = torch.zeros(4, device=META)
    index = torch.zeros(2, dtype=torch.int64, device=META)
    pageable = torch.arange(2)
    cases = {
        "a Python scalar written through a device index": lambda: device.__setitem__(index, 0.0),
        "host memory in a device op": lambda: torch.cat((index, pageable)),
        "pageable host memory": lambda: pageable.to(META, non_blocking=True),
        "a blocking copy from host memory": lambda: pageable.to(META),
        "copies device memory to the host": lambda: device.to("cpu"),
        "boolean-mask indexing": lambda: device[device > 0],
        "nonzero": lambda: torch.nonzero(device),
        "repeat_interleave without output_size": lambda: device.repeat_interleave(
            torch.ones(4, dtype=torch.int64, device=META)),
        "copies host data to the device": lambda: torch.tensor([1, 2], device=META),
    }
    for reason, run in cases.items():
        with HostSyncCheck() as check:
            try:
                run()
            except (HostSyncError, RuntimeError, NotImplementedError):
                pass  # the op cannot run on meta
        assert any(reason in v.reason for v in check.violations), (reason, check.violations)
    # Device work with host scalars and pinned staging is fine.
    from vllm_specextend.common.staging import IndexStager

    with HostSyncCheck() as check:
        device.index_fill_(0, index, 0.0)
        torch.where(device > 0, device, 1.0).add_(torch.tensor(2.0))
        IndexStager(4, META).next_step()(np.arange(3))
    check.assert_none()
