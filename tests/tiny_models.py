"""Tiny random-weight target/draft models for tests, built offline.

A byte-level BPE tokenizer is trained on the Austen prose shipped in
``corpus/``; Llama and Qwen2 models with
random weights are saved in float32 next to it, and one Llama built by hand
on which retrieval matters (``build_needle_model``). Everything is cached by a key
of the build parameters, so a test session builds each model once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

BUILD_VERSION = 1

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of one tiny model. ``seed`` fixes its random weights."""

    architecture: str  # "llama" or "qwen2"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 1024
    max_position_embeddings: int = 8192
    # Larger than HF's 0.02 so logits are peaked: greedy argmax is then far
    # from ties and float32 runs compare exactly.
    initializer_range: float = 0.1
    seed: int = 0


TARGET_LLAMA = TinyModelSpec("llama", 128, 4, 4, 2, seed=1)
DRAFT_LLAMA = TinyModelSpec("llama", 64, 2, 2, 1, intermediate_size=128, seed=2)
TARGET_QWEN2 = TinyModelSpec("qwen2", 128, 3, 4, 2, seed=3)
DRAFT_QWEN2 = TinyModelSpec("qwen2", 64, 2, 2, 1, intermediate_size=128, seed=4)


def cache_root() -> Path:
    return Path(
        os.environ.get(
            "SPECEXTEND_TEST_MODELS",
            Path.home() / ".cache" / "vllm-specextend" / "tiny-models",
        )
    )


def corpus_text(max_chars: int | None = None) -> str:
    """Austen prose (the project's ``corpus/``) for the tokenizer and prompts."""
    from benchmarks.corpus import CORPUS_DIR, read_text, text_files

    text = "\n".join(read_text(p) for p in text_files([CORPUS_DIR]))
    return text if max_chars is None else text[:max_chars]


