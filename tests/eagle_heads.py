"""Tiny EAGLE-1 / EAGLE-3 draft heads for tests, built offline.

Random heads for losslessness tests, and heads trained in a few minutes with
plain torch to imitate a tiny target (for acceptance checks). Cached like the
models of ``tiny_models.py``. The trained head the suite uses ships in
``tests/fixtures`` with a digest of the target it was trained for; it is
trained afresh only where the tiny target comes out different.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from tests.tiny_models import (
    REPO_ROOT,
    TinyModelSpec,
    _atomic_build,
    _key,
    build_model,
    cache_root,
    corpus_text,
)


# --- EAGLE draft heads --------------------------------------------------------
#
# One-layer EAGLE-1 / EAGLE-3 heads that vLLM 0.32 loads for a tiny target
# (``{"method": "eagle" | "eagle3", "model": HEAD_DIR}``). Weights are saved
# under the names vLLM's loaders expect (``model_executor/models/llama_eagle.py``,
# ``llama_eagle3.py``): no ``model.`` prefix (their ``load_weights`` adds it),
# separate q/k/v and gate/up projections (stacked on load), ``layers.0.``.
#
# EAGLE-1 (``EagleLlamaForCausalLM``) ships ``fc`` [H, 2H] and the layer without
# ``input_layernorm`` (vLLM replaces it by Identity) and without final norm;
# embeddings and lm_head come from the target (not in the checkpoint, so
# vLLM shares the target's). Its input is cat(embed(next token), the target's
# final, normed hidden state).
#
# EAGLE-3 (``Eagle3LlamaForCausalLM``) ships ``fc`` [H, 3H] over the target's
# aux hidden states (residual stream after the layers in
# ``eagle_aux_hidden_state_layer_ids``), the layer (q/k/v take 2H:
# cat(input_layernorm(embed), hidden_norm(fc out))), ``norm`` and its own
# ``lm_head`` over the full target vocab (draft vocab == target vocab, so no
# d2t / t2d); embeddings are shared with the target.

EAGLE_ARCHITECTURES = {"eagle": "EagleLlamaForCausalLM", "eagle3": "Eagle3LlamaForCausalLM"}

TRAINED_HEAD_VERSION = 3
TRAINING_THREADS = min(2, os.cpu_count() or 1)
HEAD_FIXTURES = REPO_ROOT / "tests" / "fixtures"
_HEAD_FILES = ("config.json", "model.safetensors", "eagle_training.json")


def eagle3_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """Three distinct aux layers for an EAGLE-3 head on a ``num_layers`` target:
    the residual streams after layers L-3, L-2, L-1 ((1, 2, 3) for 4 layers).
    vLLM's default ``(2, L // 2, L - 3)`` repeats layer 2 on a 4-layer target
    (and crashes); id L is avoided because HF's ``hidden_states[L]`` is the
    final, normed state while vLLM's id L is the un-normed residual stream."""
    if num_layers < 3:
        raise ValueError(f"an EAGLE-3 head needs a target of >= 3 layers, not {num_layers}")
    return tuple(range(num_layers - 3, num_layers))


def _eagle_head_config(source: Path, kind: str, window: int | None):
    """The head's ``LlamaConfig`` (one layer, the target's shapes)."""
    from transformers import AutoConfig, LlamaConfig

    if kind not in EAGLE_ARCHITECTURES:
        raise ValueError(f"unknown EAGLE kind {kind!r}")
    src = AutoConfig.from_pretrained(source)
    extra = {}
    if kind == "eagle3":
        ids = list(eagle3_aux_layer_ids(src.num_hidden_layers))
        extra = dict(
            # Read by the runner (which target layers to return) and by the
            # head (fc input = len(ids) * H).
            eagle_aux_hidden_state_layer_ids=ids,
            eagle_config={"eagle_aux_hidden_state_layer_ids": ids,
                          "use_aux_hidden_state": True},
        )
    return LlamaConfig(
        architectures=[EAGLE_ARCHITECTURES[kind]],
        vocab_size=src.vocab_size,
        hidden_size=src.hidden_size,
        intermediate_size=src.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_key_value_heads,
        head_dim=getattr(src, "head_dim", None) or src.hidden_size // src.num_attention_heads,
        # The head's window: vLLM makes it the draft's max_model_len.
        max_position_embeddings=window or src.max_position_embeddings,
        rms_norm_eps=src.rms_norm_eps,
        rope_parameters=dict(src.rope_parameters),
        initializer_range=getattr(src, "initializer_range", 0.02),
        bos_token_id=src.bos_token_id,
        eos_token_id=src.eos_token_id,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        torch_dtype="float32",
        **extra,
    )


