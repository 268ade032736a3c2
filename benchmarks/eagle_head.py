"""A short-window EAGLE-3 head for a Qwen2 target, trained on the CPU with
speculators' trainer (vLLM's head library), in one resumable command:

    python -m benchmarks.eagle_head [--minutes 75] [--target qwen2.5-coder-1.5b] [--out DIR]

Stages, each checkpointed (run the same command again after an interruption
and it goes on where it stopped):

1. data: chat samples cut from the shipped Austen corpus, one novel held out
   for validation; an Arrow dataset (``input_ids``, ``loss_mask``,
   ``seq_len``) and ``token_freq.pt`` for the draft vocabulary, as
   speculators reads them.
2. hidden: the target's aux hidden states and last-layer state per sample
   (``hidden_states/hs_{i}.safetensors``), from HF forward hooks.
3. train: ``speculators.train.cli.main`` (eagle3, one Llama layer, AdamW, sdpa,
   eager loss), with the trainer's accelerator assumptions patched at run
   time (``apply_cpu_patches``).
4. export: the last checkpoint becomes the head (``max_position_embeddings``
   = the training window, no embeddings: vLLM shares the target's), with
   ``eagle_head.json`` (plan, times, loss curve, held-out accuracy).

The head loads in vLLM with
``{"method": "eagle3", "model": HEAD_DIR, "num_speculative_tokens": K}``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SPECULATORS_VERSION = "0.9.0"
RECIPE_VERSION = 1

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
HELD_OUT_NOVEL = "persuasion"

# Tokens/s on 2 cores, per machine kind (``compute_kind``): the target's
# hidden states (HF forward with hooks, ~1,000-token samples; compute-bound)
# and head training per TTT depth (speculators' trainer, 1,024-token
# batches, draft vocab 16K).
# avx512_bf16: measured on an idle 2-core AMD EPYC with AVX-512 BF16 and no
# AMX (bf16 matmuls 2.3-2.8x float32; training at TTT 3 in float32: 104
# tok/s; on a shared machine every rate fell to a third).
# amx_bf16: not measured; the AVX-512 BF16 rates as a lower bound, so the
# 75-minute plan holds there (AMX bf16 matmuls are at least as fast).
# avx2_fp32: from a 2-core AVX2 EPYC shared with another job: HF float32
# hidden states 20-23 tok/s, training 20-34 (TTT 3) and 53-80 (TTT 1).
MEASURED_RATES: dict[str, dict[str, Any]] = {
    "amx_bf16": {"dtype": "bfloat16", "hidden": 122.0, "train": {1: 475.0, 2: 285.0, 3: 190.0}},
    "avx512_bf16": {"dtype": "bfloat16", "hidden": 122.0, "train": {1: 475.0, 2: 285.0, 3: 190.0}},
    "avx2_fp32": {"dtype": "float32", "hidden": 21.0, "train": {1: 65.0, 2: 45.0, 3: 30.0}},
}
STARTUP_SECONDS = 120  # loading the target and the trainer, writing checkpoints


def heads_cache_dir() -> Path:
    """Trained heads live beside the real models."""
    from benchmarks.real_models import default_cache_dir

    return default_cache_dir().parent / "heads"


def default_head_dir(target: str, window: int = 1024) -> Path:
    """Where the recipe puts the head of ``target`` (a folder or a short name)."""
    return heads_cache_dir() / f"{Path(target).name}-eagle3-w{window}"


def head_draft_length(head: str | Path, default: int = 3) -> int:
    """The K a head was trained for (its training-time test depth, from the
    recipe's ``eagle_head.json``), else ``default``."""
    report = Path(head) / "eagle_head.json"
    if not report.is_file():
        return default
    return json.loads(report.read_text())["vllm_config"]["num_speculative_tokens"]


# --- what the machine is good at ------------------------------------------------


def compute_kind(bf16_flags: list[str] | None = None) -> str:
    """``amx_bf16`` or ``avx512_bf16`` where the CPU has bf16 matmul
    instructions (``bf16_flags``: default this machine's, from
    ``machine.cpu_model``), else ``avx2_fp32`` (there torch's bf16 matmuls
    are ~100x slower than float32)."""
    from benchmarks.machine import cpu_model

    flags = cpu_model()[1] if bf16_flags is None else bf16_flags
    if "amx_bf16" in flags:
        return "amx_bf16"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return "avx2_fp32"


def bf16_speedup(m: int = 512, k: int = 3072, n: int = 1536, reps: int = 3) -> float:
    """How many times faster a bf16 matmul of the head's shape (fc / q-k-v
    input: 3 x 1536 or 2 x 1536 wide) runs than float32 here (~1 s)."""
    import torch

    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        times[dtype] = time.perf_counter() - start
    return times[torch.float32] / times[torch.bfloat16]


def training_dtype(kind: str | None = None) -> tuple[str, float | None]:
    """(dtype for the target's hidden states and the head's training, the
    measured bf16 speed-up). bf16 only where the CPU has bf16 instructions
    and a quick matmul shows it at least 1.3x faster than float32 (2.8x on a
    2-core AVX-512 BF16 EPYC without AMX); never tried on AVX2."""
    kind = kind or compute_kind()
    if kind == "avx2_fp32":
        return "float32", None
    speedup = bf16_speedup()
    return ("bfloat16" if speedup >= 1.3 else "float32"), speedup


# --- the recipe's settings ------------------------------------------------------


@dataclass
class Recipe:
    """Everything that decides the head; saved as ``plan.json`` in the work
    folder so a resumed run trains the same head."""

    target: str
    """The target model folder (a Qwen2 or Llama checkpoint)."""
    window: int = 1024
    """Training sequence length (<= this many tokens per sample) and the
    head's ``max_position_embeddings``: vLLM's draft window."""
    ttt_steps: int = 3
    """Training-time test depth: draft steps unrolled per position."""
    draft_vocab_size: int = 16384
    """Draft vocabulary (d2t/t2d): the most frequent tokens of the training
    text. 16,384 covers every token of the six novels (16,072 distinct
    tokens with Qwen2.5's tokenizer; 8K covers 98.3%, 12K 99.6%) at ~10% of
    a head step more than 8K."""
    aux_layer_ids: tuple[int, ...] | None = None
    """Target layers whose residual streams feed the head (vLLM aux ids:
    id i = after i layers); default ``default_aux_layer_ids``."""
    data_tokens: int = 100_000
    """Tokens of target hidden states to make (train + held out)."""
    epochs: int = 2
    """Passes over the data (a hidden-state token costs ~1.6 training passes
    at TTT 3: two passes balance fresh data against reuse)."""
    heldout_fraction: float = 0.05
    lr: float = 5e-4
    dtype: str = "float32"
    """Compute dtype of the target's pass and of training: "bfloat16"
    (autocast; where bf16 matmuls are fast, ``training_dtype``) or "float32"."""
    checkpoint_freq: float = 0.1
    """Checkpoint every this fraction of an epoch (resume points)."""
    copy_fraction: float = 0.3
    """Share of samples that ask to copy a paragraph of the passage (the rest
    ask to continue it)."""
    seed: int = 0
    version: int = RECIPE_VERSION

    def key(self) -> dict[str, Any]:
        return asdict(self)


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's default ``(2, L // 2, L - 3)`` ((2, 14, 25) for the 28-layer
    Qwen2.5 1.5B), sorted; on a target too shallow for three distinct ids of
    that form, the residual streams after layers 0, 1, 2. vLLM concatenates
    aux states in layer order, so the ids must be sorted and distinct."""
    ids = sorted({2, num_layers // 2, num_layers - 3})
    if len(ids) < 3 or ids[0] < 0:
        if num_layers < 2:
            raise ValueError(f"an EAGLE-3 head needs a target of >= 2 layers, not {num_layers}")
        ids = [0, 1, 2]
    return tuple(i for i in ids if 0 <= i <= num_layers)


def seconds_per_token(kind: str, ttt_steps: int, epochs: int,
                      rates: dict[str, dict[str, Any]] = MEASURED_RATES) -> tuple[float, float]:
    """(hidden-state seconds, training seconds) per data token on ``kind``."""
    rate = rates[kind]
    return 1 / rate["hidden"], epochs / rate["train"][min(ttt_steps, max(rate["train"]))]


def plan_budget(minutes: float, kind: str, ttt_steps: int, epochs: int,
                rates: dict[str, dict[str, Any]] = MEASURED_RATES) -> dict[str, Any]:
    """Tokens of hidden states that fit in ``minutes`` with ``epochs`` passes
    of training over them, from the rates of ``kind``: N / hidden + epochs *
    N / train = the budget (less startup)."""
    hidden, train = seconds_per_token(kind, ttt_steps, epochs, rates)
    tokens = max(60.0, minutes * 60 - STARTUP_SECONDS) / (hidden + train)
    return {"kind": kind, "dtype": rates[kind]["dtype"], "data_tokens": int(tokens),
            "hidden_seconds": tokens * hidden, "train_seconds": tokens * train,
            "rates": rates[kind]}


# --- data: chat samples from the corpus -----------------------------------------


CONTINUE_INSTRUCTION = "Continue the following passage from {title}, in the same style."
COPY_INSTRUCTION = ('Copy, word for word, the paragraph of the following passage from '
                    '{title} that begins with "{start}".')
TITLES = {
    "emma": "Emma", "mansfieldpark": "Mansfield Park", "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion", "prideprejudice": "Pride and Prejudice",
    "sensesensibility": "Sense and Sensibility",
}


@dataclass(frozen=True)
class ChatTemplatePieces:
    """The chat template around one user message and one assistant answer:
    ``head`` + user text + ``middle`` + answer + ``tail``."""

    head: str
    middle: str
    tail: str


def chat_template_pieces(tokenizer) -> ChatTemplatePieces:
    """Split the tokenizer's chat template around placeholder texts, so a
    sample can be assembled from token ids without re-tokenizing the passage."""
    user, answer = "\x01USER\x01", "\x01ANSWER\x01"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}],
                                           add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
        tokenize=False)
    head, middle = prompt.split(user)
    if not full.startswith(prompt):
        # Templates that render the assistant turn differently from the
        # generation prompt: take the middle from the full rendering.
        middle = full.split(user)[1].split(answer)[0]
    tail = full.split(answer)[1]
    return ChatTemplatePieces(head, middle, tail)


def chat_sample(tokenizer, pieces: ChatTemplatePieces, instruction: str,
                passage_ids: list[int], answer_ids: list[int]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one chat: the user gives ``instruction`` and
    a passage, the assistant answers ``answer_ids`` (cut before its end token).

    The loss mask covers the passage and the answer: EAGLE-3 learns the
    target's own next-token distributions, so every position of real text
    teaches the head; the system prompt, instruction and template tokens
    (the same in every sample) are left out."""
    head = tokenizer(pieces.head + instruction + "\n\n", add_special_tokens=False)["input_ids"]
    middle = tokenizer(pieces.middle, add_special_tokens=False)["input_ids"]
    ids = head + list(passage_ids) + middle + list(answer_ids)
    mask = [0] * len(head) + [1] * len(passage_ids) + [0] * len(middle) + [1] * len(answer_ids)
    return ids, mask


