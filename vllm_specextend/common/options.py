"""User options of SpecExtend, read from ``additional_config["spec_extend"]``.

Mirrors ``vllm/config/speculative.py``: one dataclass, a docstring under each
field, and all validation in one place raising ``ValueError`` that names the
key and the allowed values.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

ADDITIONAL_CONFIG_KEY = "spec_extend"

RetrievalMode = Literal["cmr", "streaming", "off"]
ScoreAggregation = Literal["last_token", "accepted_tokens"]
DraftPositions = Literal["auto", "original", "compact"]
SpeculationControlMode = Literal["off", "goodput"]
GoodputWarmUp = Literal["priced", "immediate"]
RetrievalRefresh = Literal["interval", "acceptance"]

# Default retrieved budget, in tokens. Sweeps on the Qwen2.5-Coder 1.5B/0.5B
# pair at 4K: 512 tokens keep acceptance within 0-5% of the full cache while
# the draft reads <= 23% of the context; 32-token chunks (1.00x) beat 128-token
# ones (0.93-0.95x) at that budget (benchmarks/results/sweep*).
DEFAULT_RETRIEVED_TOKENS = 512


class SpecExtendConfigError(ValueError):
    """An invalid ``spec_extend`` option."""


@dataclass(frozen=True)
class SpecExtendConfig:
    """Options of SpecExtend for speculative decoding (draft model, EAGLE, EAGLE-3, MTP).

    Token counts are rounded up to whole KV blocks, because retrieval works by
    removing whole blocks from the draft's block table.
    """

    mode: RetrievalMode = "cmr"
    """``cmr``: the target's last-layer attention picks the chunks the draft
    attends to. ``streaming``: sink + most recent chunks only (StreamingLLM
    ablation, same budget and mechanism). ``off``: stock drafting."""

    chunk_size: int | None = None
    """Tokens per retrieval chunk; a whole number of KV blocks. ``None``: the
    smallest multiple of the KV block size that is at least 32 tokens (the
    paper's chunk)."""

    top_k_chunks: int | None = None
    """Chunks kept besides the sink and the recent window. ``None``: as many
    chunks as make ``DEFAULT_RETRIEVED_TOKENS`` (512) tokens, e.g. 4 chunks
    of 128 tokens (vLLM's CPU block size) or 16 of 32 (16-token GPU blocks)."""

    sink_tokens: int = 32
    """Tokens at the start of the context that are always kept (0: none)."""

    recent_tokens: int = 256
    """Tokens before the draft's query that are always kept. The blocks of the
    query itself and of the draft lookahead are kept in addition."""

    retrieval_interval: int = 4
    """Verification steps between two retrievals; the selection is reused in
    between, with newly filled blocks appended. With ``retrieval_refresh``
    ``acceptance``: the most steps between two retrievals."""

    retrieval_refresh: RetrievalRefresh = "interval"
    """``interval``: retrieve every ``retrieval_interval`` steps (the paper).
    ``acceptance``: also retrieve as soon as a request's acceptance under its
    current selection falls below ``1 - acceptance_drop`` of its own level,
    so a longer ``retrieval_interval`` (e.g. 16) costs no acceptance when the
    generation moves to another part of the context."""

    acceptance_drop: float = 0.5
    """``retrieval_refresh`` ``acceptance``: the relative drop of a request's
    recent acceptance (drafts accepted / drafted, EWMA over the steps its
    current selection drafted) below its longer-run level that triggers a
    retrieval; in (0, 1)."""

    min_context_tokens: int = 2048
    """Contexts shorter than this are drafted with the full KV cache."""

    score_aggregation: ScoreAggregation = "last_token"
    """``last_token``: scores from the target's row of the last accepted token
    at the retrieval step (the paper). ``accepted_tokens``: mean over the rows
    of all tokens accepted since the previous retrieval."""

    draft_positions: DraftPositions = "auto"
    """``original``: the draft runs every token at its position in the context,
    so it can only draft for requests that fit its window. ``compact``: a
    request longer than the draft's window drafts from its working cache laid
    out at positions ``0..W-1`` (SpecExtend); shorter ones draft as in stock
    vLLM. ``auto``: ``compact`` when the draft's window (its ``max_model_len``)
    is shorter than the target's, else ``original``."""

    private_layouts: bool = True
    """Compact positions with prefix caching: each running request lays its
    draft working cache out in blocks of its own, kept out of the
    scheduler's pool (one draft window per request, at most a quarter of
    the KV cache), so requests sharing a cached document each draft over
    their own layout. ``False``: lay out in place, in the shared blocks
    (more KV capacity; a request may draft over another's layout)."""

    speculation_control: SpeculationControlMode = "off"
    """``goodput``: per step and per request, draft only as many tokens as are
    expected to pay for their time (accepted tokens per second of the whole
    batch, from step costs measured on this engine and each request's own
    acceptance); a request may pause (no drafts) and is probed now and then.
    When no request drafts, a draft model's forward is skipped and its KV
    caught up when drafting resumes. Needs vLLM's synchronous scheduler.
    ``off``: vLLM's K for every request."""

    goodput_warm_up: GoodputWarmUp = "priced"
    """Goodput control's first drafts, which time the draft (until then its
    cost is unknown). ``priced``: they wait until the most they can cost
    (draft forwards at the draft's share of the target's parameters, the
    verification of their drafts, a short catch-up) is within the 2% of
    decode time that probes may spend, so a fresh engine's first requests
    are not slower than the target alone; drafting starts after about
    ``100 x (K x (1 + share) + 8 x share)`` decode steps (about 830 for the
    Qwen2.5-Coder 1.5B / 0.5B pair at K = 4, 440 for an EAGLE head of 3% of
    the target's parameters). ``immediate``: at
    the engine's first decode steps (a fresh engine pays them: 6% of the
    first 30 float32 steps of that pair on a 2-core CPU)."""

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, RetrievalMode)
        _check_choice("score_aggregation", self.score_aggregation, ScoreAggregation)
        _check_choice("draft_positions", self.draft_positions, DraftPositions)
        _check_choice("speculation_control", self.speculation_control, SpeculationControlMode)
        _check_choice("goodput_warm_up", self.goodput_warm_up, GoodputWarmUp)
        _check_choice("retrieval_refresh", self.retrieval_refresh, RetrievalRefresh)
        if not isinstance(self.private_layouts, bool):
            raise SpecExtendConfigError(
                f"spec_extend option 'private_layouts'={self.private_layouts!r} must be "
                "true or false")
        if (isinstance(self.acceptance_drop, bool)
                or not isinstance(self.acceptance_drop, (int, float))
                or not 0 < self.acceptance_drop < 1):
            raise SpecExtendConfigError(
                f"spec_extend option 'acceptance_drop'={self.acceptance_drop!r} is out of "
                "range; allowed: a number between 0 and 1 (exclusive)"
            )
        if self.chunk_size is not None:
            _check_int("chunk_size", self.chunk_size, minimum=1)
        if self.top_k_chunks is not None:
            _check_int("top_k_chunks", self.top_k_chunks, minimum=0)
        _check_int("sink_tokens", self.sink_tokens, minimum=0)
        _check_int("recent_tokens", self.recent_tokens, minimum=0)
        _check_int("retrieval_interval", self.retrieval_interval, minimum=1)
        _check_int("min_context_tokens", self.min_context_tokens, minimum=0)

    @property
    def enabled(self) -> bool:
        """Whether SpecExtend's drafters are installed (retrieval or control)."""
        return self.retrieves or self.controls_speculation

    @property
    def retrieves(self) -> bool:
        return self.mode != "off"

    @property
    def controls_speculation(self) -> bool:
        return self.speculation_control != "off"

    @classmethod
    def from_dict(cls, options: Any) -> SpecExtendConfig:
        if not isinstance(options, dict):
            raise SpecExtendConfigError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] must be a JSON object "
                f"of options, got {type(options).__name__}: {options!r}"
            )
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise SpecExtendConfigError(
                f"unknown spec_extend option(s) {unknown}; allowed options: {allowed}"
            )
        return cls(**options)

    def resolved_chunk_size(self, block_size: int) -> int:
        """Chunk size in tokens for a KV cache with ``block_size``
        (:meth:`check_chunk_size` refuses one that is not whole blocks)."""
        if self.chunk_size is None:
            return block_size * math.ceil(32 / block_size)
        return self.chunk_size

    def check_chunk_size(self, block_size: int) -> None:
        """Raise unless ``chunk_size`` is a whole number of KV blocks."""
        if self.chunk_size is not None and self.chunk_size % block_size:
            raise SpecExtendConfigError(
                f"spec_extend option 'chunk_size'={self.chunk_size} is not a whole "
                f"number of KV blocks (block_size={block_size}); use a multiple of "
                f"{block_size}"
            )

    def resolved_top_k_chunks(self, chunk_size: int) -> int:
        """Chunks to retrieve for chunks of ``chunk_size`` tokens."""
        if self.top_k_chunks is None:
            return max(1, DEFAULT_RETRIEVED_TOKENS // chunk_size)
        return self.top_k_chunks

    def uses_compact_positions(self, draft_window: int, target_max_model_len: int) -> bool:
        """Whether drafting runs at compact positions, ``auto`` resolved
        (:meth:`check_draft_positions` refuses ``original`` where it cannot
        draft)."""
        if self.draft_positions == "auto":
            return draft_window < target_max_model_len
        return self.draft_positions == "compact"

    def check_draft_positions(self, draft_window: int, target_max_model_len: int) -> None:
        """Raise for ``original`` with a window shorter than the target's."""
        if self.draft_positions == "original" and draft_window < target_max_model_len:
            raise SpecExtendConfigError(
                f"spec_extend option 'draft_positions'='original' cannot draft "
                f"requests longer than the draft's window ({draft_window} positions; "
                f"the target's max_model_len is {target_max_model_len}): vLLM would "
                "switch drafting off for the whole batch. Use 'compact' or 'auto', "
                "or a draft window as long as the target's."
            )

    def working_cache_tokens(self, block_size: int, num_speculative_tokens: int) -> int:
        """Most positions a compacted request drafts at, between two retrievals:
        sink + retrieved chunks + recent window (rounded to blocks) + the queries
        of ``retrieval_interval`` steps + the draft lookahead."""
        chunk_size = self.resolved_chunk_size(block_size)
        sink = block_size * math.ceil(self.sink_tokens / block_size)
        return (
            sink
            + self.resolved_top_k_chunks(chunk_size) * chunk_size
            + self.recent_tokens + block_size - 1
            + self.retrieval_interval * (num_speculative_tokens + 1)
            + num_speculative_tokens
        )

    def check_working_cache_fits(
        self, draft_window: int, block_size: int, num_speculative_tokens: int
    ) -> None:
        """Raise unless a compacted request always fits the draft's window."""
        needed = self.working_cache_tokens(block_size, num_speculative_tokens)
        if needed > draft_window:
            chunk_size = self.resolved_chunk_size(block_size)
            raise SpecExtendConfigError(
                f"spec_extend's working cache needs up to {needed} draft positions, "
                f"more than the draft's window of {draft_window}: sink_tokens="
                f"{self.sink_tokens} + top_k_chunks={self.resolved_top_k_chunks(chunk_size)}"
                f" x chunk_size={chunk_size} + recent_tokens={self.recent_tokens} "
                f"(+ {block_size - 1} block rounding) + retrieval_interval="
                f"{self.retrieval_interval} x (num_speculative_tokens="
                f"{num_speculative_tokens} + 1) + {num_speculative_tokens} lookahead. "
                "Lower top_k_chunks, recent_tokens, sink_tokens or "
                "retrieval_interval, or raise the draft's max_model_len."
            )

    def prefill_chunk_limit(
        self, draft_window: int, block_size: int, num_speculative_tokens: int
    ) -> int:
        """Largest prompt chunk the draft can prefill at compact positions: the
        chunk, its lookahead, the sink and the partly filled block before it must
        fit the window (the rest of the window holds the most recent tokens)."""
        sink = block_size * math.ceil(self.sink_tokens / block_size)
        return draft_window - num_speculative_tokens - 1 - sink - (block_size - 1)


def _check_choice(name: str, value: Any, choices: Any) -> None:
    allowed = get_args(choices)
    if value not in allowed:
        raise SpecExtendConfigError(
            f"spec_extend option {name!r}={value!r} is invalid; allowed values: "
            f"{list(allowed)}"
        )


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecExtendConfigError(
            f"spec_extend option {name!r} must be an integer, got "
            f"{type(value).__name__}: {value!r}"
        )
    if value < minimum:
        raise SpecExtendConfigError(
            f"spec_extend option {name!r}={value} is out of range; allowed: "
            f"an integer >= {minimum}"
        )


def spec_extend_options(additional_config: Any) -> Any | None:
    """The raw ``spec_extend`` options, or None when the user gave none."""
    if isinstance(additional_config, dict):
        return additional_config.get(ADDITIONAL_CONFIG_KEY)
    return None
