"""The EAGLE-3 head recipe (``benchmarks/eagle_head.py``): its pure pieces, and
the whole recipe on the tiny random Qwen2 target, interrupted twice (in the
hidden states, then in training) and resumed, then loaded by vLLM."""

import json

import pytest

from benchmarks.eagle_head import (
    Recipe,
    acceptance_length,
    chat_sample,
    chat_template_pieces,
    compute_kind,
    default_aux_layer_ids,
    plan_budget,
    run_recipe,
    vocab_coverage,
    write_head_results,
)
from tests.tiny_models import TARGET_QWEN2, build_model

WINDOW = 256
DRAFT_VOCAB = 512
TTT = 2


def test_aux_layer_ids_are_distinct_sorted_and_inside_the_target():
    assert default_aux_layer_ids(28) == (2, 14, 25)
    assert default_aux_layer_ids(3) == (0, 1, 2)
    assert default_aux_layer_ids(4) == (0, 1, 2)  # vLLM's default repeats layer 2


def test_compute_kind_from_cpu_flags():
    assert compute_kind(["avx2", "avx512f", "avx512_bf16", "amx_bf16"]) == "amx_bf16"
    assert compute_kind(["avx2", "avx512f", "avx512_bf16"]) == "avx512_bf16"
    assert compute_kind(["avx2", "avx512f"]) == "avx2_fp32"


def test_acceptance_length_from_conditional_accuracies():
    assert acceptance_length([]) == 1.0
    assert acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert acceptance_length([0.5, 0.5]) == pytest.approx(1.75)


def test_budget_fills_the_minutes():
    rates = {"m": {"dtype": "float32", "hidden": 100.0, "train": {1: 300.0, 2: 200.0}}}
    plan = plan_budget(12, "m", ttt_steps=3, epochs=2, rates=rates)
    # 600 s after startup: N / 100 + 2 N / 200 = 600 -> N = 30,000.
    assert plan["data_tokens"] == 30_000
    assert plan["hidden_seconds"] + plan["train_seconds"] == pytest.approx(600)


def test_vocab_coverage():
    assert vocab_coverage({1: 6, 2: 3, 3: 1}, [1, 2, 5]) == {1: 0.6, 2: 0.9, 5: 1.0}


def test_chat_sample_masks_only_the_passage_and_the_answer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_model(TARGET_QWEN2))
    pieces = chat_template_pieces(tokenizer)
    passage, answer = [100, 101, 102], [200, 201]
    ids, mask = chat_sample(tokenizer, pieces, "Continue.", passage, answer)
    assert len(ids) == len(mask)
    assert [i for i, m in zip(ids, mask) if m] == passage + answer
    assert ids[-2:] == answer  # cut before the assistant's end token
    text = tokenizer.decode(ids)
    assert text.startswith("<|user|>Continue.") and "</s><|assistant|>" in text


@pytest.fixture(scope="module")
def interrupted_recipe(tmp_path_factory):
    """The recipe on the tiny Qwen2 target, killed once in the hidden states
    and once in training, each time rerun; returns (head, work, counters)."""
    from benchmarks import eagle_head
    from speculators.train import trainer

    root = tmp_path_factory.mktemp("eagle_head")
    head, work = root / "head", root / "work"
    recipe = Recipe(target=str(build_model(TARGET_QWEN2)), window=WINDOW, ttt_steps=TTT,
                    draft_vocab_size=DRAFT_VOCAB, data_tokens=10 * WINDOW, epochs=1,
                    heldout_fraction=0.2, checkpoint_freq=0.25)
    counters = {"extracted": [], "optimizer_steps": 0}

    class Killed(Exception):
        pass

    real_extractor = eagle_head.HiddenStateExtractor

    def extractor(kill_after=None):
        def factory(*args):
            inner = real_extractor(*args)

            def extract(input_ids):
                if kill_after is not None and len(counters["extracted"]) >= kill_after:
                    raise Killed("hidden states")
                counters["extracted"].append(len(input_ids))
                return inner(input_ids)
            return extract
        return factory

    original_step = trainer.Trainer._optimizers_step

    def step_then_maybe_die(self):
        original_step(self)
        counters["optimizer_steps"] += 1
        if counters.get("kill_at_step") == counters["optimizer_steps"]:
            raise Killed("training")

    mp = pytest.MonkeyPatch()
    mp.setattr(trainer.Trainer, "_optimizers_step", step_then_maybe_die)
    try:
        mp.setattr(eagle_head, "HiddenStateExtractor", extractor(kill_after=3))
        with pytest.raises(Killed, match="hidden states"):
            run_recipe(recipe, head, work)
        counters["first_pass_samples"] = len(counters["extracted"])
        mp.setattr(eagle_head, "HiddenStateExtractor", extractor())
        counters["kill_at_step"] = 6  # after the checkpoint at step 4 of 8
        with pytest.raises(Killed, match="training"):
            run_recipe(recipe, head, work)
        counters["kill_at_step"] = None
        run_recipe(recipe, head, work)
    finally:
        mp.undo()
    return head, work, counters