def paragraph_spans(token_ids: list[int], tokenizer,
                    min_tokens: int = 40) -> list[tuple[int, int]]:
    """(start, end) token offsets of the whole paragraphs (text between blank
    lines; not the cut one at the start) of at least ``min_tokens`` tokens in
    ``token_ids``."""
    spans, start = [], None
    for i, tid in enumerate(token_ids):
        if "\n\n" in tokenizer.decode([tid]):
            if start is not None and i - start >= min_tokens:
                spans.append((start, i))
            start = i + 1
    return spans


def corpus_samples(tokenizer, novel_ids: dict[str, list[int]], count: int, window: int,
                   copy_fraction: float, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """``count`` chat samples of at most ``window`` tokens from the novels in
    ``novel_ids`` (name -> token ids), at random offsets: "continue" samples
    (a passage and, as the answer, the text that follows it) and "copy"
    samples (the answer is a paragraph of the passage, as the benchmark's
    copying prompts ask)."""
    pieces = chat_template_pieces(tokenizer)
    overhead = 48 + len(tokenizer(pieces.head + pieces.middle,
                                  add_special_tokens=False)["input_ids"])
    names = sorted(novel_ids)
    weights = [len(novel_ids[n]) for n in names]
    samples = []
    while len(samples) < count:
        name = rng.choices(names, weights)[0]
        ids = novel_ids[name]
        body = window - overhead
        start = rng.randrange(0, max(1, len(ids) - body))
        title = TITLES.get(name, name)
        if rng.random() < copy_fraction:
            passage = ids[start : start + int(body * 0.7)]
            spans = [s for s in paragraph_spans(passage, tokenizer)
                     if s[1] - s[0] <= body - len(passage)]
            if not spans:
                continue
            a, b = rng.choice(spans)
            begins = " ".join(tokenizer.decode(passage[a : a + 12]).split()[:8]).lstrip("\"'_")
            instruction = COPY_INSTRUCTION.format(title=title, start=begins)
            answer = passage[a:b]
        else:
            split = rng.randint(body // 3, 2 * body // 3)
            passage, answer = ids[start : start + split], ids[start + split : start + body]
            instruction = CONTINUE_INSTRUCTION.format(title=title)
        input_ids, mask = chat_sample(tokenizer, pieces, instruction, passage, answer)
        samples.append((input_ids[:window], mask[:window]))
    return samples


def token_frequencies(token_lists) -> dict[int, int]:
    """Token id -> count over ``token_lists`` (what speculators'
    ``token_freq.pt`` holds; it keeps the ``draft_vocab_size`` most frequent)."""
    from collections import Counter

    counts: Counter[int] = Counter()
    for ids in token_lists:
        counts.update(ids)
    return dict(counts)


def vocab_coverage(freq: dict[int, int], sizes: list[int]) -> dict[int, float]:
    """Share of the counted tokens that the ``size`` most frequent cover."""
    values = sorted(freq.values(), reverse=True)
    total = sum(values) or 1
    return {size: sum(values[:size]) / total for size in sizes}


# --- stage 1: the dataset -------------------------------------------------------


def prepare_data(recipe: Recipe, data_dir: Path) -> dict[str, Any]:
    """Write the Arrow dataset and ``token_freq.pt`` (once). Held-out samples
    come from ``HELD_OUT_NOVEL`` and are the last rows: speculators' split
    takes the last ``1 - train_data_ratio`` of the rows for validation."""
    info_path = data_dir / "samples.json"
    if info_path.is_file():
        return json.loads(info_path.read_text())
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer

    from benchmarks.corpus import CORPUS_DIR, read_text, text_files

    tokenizer = AutoTokenizer.from_pretrained(recipe.target)
    novels = {p.name.split(".")[0]: p for p in text_files([CORPUS_DIR])}
    if HELD_OUT_NOVEL not in novels:
        raise FileNotFoundError(f"the corpus in {CORPUS_DIR} has no {HELD_OUT_NOVEL} to hold out")
    ids = {name: tokenizer(read_text(path), add_special_tokens=False)["input_ids"]
           for name, path in novels.items()}
    heldout = {HELD_OUT_NOVEL: ids.pop(HELD_OUT_NOVEL)}
    count = max(4, math.ceil(recipe.data_tokens / recipe.window))
    num_val = max(2, round(count * recipe.heldout_fraction))
    rng = random.Random(recipe.seed)
    train = corpus_samples(tokenizer, ids, count - num_val, recipe.window,
                           recipe.copy_fraction, rng)
    val = corpus_samples(tokenizer, heldout, num_val, recipe.window, recipe.copy_fraction, rng)
    rows = train + val
    dataset = Dataset.from_dict({
        "input_ids": [torch.tensor(i, dtype=torch.long) for i, _ in rows],
        "loss_mask": [torch.tensor(m, dtype=torch.long) for _, m in rows],
        "seq_len": [len(i) for i, _ in rows],
    })
    dataset.set_format(type="torch")
    tmp = data_dir.with_name(data_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dataset.save_to_disk(str(tmp))
    # The draft vocabulary: the training novels' tokens (not the held-out one).
    freq = token_frequencies(list(ids.values()))
    torch.save(freq, tmp / "token_freq.pt")
    info = {
        "samples": len(rows), "train_samples": len(train), "heldout_samples": len(val),
        "tokens": sum(len(i) for i, _ in rows),
        "loss_tokens": sum(sum(m) for _, m in rows),
        "heldout_novel": HELD_OUT_NOVEL,
        # speculators splits at int(rows * ratio): half a row of slack.
        "train_data_ratio": (len(train) + 0.5) / len(rows),
        "vocab_coverage": vocab_coverage(freq, [4096, 8192, 12288, 16384]),
        "distinct_train_tokens": len(freq),
    }
    (tmp / "samples.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(data_dir, ignore_errors=True)
    os.replace(tmp, data_dir)
    return info


# --- stage 2: target hidden states ----------------------------------------------


class HiddenStateExtractor:
    """The target's residual streams at ``aux_layer_ids`` (vLLM's ids: id i =
    after i layers) and after its last layer (un-normed, which speculators
    normalises itself), from forward hooks on an HF model.

    vLLM's own path (``method: extract_hidden_states`` with
    ``ExampleHiddenStatesConnector``) is not used: in vLLM 0.32 that
    connector copies through ``torch.cuda.Stream``/``Event`` and pinned
    memory, which a CPU build lacks."""

    def __init__(self, target: str, aux_layer_ids: tuple[int, ...], dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        # Loaded in bf16 (the checkpoint's dtype), then cast one weight at a
        # time without the lm_head: loading the 1.5B straight into float32
        # peaks at 10.8 GB RSS.
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
        # Only the decoder: the lm_head over the full vocabulary is not needed.
        self.model = model.model.eval()
        del model
        with torch.no_grad():
            for param in self.model.parameters():
                param.data = param.data.to(getattr(torch, dtype))
        layers = self.model.layers
        self.ids = tuple(aux_layer_ids) + (len(layers),)
        self._captured: dict[int, Any] = {}

        def keep(layer_id):
            def hook(_module, _args, output):
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
            return hook

        for layer_id in set(self.ids):
            if layer_id == 0:
                self.model.embed_tokens.register_forward_hook(keep(0))
            else:
                layers[layer_id - 1].register_forward_hook(keep(layer_id))

    def __call__(self, input_ids: list[int]):
        """[T, len(aux ids) + 1, H] in the model's dtype."""
        import torch

        self._captured.clear()
        with torch.inference_mode():
            self.model(input_ids=torch.tensor([input_ids]), use_cache=False)
        return torch.stack([self._captured[i][0] for i in self.ids], dim=1)


def generate_hidden_states(recipe: Recipe, data_dir: Path, dtype: str,
                           stats: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``hidden_states/hs_{i}.safetensors`` ({hidden_states [T, 4, H],
    token_ids [T]}) for every sample still missing one. Each file is
    written to a temporary name and renamed, so a killed run leaves no
    half-written file and the next run starts at the first missing sample."""
    import torch
    from datasets import load_from_disk
    from safetensors.torch import save_file
    from tqdm import tqdm

    dataset = load_from_disk(str(data_dir))
    out = data_dir / "hidden_states"
    out.mkdir(exist_ok=True)
    lengths = list(dataset.with_format(None)["seq_len"])
    todo = [i for i in range(len(dataset)) if not (out / f"hs_{i}.safetensors").is_file()]
    done_tokens = sum(lengths) - sum(lengths[i] for i in todo)
    # Filled as it goes, so an interrupted run still reports what it did.
    stats = stats if stats is not None else {}
    stats.update(tokens=0, seconds=0.0, load_seconds=0.0, dtype=dtype)
    if not todo:
        return stats
    started = time.monotonic()
    extractor = HiddenStateExtractor(recipe.target, aux_layer_ids(recipe), dtype)
    stats["load_seconds"] = time.monotonic() - started
    started = time.monotonic()
    with tqdm(total=sum(lengths), initial=done_tokens, unit="tok", desc="target hidden states",
              dynamic_ncols=True) as bar:
        for i in todo:
            ids = dataset[i]["input_ids"]
            hidden = extractor(ids.tolist()).to(torch.bfloat16).contiguous()
            tmp = out / f".hs_{i}.safetensors.tmp"
            save_file({"hidden_states": hidden, "token_ids": ids.clone()}, str(tmp))
            os.replace(tmp, out / f"hs_{i}.safetensors")
            bar.update(lengths[i])
            stats["tokens"] += lengths[i]
            stats["seconds"] = time.monotonic() - started
    return stats


def aux_layer_ids(recipe: Recipe) -> tuple[int, ...]:
    if recipe.aux_layer_ids is not None:
        return tuple(recipe.aux_layer_ids)
    from transformers import AutoConfig

    return default_aux_layer_ids(AutoConfig.from_pretrained(recipe.target).num_hidden_layers)


# --- stage 3: speculators' trainer on the CPU ----------------------------------


def apply_cpu_patches() -> None:
    """Let speculators 0.9.0's trainer run without an accelerator (idempotent).

    Its single-process path assumes one, in four places:
    - ``Trainer.local_rank`` is the int 0 and goes to ``.to(local_rank)`` for
      the model and every batch: 0 means ``cuda:0``. -> ``torch.device("cpu")``.
    - ``Trainer.device_type`` (the autocast device) falls back to ``"cuda"``,
      which would silently disable bf16 autocast. -> ``"cpu"``.
    - ``_StepTimer`` calls ``torch.accelerator.synchronize()``, which raises
      "Cannot access accelerator device when none is available". -> no sync.
    - the checkpointer's ``get_current_device()`` (map_location when resuming)
      falls back to ``"cuda:0"``. -> ``"cpu"``.
    """
    import torch
    from speculators.train import checkpointer, trainer

    if getattr(trainer.Trainer, "_specextend_cpu", False):
        return
    trainer.get_local_rank = lambda: torch.device("cpu")
    checkpointer.get_current_device = lambda: "cpu"
    original_init = trainer.Trainer.__init__

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = init
    trainer._StepTimer.mark = _step_timer_mark
    trainer._StepTimer.now = _step_timer_now
    trainer.Trainer._specextend_cpu = True


def _step_timer_mark(self, name: str) -> None:
    if self.enabled:
        self._marks[name] = time.perf_counter()


def _step_timer_now(self) -> float | None:
    return time.perf_counter() if self.enabled else None


class MetricsRecorder(logging.Handler):
    """Appends speculators' metric records (train steps, validation epochs)
    to a JSON-lines file, which survives resumes."""

    def __init__(self, path: Path):
        super().__init__(level=logging.INFO)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, dict) or getattr(record, "hparams", False):
            return
        entry = {"time": time.time(), **record.msg}
        with open(self.path, "a") as f:
            f.write(json.dumps(entry, default=float) + "\n")


@contextlib.contextmanager
def recording_metrics(path: Path):
    """speculators' ``main`` reconfigures its metric logger (dictConfig drops
    handlers): add the recorder right after it does."""
    from speculators.train import cli

    recorder = MetricsRecorder(path)
    original = cli.setup_metric_logger

    def setup(*args, **kwargs):
        original(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(recorder)

    cli.setup_metric_logger = setup
    try:
        yield recorder
    finally:
        cli.setup_metric_logger = original
        logging.getLogger("speculators.metrics").removeHandler(recorder)


def train_arguments(recipe: Recipe, data_dir: Path, checkpoints: Path,
                    train_data_ratio: float) -> list[str]:
    """speculators' ``train`` command line for the recipe."""
    return [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", recipe.target,
        "--data-path", str(data_dir),
        "--save-path", str(checkpoints),
        "--log-dir", str(checkpoints / "logs"),
        # One Llama layer: vLLM maps a "llama" transformer_layer_config to
        # Eagle3LlamaForCausalLM and rejects "qwen2".
        "--draft-arch", "llama",
        "--num-layers", "1",
        # Full attention (speculators defaults to a sliding window, which
        # vLLM would apply too): the window is max_position_embeddings.
        "--full-attention-indices", "0",
        "--target-layer-ids", *map(str, aux_layer_ids(recipe)),
        "--draft-vocab-size", str(recipe.draft_vocab_size),
        "--draft-attn-impl", "sdpa",
        "--loss-implementation", "eager",
        "--optimizer", "adamw",
        "--lr", str(recipe.lr),
        "--scheduler-type", "linear",
        "--scheduler-warmup-ratio", "0.05",
        "--ttt-steps", str(recipe.ttt_steps),
        "--total-seq-len", str(recipe.window),
        "--hidden-states-dtype", recipe.dtype,
        "--train-data-ratio", f"{train_data_ratio:.6f}",
        "--epochs", str(recipe.epochs),
        "--checkpoint-freq", str(recipe.checkpoint_freq),
        "--on-missing", "raise",
        "--num-workers", "0",
        "--log-freq", "1",
        "--seed", str(recipe.seed),
    ]


def train_head(recipe: Recipe, data_dir: Path, checkpoints: Path,
               train_data_ratio: float) -> None:
    """Run (or resume) speculators' trainer in this process. Its checkpoints
    (every ``checkpoint_freq`` of an epoch: weights, AdamW and scheduler
    state, step) are the resume points; it resumes from the newest."""
    import warnings

    import torch
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    apply_cpu_patches()
    # A killed run's "interrupted" save is not resumable (no step recorded);
    # the periodic checkpoint before it is.
    shutil.rmtree(checkpoints / "interrupted", ignore_errors=True)
    torch.set_num_threads(os.cpu_count() or 1)
    config = TrainConfig.resolve(train_arguments(recipe, data_dir, checkpoints,
                                                 train_data_ratio))
    with recording_metrics(checkpoints / "metrics.jsonl"), warnings.catch_warnings():
        # fp32 "autocast" on the CPU: torch warns once per step that it is off.
        warnings.filterwarnings("ignore", message="In CPU autocast")
        main(config)


def final_checkpoint(checkpoints: Path, epochs: int) -> Path | None:
    """The last epoch's end-of-epoch checkpoint, or None while training is
    unfinished."""
    last = checkpoints / str(epochs - 1)
    state = last / "training_state.json"
    if not (last / "model.safetensors").is_file() or not state.is_file():
        return None
    return last if json.loads(state.read_text()).get("local_step", 1) == 0 else None


# --- stage 4: the head ----------------------------------------------------------


def export_head(checkpoint: Path, out: Path, window: int) -> None:
    """The checkpoint as a vLLM head: its window in ``max_position_embeddings``,
    without the (frozen, target-identical) embeddings."""
    from safetensors.torch import load_file, save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = json.loads((checkpoint / "config.json").read_text())
    config["transformer_layer_config"]["max_position_embeddings"] = window
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = load_file(checkpoint / "model.safetensors")
    weights.pop("embed_tokens.weight", None)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def acceptance_length(cond_acc: list[float]) -> float:
    """Expected tokens per target step for a greedy chain of len(cond_acc)
    drafts, from per-position conditional accuracies (position k accepted
    given all before it were): 1 + sum_k prod_{j<=k} cond_acc[j]."""
    total, running = 1.0, 1.0
    for acc in cond_acc:
        running *= acc
        total += running
    return total


def summarize_training(entries: list[dict[str, Any]], ttt_steps: int) -> dict[str, Any]:
    """Loss curve (per step, the last record of each global step: a resumed
    run repeats none) and held-out per-position accuracies per epoch."""
    steps: dict[int, dict[str, Any]] = {}
    val = []
    for entry in entries:
        if "train" in entry:
            metrics = entry["train"]
            steps[entry["global_step"]] = {
                "step": entry["global_step"], "epoch": entry["epoch"],
                "loss": metrics.get("loss"), "lr": entry.get("lr"),
                "full_acc": [metrics.get(f"full_acc_{k}") for k in range(ttt_steps)],
                "tokens_per_s": (entry.get("profile") or {}).get("tokens_per_s"),
            }
        elif "val" in entry:
            metrics = entry["val"]
            cond = [metrics.get(f"cond_acc_{k}_epoch") for k in range(ttt_steps)]
            val.append({
                "epoch": entry["epoch"], "loss": metrics.get("loss_epoch"),
                "full_acc": [metrics.get(f"full_acc_{k}_epoch") for k in range(ttt_steps)],
                "cond_acc": cond,
                "acceptance_length": (acceptance_length(cond)
                                      if all(c is not None for c in cond) else None),
            })
    curve = [steps[s] for s in sorted(steps)]
    rates = [s["tokens_per_s"] for s in curve if s["tokens_per_s"]]
    return {"steps": len(curve), "loss_curve": curve, "heldout": val,
            "median_train_tokens_per_s": sorted(rates)[len(rates) // 2] if rates else None}


# --- the whole recipe -----------------------------------------------------------


def load_or_save_plan(work: Path, recipe: Recipe, fresh: bool) -> Recipe:
    """The work folder's recipe. A rerun with different settings would mix two
    heads' data and checkpoints: refuse, naming the setting."""
    path = work / "plan.json"
    if fresh:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    if path.is_file():
        saved = json.loads(path.read_text())["recipe"]
        for name, value in recipe.key().items():
            old = saved.get(name)
            if (list(old) if isinstance(old, (list, tuple)) else old) != (
                    list(value) if isinstance(value, (list, tuple)) else value):
                raise SystemExit(
                    f"{work} holds a run with {name}={old!r}, not {value!r}: rerun with "
                    f"the same settings to resume, or pass --fresh to start over")
        return recipe
    path.write_text(json.dumps({"recipe": recipe.key()}, indent=2))
    return recipe


def run_recipe(recipe: Recipe, out: Path, work: Path, fresh: bool = False,
               plan: dict[str, Any] | None = None) -> Path:
    """All four stages; returns the head folder. Idempotent: a finished head
    (``.complete`` holding the recipe) is returned at once."""
    marker = out / ".complete"
    recipe_json = json.dumps(recipe.key(), sort_keys=True)
    if marker.is_file() and marker.read_text() == recipe_json and not fresh:
        return out
    load_or_save_plan(work, recipe, fresh)
    times_path = work / "times.json"
    times = json.loads(times_path.read_text()) if times_path.is_file() else {}

    def record(stage: str, seconds: float, **extra) -> None:
        entry = times.setdefault(stage, {"seconds": 0.0})
        entry["seconds"] += seconds
        entry.update(extra)
        times_path.write_text(json.dumps(times, indent=2))

    data_dir, checkpoints = work / "data", work / "checkpoints"
    started = time.monotonic()
    info = prepare_data(recipe, data_dir)
    record("data", time.monotonic() - started)
    print(f"data: {info['samples']} samples, {info['tokens']} tokens "
          f"({info['heldout_samples']} held out from {info['heldout_novel']})", flush=True)

    # The target's pass runs in the training dtype: bf16 where its matmuls are
    # fast (HF on a 2-core AVX-512 BF16 EPYC: 122 tok/s in bf16).
    hidden_dtype = recipe.dtype
    stats: dict[str, Any] = {}
    try:
        generate_hidden_states(recipe, data_dir, hidden_dtype, stats)
    finally:
        if stats.get("tokens"):
            record("hidden", stats["seconds"] + stats["load_seconds"],
                   tokens_per_s=stats["tokens"] / max(stats["seconds"], 1e-9),
                   dtype=hidden_dtype)

    if final_checkpoint(checkpoints, recipe.epochs) is None:
        started = time.monotonic()
        try:
            train_head(recipe, data_dir, checkpoints, info["train_data_ratio"])
        finally:
            record("train", time.monotonic() - started)
    checkpoint = final_checkpoint(checkpoints, recipe.epochs)
    if checkpoint is None:
        raise SystemExit("training stopped before its end; run the same command to resume")

    export_head(checkpoint, out, recipe.window)
    summary = summarize_training(read_metrics(checkpoints / "metrics.jsonl"), recipe.ttt_steps)
    from benchmarks.machine import cpu_model

    report = {
        "recipe": recipe.key(), "plan": plan, "data": info, "times": times,
        "total_seconds": sum(t["seconds"] for t in times.values()),
        "machine": {"cpu_model": cpu_model()[0], "cpu_bf16_flags": cpu_model()[1],
                    "kind": compute_kind(), "cpu_count": os.cpu_count()},
        "speculators": SPECULATORS_VERSION,
        "vllm_config": {"method": "eagle3", "model": str(out),
                        "num_speculative_tokens": recipe.ttt_steps},
        **summary,
    }
    (out / "eagle_head.json").write_text(json.dumps(report, indent=2, default=str))
    marker.write_text(recipe_json)
    return out


# --- the recipe's record, for benchmarks/results ---------------------------------


def write_head_results(head: Path, out_dir: Path) -> str:
    """The head's ``eagle_head.json`` as results: the JSON, a markdown summary
    and the training curve (loss and per-position accuracy per step, held-out
    accuracy per epoch)."""
    from benchmarks.report import pyplot, save_figure

    report = json.loads((head / "eagle_head.json").read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eagle_head.json").write_text(json.dumps(report, indent=2))
    recipe, data, times = report["recipe"], report["data"], report["times"]
    machine = report["machine"]
    lines = [
        f"# EAGLE-3 head for {Path(recipe['target']).name}: window {recipe['window']}, "
        f"TTT {recipe['ttt_steps']}, {recipe['dtype']}",
        "",
        f"Machine: {machine['cpu_count']} cores, {machine['cpu_model']} ({machine['kind']}); "
        f"speculators {report['speculators']}.",
        f"Data: {data['samples']} samples, {data['tokens']} tokens "
        f"({data['heldout_samples']} held out, from {data['heldout_novel']}); "
        f"{recipe['epochs']} epochs, {report['steps']} steps.",
        "",
        "| stage | minutes | tokens/s |",
        "|---|---:|---:|",
    ]
    for stage, entry in times.items():
        rate = entry.get("tokens_per_s")
        lines.append(f"| {stage} | {entry['seconds'] / 60:.1f} | "
                     f"{'-' if rate is None else f'{rate:.0f}'} |")
    train_rate = report.get("median_train_tokens_per_s")
    lines += [f"| total | {report['total_seconds'] / 60:.1f} | "
              f"{'-' if train_rate is None else f'{train_rate:.0f} (training, median)'} |",
              "", "Held out, per epoch (speculators' validation: accuracy per draft "
              "position given the earlier ones, and the acceptance length they imply):", "",
              "| epoch | loss | "
              + " | ".join(f"acc. pos {k + 1}" for k in range(recipe["ttt_steps"]))
              + " | acceptance length |",
              "|---:|---:|" + "---:|" * recipe["ttt_steps"] + "---:|"]
    for val in report["heldout"]:
        cond = " | ".join("-" if c is None else f"{c:.3f}" for c in val["cond_acc"])
        length = val["acceptance_length"]
        lines.append(f"| {val['epoch']} | {val['loss']:.3f} | {cond} | "
                     f"{'-' if length is None else f'{length:.2f}'} |")
    (out_dir / "eagle_head.md").write_text("\n".join(lines) + "\n")

    plt = pyplot()
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    curve = report["loss_curve"]
    steps = [c["step"] for c in curve]
    ax_loss.plot(steps, [c["loss"] for c in curve], color="tab:gray", linewidth=0.8)
    ax_loss.set_xlabel("training step")
    ax_loss.set_ylabel("training loss (sum over TTT positions)")
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
    for k in range(recipe["ttt_steps"]):
        color = colors[k % len(colors)]
        ax_acc.plot(steps, [c["full_acc"][k] for c in curve], color=color, linewidth=0.8,
                    alpha=0.6, label=f"train, position {k + 1}")
        epoch_steps = [max(c["step"] for c in curve if c["epoch"] == v["epoch"])
                       for v in report["heldout"]]
        ax_acc.plot(epoch_steps, [v["full_acc"][k] for v in report["heldout"]], marker="o",
                    linestyle="none", color=color, label=f"held out, position {k + 1}")
    ax_acc.set_xlabel("training step")
    ax_acc.set_ylabel("accuracy (draft accepted up to the position)")
    ax_acc.legend(fontsize=8)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    save_figure(fig, out_dir / "eagle_head.png",
                f"EAGLE-3 head for {Path(recipe['target']).name}: {data['tokens']} tokens, "
                f"{recipe['epochs']} epochs, TTT {recipe['ttt_steps']}, {recipe['dtype']}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help="target model folder, or a name of benchmarks.real_models")
    parser.add_argument("--out", type=Path, default=None,
                        help="head folder (default ~/.cache/vllm-specextend/heads/NAME)")
    parser.add_argument("--name", default=None, help="head name (default from target, window)")
    parser.add_argument("--work", type=Path, default=None,
                        help="scratch folder for data, hidden states, checkpoints "
                             "(default OUT.work)")
    parser.add_argument("--minutes", type=float, default=75.0,
                        help="time budget on an AMX machine: sets --data-tokens from "
                             "MEASURED_RATES (on other CPUs the same work takes longer)")
    parser.add_argument("--budget-for", default="amx_bf16", choices=sorted(MEASURED_RATES),
                        help="machine kind whose rates turn --minutes into tokens "
                             "(default amx_bf16: the same head on every machine)")
    parser.add_argument("--data-tokens", type=int, default=None,
                        help="tokens of hidden states (overrides --minutes)")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--draft-vocab-size", type=int, default=16384)
    parser.add_argument("--aux-layer-ids", type=int, nargs="+", default=None)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="dtype of the target's hidden-state pass and of training "
                             "(autocast); auto: bfloat16 where the CPU has bf16 "
                             "instructions and a quick matmul shows them faster")
    parser.add_argument("--checkpoint-freq", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fresh", action="store_true", help="discard the work folder first")
    parser.add_argument("--results", type=Path, default=None,
                        help="also write the recipe's record (JSON, markdown, training "
                             "curve) here, e.g. benchmarks/results/eagle3-head")
    args = parser.parse_args(argv)
    if args.window > 1024:
        parser.error("--window: the recipe trains short-window heads (<= 1024 tokens)")
    if args.ttt_steps < 1:
        parser.error("--ttt-steps must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from benchmarks.real_models import resolve_model

    target = resolve_model(args.target)
    kind = compute_kind()
    dtype, speedup = training_dtype(kind) if args.dtype == "auto" else (args.dtype, None)
    plan = plan_budget(args.minutes, args.budget_for, args.ttt_steps, args.epochs)
    plan["this_machine"] = plan_budget(args.minutes, kind, args.ttt_steps, args.epochs)
    plan["bf16_matmul_speedup"] = speedup
    recipe = Recipe(
        target=str(target), window=args.window, ttt_steps=args.ttt_steps,
        draft_vocab_size=args.draft_vocab_size,
        aux_layer_ids=tuple(args.aux_layer_ids) if args.aux_layer_ids else None,
        data_tokens=args.data_tokens or plan["data_tokens"], epochs=args.epochs, lr=args.lr,
        dtype=dtype, checkpoint_freq=args.checkpoint_freq, seed=args.seed)
    out = args.out or (heads_cache_dir() / args.name if args.name
                       else default_head_dir(target, args.window))
    work = args.work or out.with_name(out.name + ".work")
    expected = (recipe.data_tokens * sum(seconds_per_token(kind, recipe.ttt_steps, recipe.epochs))
                + STARTUP_SECONDS)
    print(f"eagle head: {recipe.data_tokens} tokens x {recipe.epochs} epochs, TTT "
          f"{recipe.ttt_steps}, {dtype} on {kind}: about {expected / 60:.0f} min here; "
          f"work folder {work}", flush=True)
    head = run_recipe(recipe, out, work, fresh=args.fresh, plan=plan)
    if args.results:
        print(write_head_results(head, args.results))
    print(f"head: {head}\nvLLM: speculative_config={{\"method\": \"eagle3\", \"model\": "
          f"\"{head}\", \"num_speculative_tokens\": {recipe.ttt_steps}}}")


if __name__ == "__main__":
    main()
