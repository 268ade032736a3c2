"""Query the server started by examples/serve.sh: a completion, a streamed
chat, then the retrieval metrics (refreshed every VLLM_LOG_STATS_INTERVAL s).

    .venv/bin/python -m examples.openai_client   # from the repo root
"""

import urllib.request

from openai import OpenAI

from benchmarks.corpus import novel


client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
passage = novel("emma")[10_000:30_000]

completion = client.completions.create(
    model="qwen-coder", prompt="def fibonacci(n):", max_tokens=48, temperature=0
)
print(completion.choices[0].text)

stream = client.chat.completions.create(
    model="qwen-coder",
    messages=[{"role": "user", "content": f"{passage}\n\nSummarize this passage."}],
    max_tokens=96,
    temperature=0,
    stream=True,
)
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()

metrics = urllib.request.urlopen("http://127.0.0.1:8000/metrics").read().decode()
for line in metrics.splitlines():
    if line.startswith(("vllm:spec_extend_", "vllm:spec_decode_num")) and "_bucket" not in line:
        print(line)
