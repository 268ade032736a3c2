"""What forced drafts (probes, explorations, the warm-up) have cost, measured:
the engine-wide account that keeps them within ``probe_budget`` on any machine.

A row's budget (``plan_kernels.forced_rows``) admits a probe by its price,
which the step-cost model predicts. A probe's step can cost far more than
that: its draft forward runs at a token count the engine has not run lately
(vLLM's CPU GEMMs create a oneDNN primitive per new row count: 2-54 ms more
for a forward of the real models on an AMX Xeon, ``benchmarks/onednn_shapes.py``;
more where the JIT is slower), and a step far above its prediction is
dropped by the cost model as a stall, so the price never learns it. The
account pays each step whose drafts were all forced at what the clock
measured beyond the predicted step without drafts; while it is in debt, no
row drafts by force. Beside the charges it sums what the cost model priced
those steps at as they ran (``priced_seconds``): the two agree where the
model knows what a forced step costs.

The engine's warm-up draft is paid from it too once it is priced
(``draft_warm_up.py``), and so is the controller's own time on the host every
step (:meth:`spent_on_host`): under the synchronous scheduler goodput control
runs under, it lengthens every step beyond the target alone's.
"""

from __future__ import annotations

import numpy as np

from vllm_specextend.control.kernel_state import PlanSettings


class ForcedDraftAccount:
    """Seconds forced drafts may still cost: credited ``probe_budget`` of
    each paused decode row's predicted step, debited what steps with only
    forced drafts measured beyond their predicted step without drafts."""

    def __init__(self, probe_budget: float, most_paused_plans: int) -> None:
        """``most_paused_plans``: the credit is held to that many plans'
        (the controller's: one ``probe_interval``), so a long pause buys no
        burst: what forced drafts cost beyond their price within any window
        of plans is at most about that window's share and one step's excess.
        (Held to ``max_probe_backoff`` x ``probe_interval`` plans, 128, a
        48-token call spent the credit of the calls before it: 2.56 paused
        steps, 5% of the call, #45.) A row's own budget still grows with its
        pause: the account only stops forced drafts while in debt."""
        self.probe_budget = probe_budget
        self.most_paused_plans = most_paused_plans
        self.balance = 0.0
        self.excess_seconds = 0.0
        """What steps with only forced drafts took beyond their predicted
        step without drafts, summed (each at least 0): the metric."""
        self.priced_seconds = 0.0
        """What the cost model priced those steps at beyond the step without
        drafts, as they ran (their tokens, draft steps and catch-up), summed
        (not the warm-up's, priced by ``DraftWarmUp.price``): the metric
        beside ``excess_seconds``."""
        self.host_seconds = 0.0
        """The controller's own planning time, summed (:meth:`spent_on_host`): the metric."""
        self._pending: float | None = None
        self._pending_priced = False
        self._reserve = 0.0
        """What a forced draft waits to afford (:meth:`affords`), until it
        has run (:meth:`release`): the credit's cap is raised by that
        (through plans without decoding rows too: a prefill between 48-token
        calls cut the credit back to the cap, and the warm-up never came;
        released at its first plan, the cap cut what its second plan had
        been credited for, #45)."""

    @property
    def in_debt(self) -> bool:
        return self.balance < 0.0

    @property
    def measuring(self) -> bool:
        """Whether the next step is charged (the last plan's drafts were all forced)."""
        return self._pending is not None

    def settings(self, settings: PlanSettings) -> PlanSettings:
        """A plan's ``settings``: no probe budget while the account is in debt."""
        return settings._replace(probe_budget=0.0) if self.in_debt else settings

    def affords(self, price: float) -> bool:
        """Whether a forced draft waiting for the credit (the warm-up's) may
        run at ``price``; the credit's cap is raised by it until it is
        released (to it alone, the credit would chase a price that grows with
        the paused step)."""
        self._reserve = price
        return self.balance >= price

    def release(self) -> None:
        """The waiting forced draft's plans have all been planned: the credit's
        cap is the plans' again."""
        self._reserve = 0.0

    def planned(self, paused_step: float, paused_rows: int, draft_lengths: np.ndarray,
                chosen: np.ndarray, probing: np.ndarray, charged: bool | None = None) -> None:
        """A plan decided (``paused_step``: its step predicted without
        drafts; ``chosen``: the drafts on estimates and probes before any
        exploration): its paused decode rows are credited, and a plan whose
        drafts are all forced (probes, or an exploration's rows not drafting
        on estimates) is measured at the next step (:meth:`measured`);
        ``charged``: whether it is, where the plan says (the warm-up's)."""
        rows = draft_lengths.shape[0]
        if rows:
            credit = self.probe_budget * paused_step / rows
            self.balance = min(self.balance + credit * paused_rows,
                               credit * rows * self.most_paused_plans + self._reserve)
        drafts = draft_lengths > 0
        forced_only = drafts.any() and (not (drafts & (chosen > 0) & ~probing).any()
                                        if charged is None else charged)
        self._pending = paused_step if forced_only else None
        self._pending_priced = charged is None  # the warm-up has its own price

    def measured(self, seconds: float | None, priced: float | None = None) -> None:
        """The step after the last plan took ``seconds`` (None: not a decode
        step, not measured); ``priced``: the cost model's prediction of that
        step as it ran, before it learnt from it. All of it is charged, a
        host's hiccup too: an account charged less than a probe cost would let
        probes cost more than their budget, one charged more only makes them
        wait."""
        predicted, self._pending = self._pending, None
        if predicted is None or seconds is None:
            return
        charged = seconds - predicted
        self.balance -= charged
        self.excess_seconds += max(charged, 0.0)
        if priced is not None and self._pending_priced:
            self.priced_seconds += max(priced - predicted, 0.0)

    def spent_on_host(self, seconds: float) -> None:
        """A plan took ``seconds`` on the host: paid from the credit like a
        forced draft's excess, so that what the controller adds to a paused
        step and what forced drafts cost stay within ``probe_budget``
        together (where planning takes more, nothing drafts by force)."""
        self.balance -= seconds
        self.host_seconds += seconds
