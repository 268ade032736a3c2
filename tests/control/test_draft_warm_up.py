"""Goodput control's warm-up (``control/draft_warm_up.py``): priced at the
draft's parameter share, it waits for the forced drafts' credit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_specextend.control.draft_lengths import DraftPlan
from vllm_specextend.control.draft_warm_up import WARM_UP, DraftWarmUp
from vllm_specextend.control.forced_account import ForcedDraftAccount
from vllm_specextend.control.goodput import GoodputController
from vllm_specextend.control.speculation_control import SpeculationControl, parameter_count

K = 4
PAUSED_STEP = 0.5
DECODING = np.ones(3, bool)
IN_SYNC = np.array([1, 1, 1])  # least catch-up per row


def choice() -> DraftPlan:
    """What the choice would plan before anything is timed: drafts look free."""
    return DraftPlan(np.full(3, K), K, 1.0)


def plans(warm_up: DraftWarmUp, account: ForcedDraftAccount, count: int,
          least: np.ndarray = IN_SYNC) -> list[list[int]]:
    """``count`` plans of three decoding rows; each paused row is credited."""
    lengths = []
    for _ in range(count):
        plan = warm_up.plan(choice(), DECODING, least, PAUSED_STEP, account) if (
            warm_up.pending) else DraftPlan(np.zeros(3, np.int64), 0, 1.0)
        account.planned(PAUSED_STEP, int((plan.draft_lengths == 0).sum()), plan.draft_lengths,
                        np.zeros(3, np.int64), np.zeros(3, bool),
                        warm_up.priced if warm_up.planned_now else None)
        account.measured(PAUSED_STEP * (1 + 0.25 * plan.draft_steps))
        lengths.append(plan.draft_lengths.tolist())
    return lengths


def test_a_priced_warm_up_waits_until_the_credit_covers_its_drafts():
    warm_up, account = DraftWarmUp(K, 8), ForcedDraftAccount(0.02, 128)
    warm_up.draft_forward_share = 0.25
    # Two plans of K draft forwards at a quarter of a paused step: 2 paused
    # steps of credit, 2% of one a plan.
    history = plans(warm_up, account, 104)
    first = history.index([K, K, K])
    assert 99 <= first <= 101
    assert all(lengths == [0, 0, 0] for lengths in history[:first])  # nobody drafts meanwhile
    assert history[first:first + 4] == [[K, K, K], [K, K, K], [0, 0, 0], [0, 0, 0]]
    assert not warm_up.pending
    # Charged what its steps measured beyond a paused step.
    assert account.excess_seconds == pytest.approx(2 * PAUSED_STEP * 0.25 * K)


def test_an_unpriced_warm_up_drafts_at_the_first_decode_plan():
    warm_up, account = DraftWarmUp(K, 8), ForcedDraftAccount(0.02, 128)
    assert plans(warm_up, account, len(WARM_UP)) == [[K] * 3, [K] * 3, [0] * 3, [0] * 3]
    assert account.excess_seconds == 0.0  # not charged


def test_the_warm_up_drafts_only_rows_with_no_more_to_catch_up_than_a_probe():
    warm_up, account = DraftWarmUp(K, 8), ForcedDraftAccount(0.02, 128)
    assert plans(warm_up, account, 2, least=np.array([600, 600, 600])) == [[0] * 3] * 2
    assert warm_up.plans_done == 0
    assert plans(warm_up, account, 1, least=np.array([600, 3, 600])) == [[0, K, 0]]


def test_the_controller_charges_a_priced_warm_up_and_only_then_drafts():
    controller = GoodputController(max_num_reqs=3, num_speculative_tokens=K, free_pause=True)
    controller.warm_up.draft_forward_share = 0.25
    context, now, drafted_at = np.full(3, 100), 0.0, []
    for plan_number in range(140):
        plan = controller.plan(["a", "b", "c"], context, np.ones(3, np.int64),
                               np.full(3, 100), now)
        now += PAUSED_STEP + 0.25 * PAUSED_STEP * plan.draft_steps
        context = context + 1
        if plan.draft_steps:
            drafted_at.append(plan_number)
    assert drafted_at[:2] == [drafted_at[0], drafted_at[0] + 1] and drafted_at[0] >= 95
    # Its two steps' draft forwards, charged beyond a paused step.
    assert controller.forced_account.excess_seconds == pytest.approx(
        2 * 0.25 * K * PAUSED_STEP, rel=0.05)


class TwoLayers(torch.nn.Module):
    def __init__(self, width: int, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(16, width))
        # A head sharing the embedding's storage (tied embeddings), another tensor.
        self.head = torch.nn.Parameter(self.embed.data if tied else torch.zeros(16, width))
        self.layer = torch.nn.Linear(width, width, bias=False)


class PackedLinear(torch.nn.Module):
    """A vLLM linear layer after the CPU build's GEMM dispatch packed its
    weight away: an empty ``weight``, the sizes of ``LinearBase``."""

    def __init__(self, input_size: int, output_size: int, tp_size: int = 1) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size
        self.output_size_per_partition = output_size // tp_size
        self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def test_a_linear_layer_whose_weight_was_packed_away_counts_by_its_sizes():
    model = TwoLayers(4, tied=True)
    model.layer = PackedLinear(4, 8, tp_size=2)
    model.projections = torch.nn.ModuleList([PackedLinear(8, 4), PackedLinear(8, 4)])
    assert parameter_count(model) == 16 * 4 + 4 * 4 + 2 * 8 * 4


@pytest.mark.parametrize("prices", [True, False])
def test_the_draft_is_weighed_by_its_parameters_each_tensor_once(prices):
    draft, target = TwoLayers(4, tied=True), TwoLayers(8, tied=False)
    assert parameter_count(draft) == 16 * 4 + 4 * 4
    assert parameter_count(target) == 2 * 16 * 8 + 8 * 8
    control = SpeculationControl(2, K, free_pause=True, prices_warm_up=prices)
    control.weigh_draft(draft, target)
    share = control.controller.warm_up.draft_forward_share
    assert share == (pytest.approx(80 / 320) if prices else None)