def _eagle_head_weights(config, kind: str, generator) -> dict:
    """Random float32 head weights under vLLM's checkpoint names."""
    import torch

    h, i = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    std = config.initializer_range
    if kind == "eagle3":
        fc_in, qkv_in = len(config.eagle_aux_hidden_state_layer_ids) * h, 2 * h
    else:
        fc_in, qkv_in = 2 * h, h
    shapes = {
        "fc.weight": (h, fc_in),
        "layers.0.self_attn.q_proj.weight": (q, qkv_in),
        "layers.0.self_attn.k_proj.weight": (kv, qkv_in),
        "layers.0.self_attn.v_proj.weight": (kv, qkv_in),
        "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.mlp.gate_proj.weight": (i, h),
        "layers.0.mlp.up_proj.weight": (i, h),
        "layers.0.mlp.down_proj.weight": (h, i),
    }
    norms = ["layers.0.post_attention_layernorm.weight"]
    if kind == "eagle3":
        shapes["lm_head.weight"] = (config.vocab_size, h)
        norms += ["layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight",
                  "norm.weight"]
    weights = {name: torch.randn(shape, generator=generator) * std
               for name, shape in shapes.items()}
    weights.update({name: torch.ones(h) for name in norms})
    return weights


def _rms_norm(x, weight, eps: float):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def eagle_head_forward(weights: dict, config, kind: str, embeds, target_hidden, positions,
                       target_lm_head=None, steps: int = 1):
    """The head's draft steps as vLLM computes them, in plain torch.

    Query ``t`` stands for a first draft pass ending at target position
    ``positions[t]``; step j (1-based) of it drafts at ``positions[t] + j - 1``.

    ``embeds`` [B, T + steps - 1, H]: the target's embeddings of the input
    tokens, step j of query t reading ``embeds[:, t + j - 1]`` (vLLM shifts the
    input ids by one: step 1 at position p reads token p+1). ``target_hidden``
    [B, T, H] (EAGLE-1: the target's final, normed hidden states) or
    [B, T, n_aux * H] (EAGLE-3: the aux residual streams, in layer order);
    ``positions`` [T]. Step 1 uses the target's states (EAGLE-3: through
    ``fc``, ``combine_hidden_states``) and attends causally to step-1 keys;
    step j > 1 takes the head's previous un-normed output as hidden state and
    attends to the step-1 keys up to t plus its own earlier steps' keys at t,
    as vLLM's KV cache holds them while drafting (training-time test).
    Returns (per-step logits [B, T, V], the last step's un-normed output).
    ``target_lm_head``: the target's lm_head weight (EAGLE-1 shares it).
    """
    import torch
    import torch.nn.functional as F

    w = weights
    eps = config.rms_norm_eps
    p = "layers.0."
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    b, t = target_hidden.shape[:2]
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    keys, values, diag_keys, diag_values = None, None, [], []
    all_logits = []
    hidden = target_hidden
    if kind == "eagle3":
        hidden = target_hidden @ w["fc.weight"].T  # combine_hidden_states
    for step in range(steps):
        emb = embeds[:, step : step + t]
        if kind == "eagle3":
            residual = hidden
            h = torch.cat([_rms_norm(emb, w[p + "input_layernorm.weight"], eps),
                           _rms_norm(hidden, w[p + "hidden_norm.weight"], eps)], dim=-1)
        else:
            residual = h = torch.cat([emb, hidden], dim=-1) @ w["fc.weight"].T
            # (input_layernorm is Identity)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(b, t, nh, hd).transpose(1, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(b, t, nkv, hd).transpose(1, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(b, t, nkv, hd).transpose(1, 2)
        # Neox-style rotary, as vLLM's and HF's Llama.
        freqs = (positions + step).float()[:, None] * inv_freq[None, :]
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

        def rotate(u):
            u1, u2 = u[..., : hd // 2], u[..., hd // 2 :]
            return u * cos + torch.cat([-u2, u1], dim=-1) * sin

        q = rotate(q)
        k = rotate(k).repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        if step == 0:
            keys, values = k, v
        else:
            diag_keys.append(k)
            diag_values.append(v)
        scores = (q @ keys.transpose(-1, -2)).masked_fill(~causal, float("-inf"))
        diag = [(q * dk).sum(-1, keepdim=True) for dk in diag_keys]
        probs = torch.cat([scores, *diag], dim=-1).mul(hd**-0.5).softmax(-1)
        a = probs[..., :t] @ values
        for i, dv in enumerate(diag_values):
            a = a + probs[..., t + i : t + i + 1] * dv
        a = a.transpose(1, 2).reshape(b, t, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        residual = a + residual
        m = _rms_norm(residual, w[p + "post_attention_layernorm.weight"], eps)
        m = (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
             ) @ w[p + "mlp.down_proj.weight"].T
        hidden = m + residual
        if kind == "eagle3":
            all_logits.append(_rms_norm(hidden, w["norm.weight"], eps) @ w["lm_head.weight"].T)
        else:
            all_logits.append(hidden @ target_lm_head.T)  # no final norm in EAGLE-1
    return all_logits, hidden


def eagle_target_states(target, kind: str, input_ids):
    """What vLLM feeds an EAGLE head from an HF target run on ``input_ids``
    [B, T]: (target hidden states per position, the target's greedy next
    token per position)."""
    import torch

    out = target.model(input_ids=input_ids, output_hidden_states=True)
    final = out.last_hidden_state  # after the final norm
    if kind == "eagle3":
        # hidden_states[i] (i < L) is the residual stream after i layers,
        # vLLM's aux id i. (transformers 5 puts the normed state at [L].)
        ids = eagle3_aux_layer_ids(target.config.num_hidden_layers)
        hidden = torch.cat([out.hidden_states[i] for i in ids], dim=-1)
    else:
        hidden = final
    return hidden, target.lm_head(final).argmax(-1)


def _save_eagle_head(out: Path, config, weights: dict, source: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    config.save_pretrained(out)
    save_file({k: v.detach().contiguous() for k, v in weights.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(source).save_pretrained(out)


def build_eagle_head(spec: TinyModelSpec, kind: str, window: int | None = None, seed: int = 0,
                     source: Path | None = None) -> Path:
    """Build (once) a random-weight one-layer EAGLE head (``kind`` "eagle" or
    "eagle3") for the target ``source`` (default ``build_model(spec)``), of
    the target's hidden size; ``window`` is its max_position_embeddings
    (default the target's)."""
    source = Path(source) if source is not None else build_model(spec)
    payload = {**asdict(spec), "eagle": kind, "window": window, "head_seed": seed,
               "source": str(source)}
    target = cache_root() / f"{kind}-head-{_key(payload)}"

    def build(out: Path) -> None:
        import torch

        config = _eagle_head_config(source, kind, window)
        weights = _eagle_head_weights(config, kind, torch.Generator().manual_seed(seed))
        _save_eagle_head(out, config, weights, source)

    return _atomic_build(target, build)


def build_trained_eagle_head(spec_or_target_dir: TinyModelSpec | Path, kind: str = "eagle3",
                             window: int = 512, steps: int = 200, seed: int = 0,
                             ttt: int = 3) -> Path:
    """Build (once) an EAGLE head trained to imitate a tiny target's greedy
    next tokens, with plain torch on CPU.

    Data: sequences of ``min(window, 512)`` tokens, half cut from the Austen corpus, half
    a corpus prefix followed by the target's own greedy continuation (what
    the head sees when drafting). Per position the head gets what vLLM feeds
    it (next token's embedding, the target's hidden states at the current
    position) and learns the target's argmax at the next position; with
    ``ttt`` > 1 (training-time test) also the next ``ttt - 1`` draft steps,
    fed its own outputs as vLLM does when drafting. The embeddings are the
    target's; an EAGLE-3 head's lm_head and final norm start from the
    target's. Pass the damped-attention target
    (``build_damped_attention_copy(TARGET_LLAMA, 0.05)``) for a head that
    predicts well on long inputs. Training runs in a subprocess on two
    threads (4.8 min for 200 steps at ttt 3 on a 2-core AVX2 machine, batch
    accuracy 0.60 / 0.58 / 0.57 per draft step; fewer steps: see README),
    unless ``tests/fixtures`` holds a head trained the same way for this very
    target (``committed_head``).
    """
    if isinstance(spec_or_target_dir, TinyModelSpec):
        source = build_model(spec_or_target_dir)
    else:
        source = Path(spec_or_target_dir)
    payload = {"source": str(source), "eagle": kind, "window": window, "steps": steps,
               "head_seed": seed, "ttt": ttt, "trained": TRAINED_HEAD_VERSION}
    target = cache_root() / f"{kind}-trained-{_key(payload)}"

    def build(out: Path) -> None:
        fixture = committed_head(source, kind, window, steps, seed, ttt)
        if fixture is not None:
            from transformers import AutoTokenizer

            for name in _HEAD_FILES:
                shutil.copy2(fixture / name, out / name)
            AutoTokenizer.from_pretrained(source).save_pretrained(out)
            return
        if _fixture_dir(kind, window, steps, seed, ttt).is_dir():
            print(f"training the EAGLE head: its committed copy was trained for another "
                  f"tiny target than {source} or by another version of the training",
                  file=sys.stderr)
        _train_in_subprocess(source, kind, window, steps, seed, ttt, out)

    return _atomic_build(target, build)


def _train_in_subprocess(source: Path, kind: str, window: int, steps: int, seed: int, ttt: int,
                         out: Path) -> None:
    # A process of its own, on at most two threads (while it trains, the
    # test process waits): once a vLLM CPU worker has run in this process,
    # torch.set_num_threads is a no-op here, and its spinning threads make
    # these tiny ops up to ~100x slower.
    env = {**os.environ, "OMP_NUM_THREADS": str(TRAINING_THREADS),
           "PYTHONPATH": os.pathsep.join(
               [str(REPO_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    args = json.dumps([str(source), kind, window, steps, seed, ttt, str(out)])
    subprocess.run(
        [sys.executable, "-c",
         "import json, sys; from tests.eagle_heads import _train_eagle_head; "
         "_train_eagle_head(*json.loads(sys.argv[1]))", args],
        check=True, env=env, cwd=REPO_ROOT)


def model_digest(model_dir: Path) -> str:
    """sha256 of a model folder's tensors (names, dtypes, shapes, bytes) and
    tokenizer: equal digests, equal model."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in sorted(weights.keys()):
                tensor = weights.get_tensor(name).contiguous()
                digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
                digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    digest.update((Path(model_dir) / "tokenizer.json").read_bytes())
    return digest.hexdigest()


def _fixture_dir(kind: str, window: int, steps: int, seed: int, ttt: int) -> Path:
    return HEAD_FIXTURES / f"{kind}-head-w{window}-steps{steps}-ttt{ttt}-seed{seed}"


def committed_head(source: Path, kind: str, window: int, steps: int, seed: int,
                   ttt: int) -> Path | None:
    """The committed head trained with these settings for exactly the target
    at ``source``, or None (no fixture, another training version, or another
    target: a tiny target built differently on this machine)."""
    fixture = _fixture_dir(kind, window, steps, seed, ttt)
    try:
        trained_for = json.loads((fixture / "trained_for.json").read_text())
    except FileNotFoundError:
        return None
    if (trained_for["trained"] != TRAINED_HEAD_VERSION
            or trained_for["target_digest"] != model_digest(source)):
        return None
    return fixture


def write_committed_head(source: Path, kind: str = "eagle3", window: int = 512,
                         steps: int = 200, seed: int = 0, ttt: int = 3) -> Path:
    """Train a head for ``source`` and store it as the committed fixture
    (``python -m tests.eagle_heads`` does it for the suite's head)."""
    fixture = _fixture_dir(kind, window, steps, seed, ttt)
    with tempfile.TemporaryDirectory() as tmp:
        _train_in_subprocess(Path(source), kind, window, steps, seed, ttt, Path(tmp))
        fixture.mkdir(parents=True, exist_ok=True)
        for name in _HEAD_FILES:
            shutil.copy2(Path(tmp) / name, fixture / name)
    (fixture / "trained_for.json").write_text(json.dumps(
        {"target_digest": model_digest(source), "trained": TRAINED_HEAD_VERSION}, indent=2))
    return fixture


def _train_eagle_head(source: str, kind: str, window: int, steps: int, seed: int, ttt: int,
                      out: str) -> None:
    """``build_trained_eagle_head``'s training, in a process of its own."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if steps < 1:
        raise ValueError("steps must be >= 1")
    torch.set_num_threads(TRAINING_THREADS)
    source, out = Path(source), Path(out)
    started = time.monotonic()
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    config = _eagle_head_config(source, kind, window)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    embed = model.model.embed_tokens.weight
    lm_head = model.lm_head.weight

    weights = _eagle_head_weights(config, kind, generator)
    for name, value in weights.items():
        if name.endswith(("proj.weight", "fc.weight")):
            value.mul_(0.02 / config.initializer_range)
    if kind == "eagle3":
        weights["lm_head.weight"] = lm_head.detach().clone()
        weights["norm.weight"] = model.model.norm.weight.detach().clone()
    for value in weights.values():
        value.requires_grad_(True)

    tokenizer = AutoTokenizer.from_pretrained(source)
    corpus = torch.tensor(tokenizer(corpus_text())["input_ids"], dtype=torch.long)
    seq_len = min(window, 512)  # short texts, inside the head's window
    batch_size = 8

    def corpus_batch(n: int):
        starts = torch.randint(0, len(corpus) - seq_len, (n,), generator=generator)
        return torch.stack([corpus[s : s + seq_len] for s in starts.tolist()])

    @torch.no_grad()
    def greedy_continue(ids, length: int):
        out_ = model(input_ids=ids, use_cache=True)
        past, seqs = out_.past_key_values, [ids]
        nxt = out_.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(length - ids.shape[1]):
            seqs.append(nxt)
            out_ = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past, nxt = out_.past_key_values, out_.logits[:, -1].argmax(-1, keepdim=True)
        return torch.cat(seqs, dim=1)[:, :length]

    # Pool of target continuations of corpus prefixes (32 .. seq_len/2 tokens).
    pool = []
    for _ in range(max(1, min(128, steps // 2) // 32)):
        prefix = int(torch.randint(32, seq_len // 2 + 1, (1,), generator=generator))
        pool.append(greedy_continue(corpus_batch(32)[:, :prefix], seq_len))
    pool = torch.cat(pool)

    optimizer = torch.optim.AdamW(list(weights.values()), lr=1e-2, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    queries = seq_len - ttt
    positions = torch.arange(queries)
    recent = []  # per-step batch accuracies of the last 20 steps
    for _ in tqdm(range(steps), desc=f"training a tiny {kind} head (~5 min, cached)",
                  unit="step"):
        picks = torch.randint(0, len(pool), (batch_size // 2,), generator=generator)
        ids = torch.cat([corpus_batch(batch_size - len(picks)), pool[picks]])
        with torch.no_grad():
            hidden, labels = eagle_target_states(model, kind, ids)
        # Query t: the target's state at t; draft step j reads token t+j and
        # learns the target's argmax after token t+j.
        logits, _ = eagle_head_forward(
            weights, config, kind, torch.nn.functional.embedding(ids[:, 1:], embed),
            hidden[:, :queries], positions, target_lm_head=lm_head, steps=ttt)
        loss = sum(
            0.8**j * torch.nn.functional.cross_entropy(
                step_logits.reshape(-1, step_logits.shape[-1]),
                labels[:, j + 1 : j + 1 + queries].reshape(-1))
            for j, step_logits in enumerate(logits))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(weights.values()), 1.0)
        optimizer.step()
        schedule.step()
        recent = [*recent[-19:], [
            (step_logits.argmax(-1) == labels[:, j + 1 : j + 1 + queries]).float().mean().item()
            for j, step_logits in enumerate(logits)]]
    _save_eagle_head(out, config, weights, source)
    (out / "eagle_training.json").write_text(json.dumps({
        "steps": steps, "batch_size": batch_size, "seq_len": seq_len,
        "ttt": ttt, "final_loss": loss.item(),
        "accuracy_last_20_steps": [round(sum(a) / len(a), 4) for a in zip(*recent)],
        "seconds": round(time.monotonic() - started, 1)}, indent=2))


if __name__ == "__main__":
    # Retrain the suite's committed head (after a change to the tiny target or
    # to the training): python -m tests.eagle_heads
    from tests.tiny_models import TARGET_LLAMA, build_damped_attention_copy

    print(write_committed_head(build_damped_attention_copy(TARGET_LLAMA, 0.05)))
