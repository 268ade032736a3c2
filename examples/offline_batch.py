"""Offline batch with SpecExtend: long and short prompts through LLM.generate.

    .venv/bin/python -m examples.offline_batch [--target PATH] [--draft PATH]   # from the repo root

Defaults to the Qwen2.5-Coder 1.5B/0.5B pair (fetched and converted once, see
benchmarks/real_models.py). Prints each output and what retrieval did.
"""

import argparse



def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from benchmarks.corpus import novel as read_novel
    from benchmarks.real_models import resolve_model

    novel = read_novel("persuasion")
    prompts = [
        "Write a Python function that reverses a string.",
        f"{novel[20_000:32_000]}\n\nSummarize the passage above in two sentences.",
        f"{novel[60_000:90_000]}\n\nWho are the main characters in this passage?",
    ]
    llm = LLM(
        model=resolve_model(args.target),
        speculative_config={"method": "draft_model", "model": resolve_model(args.draft),
                            "num_speculative_tokens": 4},
        additional_config={"spec_extend": {"mode": "cmr"}},
        max_model_len=16384,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        kv_cache_memory_bytes=2 << 30,
        disable_log_stats=False,  # LLM.get_metrics() needs stats
    )
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    for output in outputs:
        print(f"--- {len(output.prompt_token_ids)} prompt tokens\n{output.outputs[0].text}\n")
    for metric in llm.get_metrics():
        if metric.name.startswith(("vllm:spec_extend_", "vllm:spec_decode_num")):
            value = getattr(metric, "value", None)
            if value is not None:
                print(f"{metric.name} = {value:g}")


if __name__ == "__main__":
    main()