def _key(payload: dict) -> str:
    blob = json.dumps({"v": BUILD_VERSION, **payload}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _atomic_build(target: Path, build) -> Path:
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        build(tmp)
        os.replace(tmp, target)
    except OSError:
        # Another process finished the same build first.
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def build_tokenizer(vocab_size: int = 1024) -> Path:
    """Train (once) a byte-level BPE tokenizer on the corpus."""
    target = cache_root() / f"tokenizer-{vocab_size}-{_key({'vocab': vocab_size})}"

    def build(out: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator([corpus_text(2_000_000)], trainer=trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="</s>",
        )
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(out)

    return _atomic_build(target, build)


def build_model(spec: TinyModelSpec) -> Path:
    """Build (once) a random-weight model with the shared tokenizer."""
    target = cache_root() / f"{spec.architecture}-{_key(asdict(spec))}"

    def build(out: Path) -> None:
        import torch
        from transformers import (
            AutoModelForCausalLM,
            AutoTokenizer,
            LlamaConfig,
            Qwen2Config,
        )

        tok_dir = build_tokenizer(spec.vocab_size)
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        common = dict(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            max_position_embeddings=spec.max_position_embeddings,
            initializer_range=spec.initializer_range,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=False,
            torch_dtype="float32",
        )
        if spec.architecture == "llama":
            config = LlamaConfig(**common)
        elif spec.architecture == "qwen2":
            config = Qwen2Config(**common, use_sliding_window=False)
        else:
            raise ValueError(f"unknown architecture {spec.architecture!r}")
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)

    return _atomic_build(target, build)


def build_noisy_copy(spec: TinyModelSpec, noise: float, seed: int = 0) -> Path:
    """A draft that agrees with ``spec``'s model often but not always: the
    target's weights plus Gaussian noise of relative size ``noise``."""
    source = build_model(spec)
    target = cache_root() / f"noisy-{_key({**asdict(spec), 'noise': noise, 'seed': seed})}"

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                scale = param.std() if param.numel() > 1 else param.abs()
                param.add_(
                    torch.randn(param.shape, generator=generator) * scale * noise
                )
        model.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(source).save_pretrained(out)

    return _atomic_build(target, build)


def build_damped_attention_copy(spec: TinyModelSpec, scale: float) -> Path:
    """``spec``'s model with its attention output projections scaled by
    ``scale``: the next token then depends mostly on the recent tokens, so a
    draft that sees part of a long context still predicts it often (random
    full-strength attention spreads over the whole context)."""
    source = build_model(spec)
    target = cache_root() / f"damped-{_key({**asdict(spec), 'attention_scale': scale})}"

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("self_attn.o_proj.weight"):
                    param.mul_(scale)
        model.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(source).save_pretrained(out)

    return _atomic_build(target, build)


def build_short_window_copy(source: Path, window: int) -> Path:
    """The model at ``source`` with its weights unchanged but only ``window``
    positions (its rotary table ends there), like a draft trained on short
    texts."""
    target = cache_root() / f"window{window}-{_key({'source': str(source), 'window': window})}"

    def build(out: Path) -> None:
        shutil.copytree(source, out, dirs_exist_ok=True)
        config_path = out / "config.json"
        config = json.loads(config_path.read_text())
        config["max_position_embeddings"] = window
        config_path.write_text(json.dumps(config, indent=2))

    return _atomic_build(target, build)


def build_mtp_target(spec: TinyModelSpec, num_mtp_layers: int = 1) -> Path:
    """``spec``'s Qwen2 model as a MiMo target (``MiMoForCausalLM``) with
    ``num_mtp_layers`` random multi-token-prediction layers, for ``method:
    mtp``. Its base layers are ``spec``'s, so its greedy outputs are those of
    ``build_model(spec)``."""
    if spec.architecture != "qwen2":
        raise ValueError("a MiMo MTP target is a Qwen2 model")
    source = build_model(spec)
    target = cache_root() / f"mimo-mtp-{_key({**asdict(spec), 'mtp': num_mtp_layers})}"

    def build(out: Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file

        shutil.copytree(source, out, dirs_exist_ok=True)
        config_path = out / "config.json"
        config = json.loads(config_path.read_text())
        config.update(architectures=["MiMoForCausalLM"],
                      num_nextn_predict_layers=num_mtp_layers)
        config_path.write_text(json.dumps(config, indent=2))
        # vLLM's MiMo MTP layer (model_executor/models/mimo_mtp.py): norms of
        # the token embedding and of the target's hidden state, a projection
        # of their concatenation, one Qwen2 decoder layer, a final norm.
        weights = load_file(out / "model.safetensors")
        hidden, inter = spec.hidden_size, spec.intermediate_size
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        shapes = {
            "input_proj.weight": (hidden, 2 * hidden),
            "self_attn.q_proj.weight": (q_size, hidden),
            "self_attn.q_proj.bias": (q_size,),
            "self_attn.k_proj.weight": (kv_size, hidden),
            "self_attn.k_proj.bias": (kv_size,),
            "self_attn.v_proj.weight": (kv_size, hidden),
            "self_attn.v_proj.bias": (kv_size,),
            "self_attn.o_proj.weight": (hidden, q_size),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
        }
        generator = torch.Generator().manual_seed(spec.seed + 100)
        for layer in range(num_mtp_layers):
            prefix = f"model.mtp_layers.{layer}."
            for name, shape in shapes.items():
                weights[prefix + name] = (
                    torch.randn(shape, generator=generator) * spec.initializer_range)
            for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm",
                         "input_layernorm", "post_attention_layernorm"):
                weights[f"{prefix}{norm}.weight"] = torch.ones(hidden)
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})

    return _atomic_build(target, build)


# --- A model on which retrieval matters ---------------------------------------
#
# Random weights attend everywhere a little, so on them a draft that sees part
# of the context accepts about as much whichever part it sees. The needle model
# is built by hand instead: every token's query in its one attention layer
# looks for "needle" tokens (keys only they have, on the lowest-frequency
# rotary pair so position does not matter), a needle's value names it, and the
# answer to needle i is token ANSWER_TOKENS[i], at every step after the prompt.
# Without a needle in view the attention averages zero values and the model
# answers FILLER_TOKEN. So a draft equal to it accepts every draft when it
# keeps the needle's chunk and none when it does not.