def test_recipe_resumes_hidden_states_at_the_first_missing_sample(interrupted_recipe):
    _, work, counters = interrupted_recipe
    samples = json.loads((work / "data" / "samples.json").read_text())["samples"]
    assert counters["first_pass_samples"] == 3
    # Every sample extracted exactly once over the three runs.
    assert len(counters["extracted"]) == samples
    assert len(list((work / "data" / "hidden_states").glob("hs_*.safetensors"))) == samples


def test_recipe_resumes_training_from_its_checkpoint(interrupted_recipe):
    head, work, counters = interrupted_recipe
    entries = [json.loads(line) for line in
               (work / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    steps = [e["global_step"] for e in entries if "train" in e]
    # Killed in step 5 (0-based, never logged); the last checkpoint was after 4
    # steps, so the rerun starts at step 4, not 0: only step 4 runs twice.
    assert steps == [0, 1, 2, 3, 4, 4, 5, 6, 7]
    report = json.loads((head / "eagle_head.json").read_text())
    assert [s["step"] for s in report["loss_curve"]] == list(range(8))
    assert report["heldout"] and report["heldout"][-1]["acceptance_length"] >= 1.0
    assert report["times"]["hidden"]["seconds"] > 0 and report["times"]["train"]["seconds"] > 0


def test_recipe_record_as_results(interrupted_recipe, tmp_path):
    head, _, _ = interrupted_recipe
    summary = write_head_results(head, tmp_path)
    report = json.loads((head / "eagle_head.json").read_text())
    assert json.loads((tmp_path / "eagle_head.json").read_text()) == report
    # One row per held-out epoch, with the acceptance length its accuracies imply.
    for val in report["heldout"]:
        assert f"| {val['epoch']} | {val['loss']:.3f} |" in summary
        assert f"{val['acceptance_length']:.2f} |" in summary
    assert (tmp_path / "eagle_head.png").read_bytes().startswith(b"\x89PNG")


def test_head_is_a_speculators_eagle3_checkpoint_vllm_reads(interrupted_recipe):
    from safetensors import safe_open

    head, _, _ = interrupted_recipe
    config = json.loads((head / "config.json").read_text())
    layer = config["transformer_layer_config"]
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["max_position_embeddings"] == WINDOW
    assert layer["layer_types"] == ["full_attention"]
    hidden, vocab = TARGET_QWEN2.hidden_size, TARGET_QWEN2.vocab_size
    with safe_open(head / "model.safetensors", "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        t2d = f.get_tensor("t2d")
    assert shapes["d2t"] == (DRAFT_VOCAB,)
    assert shapes["t2d"] == (vocab,) and int(t2d.sum()) == DRAFT_VOCAB
    assert shapes["lm_head.weight"] == (DRAFT_VOCAB, hidden)
    assert shapes["fc.weight"] == (hidden, 3 * hidden)
    assert "embed_tokens.weight" not in shapes  # vLLM shares the target's


@pytest.mark.engine
def test_vllm_drafts_with_the_head(interrupted_recipe):
    from tests.engine_utils import engine, generate_greedy, spec_decode_counters

    head, _, _ = interrupted_recipe
    with engine(build_model(TARGET_QWEN2), head, k=TTT, method="eagle3",
                max_model_len=1024) as llm:
        outputs = generate_greedy(llm, [list(range(10, 60))], max_tokens=8)
        counters = spec_decode_counters(llm)
    assert len(outputs[0].outputs[0].token_ids) == 8
    assert counters["num_drafts"] > 0
