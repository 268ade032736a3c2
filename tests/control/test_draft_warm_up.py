"""Goodput control's warm-up (``control/draft_warm_up.py``): priced at the
most it can cost (its draft forwards at the draft's parameter share, the
verification of its drafts, its catch-up), it waits for the forced drafts'
credit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_specextend.control.draft_lengths import DraftPlan
from vllm_specextend.control.draft_warm_up import WARM_UP, DraftWarmUp
from vllm_specextend.control.forced_account import ForcedDraftAccount
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
    # Two plans, each of K draft forwards at a quarter of a paused step (1
    # paused step), K drafts per row verified at a row's third of it (4) and
    # one token caught up per row at a quarter of a row's (1/4): 10.5 paused
    # steps of credit, 2% of one a plan.
    assert warm_up.price(DECODING, IN_SYNC, 3, PAUSED_STEP) == pytest.approx(10.5 * PAUSED_STEP)
    history = plans(warm_up, account, 530)
    first = history.index([K, K, K])
    assert 524 <= first <= 526
    assert all(lengths == [0, 0, 0] for lengths in history[:first])  # nobody drafts meanwhile
    assert history[first:first + 4] == [[K, K, K], [K, K, K], [0, 0, 0], [0, 0, 0]]
    assert not warm_up.pending
    # Charged what its steps measured beyond a paused step.
    assert account.excess_seconds == pytest.approx(2 * PAUSED_STEP * 0.25 * K)


def test_a_plan_without_a_row_to_warm_up_keeps_the_credit_waited_for():
    # Credit for 6 of its 10.5 paused steps, above the cap of 16 plans'; then
    # plans whose rows all lack their draft (a prompt that skipped it). Priced
    # at no row's drafts, the reserve fell and the cap cut the credit.
    warm_up, account = DraftWarmUp(K, 8), ForcedDraftAccount(0.02, 16)
    warm_up.draft_forward_share = 0.25
    plans(warm_up, account, 300)
    assert account.balance == pytest.approx(6 * PAUSED_STEP, rel=0.01)
    plans(warm_up, account, 5, least=np.array([600, 600, 600]))
    assert account.balance == pytest.approx(6.1 * PAUSED_STEP, rel=0.01)
    assert warm_up.plans_done == 0


def test_an_unpriced_warm_up_drafts_at_the_first_decode_plan():
    warm_up, account = DraftWarmUp(K, 8), ForcedDraftAccount(0.02, 128)
    assert plans(warm_up, account, len(WARM_UP)) == [[K] * 3, [K] * 3, [0] * 3, [0] * 3]
    assert account.excess_seconds == 0.0  # not charged


def test_the_warm_up_drafts_only_rows_with_no_more_to_catch_up_than_a_probe():
    warm_up, account = DraftWarmUp(K, 8), ForcedDraftAccount(0.02, 128)
    assert plans(warm_up, account, 2, least=np.array([600, 600, 600])) == [[0] * 3] * 2
    assert warm_up.plans_done == 0
    assert plans(warm_up, account, 1, least=np.array([600, 3, 600])) == [[0, K, 0]]


def warm_up_on_a_compute_bound_engine(price_of_drafts_alone: bool = False) -> tuple:
    """A warm-up where a step costs a third of a paused step per token verified
    (three rows), a quarter of that per token the draft catches up, and a
    quarter of a paused step per draft forward, until its steps were measured
    (a plan's time: its catch-up and draft forwards, then the target's step
    that verifies its drafts); returns (plans that drafted, the forced
    drafts' account, its price)."""
    control = SpeculationControl(3, K, free_pause=True)
    warm_up = control.controller.warm_up
    warm_up.draft_forward_share = 0.25
    price = (lambda *args: 2 * 0.25 * K * args[-1]) if price_of_drafts_alone else warm_up.price
    prices = []
    warm_up.price = lambda *args: prices.append(price(*args)) or prices[-1]
    clock = [0.0]
    control.clock = lambda: clock[0]
    req_ids, row_step = ["a", "b", "c"], PAUSED_STEP / 3
    context, verifying, drafted_at = np.full(3, 100), np.zeros(3, np.int64), []
    for plan_number in range(720):
        if not warm_up.pending and not verifying.any():
            break  # its last step measured: the account holds what it was charged
        query = 1 + verifying
        plan = control.plan_step(req_ids, context.copy(), query.copy(), np.full(3, 100))
        runs = plan.runs_draft_forward
        starts = control.catch_up_starts(req_ids, context.copy(), 8192) if runs else None
        caught_up = 0 if starts is None else int((context - starts).sum())
        verifying = plan.draft_lengths.astype(np.int64) if runs else np.zeros(3, np.int64)
        forwards = 0.25 * PAUSED_STEP * plan.draft_steps if runs else 0.0
        clock[0] += 0.25 * row_step * caught_up + forwards + row_step * float(3 + verifying.sum())
        context = context + query  # every draft accepted
        if plan.draft_steps:
            drafted_at.append(plan_number)
    return drafted_at, control.controller.forced_account, prices[-1]


def test_the_controller_charges_a_priced_warm_up_within_its_price_and_only_then_drafts():
    drafted_at, account, price = warm_up_on_a_compute_bound_engine()
    assert drafted_at[:2] == [drafted_at[0], drafted_at[0] + 1] and drafted_at[0] >= 500
    # Charged what its steps measured beyond paused ones: the draft forwards,
    # the verification of its drafts, its catch-up; within its price.
    assert 2 * 0.25 * K * PAUSED_STEP < account.excess_seconds <= price
    assert not account.in_debt


def test_a_warm_up_priced_at_its_draft_forwards_alone_leaves_the_account_in_debt():
    # The price as it was (#45): the verification and catch-up left out.
    drafted_at, account, price = warm_up_on_a_compute_bound_engine(price_of_drafts_alone=True)
    assert drafted_at[0] < 200
    assert account.excess_seconds > 2 * price
    assert account.in_debt


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