NEEDLE_TOKENS = tuple(range(800, 816))
"""Token ids that draw the attention (one per prompt, ``needle_prompt``)."""
ANSWER_TOKENS = tuple(range(816, 832))
"""``ANSWER_TOKENS[i]``: what the needle model generates after ``NEEDLE_TOKENS[i]``."""
FILLER_TOKEN = 832
"""What it generates when no needle is in view."""
HAYSTACK_TOKENS = (8, 800)
"""The range the other prompt tokens are drawn from."""
NEEDLE_SPEC = TinyModelSpec("llama", 64, 1, 2, 1, intermediate_size=64, seed=0)


def build_needle_model() -> Path:
    """The hand-built needle model (``NEEDLE_SPEC``'s shapes, float32)."""
    spec = NEEDLE_SPEC
    # Bump "needle" when needle_weights changes: the key does not see it.
    target = cache_root() / f"needle-{_key({**asdict(spec), 'needle': 1})}"

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

        tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(spec.vocab_size))
        config = LlamaConfig(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
            # The needle's key sits on the slowest rotary pair: at this base it
            # turns by 4e-9 rad per position, so no position moves the attention.
            rope_parameters={"rope_type": "default", "rope_theta": 1e9},
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=False, torch_dtype="float32")
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        for param in model.parameters():
            param.data.zero_()
        needle_weights(model, spec)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)

    return _atomic_build(target, build)


def needle_weights(model, spec: TinyModelSpec) -> None:
    """Residual features: 0 a constant, 1 "is a needle", 2 + i needle i's
    name, 20 + i what the attention read (needle i), 40-41 padding so every
    token's embedding has the same norm (RMSNorm then scales them alike)."""
    import torch

    num_needles, head_dim = len(NEEDLE_TOKENS), spec.head_dim
    slow = head_dim - 1  # the second half of the slowest (neox) rotary pair
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, 0] = 1.0
        embed[:, 40:42] = 1.0
        for i, token in enumerate(NEEDLE_TOKENS):
            embed[token, 40:42] = 0.0
            embed[token, 1] = 1.0
            embed[token, 2 + i] = 1.0
        layer = model.model.layers[0]
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm):
            norm.weight.fill_(1.0)
        attention = layer.self_attn
        # Normed features are ~4.6 (sqrt(64 / 3)): a needle's logit is
        # 2.8 * 2.8 * 4.6^2 / sqrt(32) = 30 over every other token's 0.
        for head in range(spec.num_heads):
            attention.q_proj.weight[head * head_dim + slow, 0] = 2.8
        attention.k_proj.weight[slow, 1] = 2.8
        for i in range(num_needles):
            attention.v_proj.weight[i, 2 + i] = 1.0
            for head in range(spec.num_heads):
                attention.o_proj.weight[20 + i, head * head_dim + i] = 1.0
        # Answer i by the read feature 20 + i; the filler by the constant,
        # which wins only when nothing was read.
        lm_head = model.lm_head.weight
        for i, token in enumerate(ANSWER_TOKENS):
            lm_head[token, 20 + i] = 1.0
        lm_head[FILLER_TOKEN, 0] = 2.0


def needle_prompt(length: int, needle: int, depth: int, seed: int = 0) -> list[int]:
    """``length`` haystack token ids with ``NEEDLE_TOKENS[needle]`` at
    position ``depth``."""
    import random

    rng = random.Random(seed)
    prompt = [rng.randrange(*HAYSTACK_TOKENS) for _ in range(length)]
    prompt[depth] = NEEDLE_TOKENS[needle]
    return prompt


if __name__ == "__main__":
    for s in (TARGET_LLAMA, DRAFT_LLAMA, TARGET_QWEN2, DRAFT_QWEN2):
        print(build_model(s))
