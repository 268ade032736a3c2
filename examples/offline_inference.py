"""Offline inference with SpecExtend: a short and a long prompt through LLM.generate.

    python examples/offline_inference.py                        # Qwen2.5-Coder 1.5B + 0.5B draft
    python examples/offline_inference.py --goodput              # with goodput control
    python examples/offline_inference.py --method eagle3 --draft HEAD --num-speculative-tokens 3

Needs vLLM and vllm-specextend installed; the models come from the Hugging Face
Hub or a local path. Prints each answer, then SpecExtend's and vLLM's
speculative-decoding counters.
"""

import argparse
import json

from vllm import LLM, SamplingParams


def long_prompt(records: int) -> str:
    """A made-up list of records and a question about one of them."""
    lines = [f"Record {i}: the code of item {i} is {(i * 7919) % 100000:05d}."
             for i in range(records)]
    return "\n".join(lines) + f"\n\nWhat is the code of item {records // 3}? Answer with the code."


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--target", default="Qwen/Qwen2.5-Coder-1.5B-Instruct",
                        help="target model")
    parser.add_argument("--draft", default="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                        help="draft model, or the EAGLE head with --method eagle/eagle3")
    parser.add_argument("--method", default="draft_model",
                        choices=["draft_model", "eagle", "eagle3"], help="speculative method")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="K")
    parser.add_argument("--spec-extend", default="{}",
                        help="spec_extend options as JSON ({}: the defaults, cmr)")
    parser.add_argument("--goodput", action="store_true",
                        help="add speculation_control: goodput to the options")
    parser.add_argument("--records", type=int, default=600,
                        help="lines of the long prompt (about 20 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--engine-args", default="{}",
                        help="more LLM(...) arguments as JSON, e.g. "
                             '\'{"max_model_len": 16384, "enforce_eager": true}\'')
    args = parser.parse_args(argv)

    spec_extend = json.loads(args.spec_extend)
    if args.goodput:
        spec_extend["speculation_control"] = "goodput"
    llm = LLM(
        model=args.target,
        speculative_config={"method": args.method, "model": args.draft,
                            "num_speculative_tokens": args.num_speculative_tokens},
        additional_config={"spec_extend": spec_extend},
        disable_log_stats=False,  # LLM.get_metrics() needs the stats
        **json.loads(args.engine_args),
    )
    prompts = ["Write a Python function that reverses a string.", long_prompt(args.records)]
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
