"""The forced-draft account: forced drafts paid at what their steps measured."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_specextend.control.forced_account import ForcedDraftAccount
from vllm_specextend.control.kernel_state import ChoiceSettings, PlanSettings

SETTINGS = PlanSettings(0.02, 8, 16, 8, ChoiceSettings(0.1, 0.1, True), 2)
PAUSED_STEP = 0.5
NONE = np.zeros(4, np.int64)
NOT_PROBING = np.zeros(4, bool)


def paused_plans(account: ForcedDraftAccount, plans: int) -> None:
    for _ in range(plans):
        account.planned(PAUSED_STEP, 4, NONE, NONE, NOT_PROBING)
        account.measured(PAUSED_STEP)


def probe(account: ForcedDraftAccount, seconds: float, *, chosen=NONE, charged=None) -> None:
    """Row 0 probes one draft (the other rows pause); its step takes ``seconds``."""
    lengths = np.array([1, 0, 0, 0])
    account.planned(PAUSED_STEP, 3, lengths, np.maximum(chosen, lengths),
                    np.array([chosen[0] == 0, False, False, False]), charged=charged)
    account.measured(seconds)


def test_a_probe_is_charged_what_its_step_measured_beyond_a_paused_one():
    account = ForcedDraftAccount(0.02, 128)
    paused_plans(account, 16)
    # 16 paused plans of 4 rows accrue 2% of 16 steps of 0.5 s.
    assert account.balance == pytest.approx(0.16)
    probe(account, PAUSED_STEP + 0.9)
    assert account.balance == pytest.approx(0.16 + 0.02 * 0.5 * 3 / 4 - 0.9)
    assert account.excess_seconds == pytest.approx(0.9)
    assert account.settings(SETTINGS).probe_budget == 0.0  # no forced drafts while in debt
    paused_plans(account, 100)
    assert account.settings(SETTINGS) is SETTINGS


@pytest.mark.parametrize("kind", ["on estimates", "unpriced warm-up"])
def test_drafts_not_all_forced_are_not_charged(kind):
    # A row drafting on its estimates shares the step (its cost is the
    # cost model's to learn); an unpriced warm-up (no draft weighed) is not charged.
    account = ForcedDraftAccount(0.02, 128)
    if kind == "on estimates":
        probe(account, 2.0, chosen=np.array([2, 0, 0, 0]))
    else:
        probe(account, 2.0, charged=False)
    assert account.excess_seconds == 0.0 and not account.in_debt


def test_a_priced_warm_up_waits_for_its_price_beyond_the_cap_and_is_charged():
    account = ForcedDraftAccount(0.02, most_paused_plans=128)
    price = 2 * 0.02 * PAUSED_STEP * 128  # twice what the cap holds
    waited = 0
    while not account.affords(price):
        paused_plans(account, 1)
        waited += 1
    assert waited == pytest.approx(256, abs=1)  # 2% of a paused step per plan
    # Charged whatever the choice said (an untimed draft looks free to it).
    balance = account.balance
    # Its two plans, each at half its price: the cap holds the credit until
    # it is released (released at the first plan, the cap cut the second's).
    for _ in range(2):
        probe(account, PAUSED_STEP + price / 2, chosen=np.array([4, 4, 4, 4]), charged=True)
    account.release()
    assert account.balance == pytest.approx(balance + 2 * 0.02 * PAUSED_STEP * 3 / 4 - price)
    assert not account.in_debt
    paused_plans(account, 10_000)  # the cap again, once nothing waits
    assert account.balance == pytest.approx(0.02 * PAUSED_STEP * 128)


def test_a_warm_up_priced_at_the_cap_is_afforded_while_the_paused_step_grows():
    # The Qwen pair in float32: 2 x K x 0.32 = 2.56 paused steps, the cap
    # itself; the paused step grows with the context (as the cost model
    # tracks it). A cap raised only to the price chased it for ever (the
    # goodput grid's warm-up never came).
    account = ForcedDraftAccount(0.02, most_paused_plans=128)
    for plan in range(400):
        step = PAUSED_STEP * (1 + 1e-4 * plan)
        if account.affords(2 * 4 * 0.32 * step):
            break
        account.planned(step, 4, NONE, NONE, NOT_PROBING)
        account.measured(step)
    assert plan <= 140


def test_a_waiting_warm_up_keeps_its_credit_through_plans_without_decoding_rows():
    # Calls of 48 tokens, each opened by a prefill plan (no decoding rows):
    # a cap raised for the next plan alone fell back at every prefill, and
    # the warm-up never came (#45's grid).
    account = ForcedDraftAccount(0.02, most_paused_plans=16)
    price = 2 * 4 * 0.58 * PAUSED_STEP
    for plan in range(2000):
        if plan % 48 == 0:
            account.planned(PAUSED_STEP, 0, NONE, NONE, NOT_PROBING)
            account.measured(None)
        elif account.affords(price):
            break
        else:
            account.planned(PAUSED_STEP, 4, NONE, NONE, NOT_PROBING)
            account.measured(PAUSED_STEP)
    assert plan < 250  # 232 paused plans at 2% of a paused step


def test_a_step_that_is_not_a_decode_step_is_not_charged():
    account = ForcedDraftAccount(0.02, 128)
    account.planned(PAUSED_STEP, 3, np.array([1, 0, 0, 0]), np.array([1, 0, 0, 0]),
                    np.array([True, False, False, False]))
    account.measured(None)  # a prefill came next
    account.measured(5.0)  # nothing pending any more
    assert account.excess_seconds == 0.0


def test_a_long_pause_buys_no_burst_of_probes():
    account = ForcedDraftAccount(0.02, most_paused_plans=128)
    paused_plans(account, 10_000)
    assert account.balance == pytest.approx(0.02 * PAUSED_STEP * 128)


def test_forced_steps_are_priced_beside_their_charge_but_the_warm_up_by_its_own_price():
    account = ForcedDraftAccount(0.02, 128)
    paused_plans(account, 1000)
    lengths = np.array([1, 0, 0, 0])
    account.planned(PAUSED_STEP, 3, lengths, lengths, np.array([True, False, False, False]))
    assert account.measuring
    account.measured(PAUSED_STEP + 0.3, priced=PAUSED_STEP + 0.25)  # a probe
    account.planned(PAUSED_STEP, 0, np.full(4, 4), np.full(4, 4), NOT_PROBING, charged=True)
    account.measured(PAUSED_STEP + 2.0, priced=PAUSED_STEP + 9.0)  # the warm-up
    assert not account.measuring
    assert account.priced_seconds == pytest.approx(0.25)
    assert account.excess_seconds == pytest.approx(2.3)


def test_planning_on_the_host_is_paid_from_the_credit():
    account = ForcedDraftAccount(0.02, 128)
    for _ in range(16):  # each plan took 5 ms of a 0.5 s step: half its credit
        account.planned(PAUSED_STEP, 4, NONE, NONE, NOT_PROBING)
        account.spent_on_host(0.005)
        account.measured(PAUSED_STEP)
    assert account.balance == pytest.approx(16 * (0.01 - 0.005))
    assert account.host_seconds == pytest.approx(16 * 0.005)
    account.spent_on_host(0.1)  # planning that costs more than the credit: no forced drafts
    assert account.settings(SETTINGS).probe_budget == 0.0
