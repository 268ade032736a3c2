"""Query a `vllm serve` running SpecExtend (examples/serve.sh): a completion on
a long prompt, a streamed chat, then SpecExtend's metrics.

    python examples/openai_client.py [--base-url http://127.0.0.1:8000] [--model qwen-coder]

Needs the `openai` package. SpecExtend's metrics on /metrics refresh whenever
vLLM logs its stats (VLLM_LOG_STATS_INTERVAL, default 10 s).
"""

import argparse
import urllib.request

from openai import OpenAI


def long_prompt(records: int) -> str:
    """A made-up list of records and a question about one of them."""
    lines = [f"Record {i}: the code of item {i} is {(i * 7919) % 100000:05d}."
             for i in range(records)]
    return "\n".join(lines) + f"\n\nWhat is the code of item {records // 3}? Answer with the code."


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server")
    parser.add_argument("--model", default="qwen-coder", help="its --served-model-name")
    parser.add_argument("--records", type=int, default=600,
                        help="lines of the long prompt (about 20 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    args = parser.parse_args(argv)

    client = OpenAI(base_url=f"{args.base_url}/v1", api_key="unused")
    completion = client.completions.create(model=args.model, prompt=long_prompt(args.records),
                                           max_tokens=args.max_tokens, temperature=0)
    print(f"completion: {completion.choices[0].text!r}")

    stream = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": "Write a Python function that reverses a string."}],
        max_tokens=args.max_tokens, temperature=0, stream=True)
    print("chat: ", end="")
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()

    metrics = urllib.request.urlopen(f"{args.base_url}/metrics").read().decode()
    for line in metrics.splitlines():
        if line.startswith(("vllm:spec_extend_", "vllm:spec_decode_num")) and "_bucket" not in line:
            print(line)


if __name__ == "__main__":
    main()
