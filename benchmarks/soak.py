"""A served soak: ``vllm serve`` with cmr and compact positions under a mixed
load for a fixed time, with the faults a server meets.

    python -m benchmarks --soak [--soak-minutes 30] [--concurrency 8]

``--concurrency`` clients send, until the time is up, one request of every
kind, then a seeded mix of them: long (``--lengths``) and short prompts,
questions on a few repeated documents (prefix-cache hits), streams the client
drops mid-way, prompts longer than max_model_len, malformed JSON and invalid
sampling parameters. Every 10 s it records the server's RSS (all its
processes) and vLLM's KV cache usage. Then every completed greedy request is
sent again alone (shortest first, for at most ``--soak-replay-minutes``), and
its text must equal the text it got under load (float32 by default: in
bfloat16 batched and solo numerics differ, with or without speculation).
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests

from benchmarks.corpus import load_corpus
from benchmarks.machine import machine_info
from benchmarks.report import args_record, pyplot, save_figure
from benchmarks.serve import SERVED_NAME, free_port, running_server, server_command

# Request kinds and their share of the load.
SOAK_MIX = {
    "long": 3, "short": 4, "repeated_document": 4, "disconnect": 2,
    "too_long": 1, "malformed_json": 1, "bad_sampling": 1,
}
BAD_KINDS = ("too_long", "malformed_json", "bad_sampling")
GREEDY_KINDS = ("long", "short", "repeated_document")
SAMPLE_PERIOD_S = 10.0
REPEATED_DOCUMENTS = 2
QUESTIONS = (
    " Question: who is speaking in the last paragraph? Answer:",
    " Question: where does the passage take place? Answer:",
    " Question: what does the first person mentioned want? Answer:",
    " Question: summarize the passage in one sentence. Answer:",
    " Question: which names appear most often? Answer:",
)
# What vLLM rejects in a completion request's sampling parameters.
BAD_SAMPLING = ({"temperature": -1.0}, {"top_p": 1.5}, {"max_tokens": -3}, {"n": 0})


@dataclass
class SoakRequest:
    kind: str
    prompt_key: str | None = None
    status: int | None = None
    """HTTP status; None: the client dropped the stream or the connection failed."""
    text: str | None = None
    error: str | None = None
    start_s: float = 0.0
    end_s: float = 0.0

    @property
    def failed(self) -> bool:
        """A 5xx, or the connection failed (a dropped stream may end so too)."""
        return (self.status is not None and self.status >= 500) or (
            self.status is None and self.error is not None)


@dataclass
class SoakSample:
    time_s: float
    rss_gib: float
    kv_cache_usage: float | None
    running: float | None
    waiting: float | None
    preemptions: float | None


@dataclass
class SoakLoad:
    """The seeded prompts of the mix, as token ids."""

    long_prompts: list[list[int]]
    short_prompts: list[list[int]]
    documents: list[list[int]]
    questions: list[list[int]]
    too_long_prompt: list[int]
    prompts: dict[str, list[int]] = field(default_factory=dict)

    def pick(self, kind: str, rng: random.Random) -> tuple[str | None, list[int] | None]:
        if kind in ("long", "disconnect"):
            index = rng.randrange(len(self.long_prompts))
            return self._key(f"long{index}", self.long_prompts[index])
        if kind == "short":
            index = rng.randrange(len(self.short_prompts))
            return self._key(f"short{index}", self.short_prompts[index])
        if kind == "repeated_document":
            doc, question = rng.randrange(len(self.documents)), rng.randrange(len(self.questions))
            return self._key(f"doc{doc}q{question}", self.documents[doc] + self.questions[question])
        if kind == "too_long":
            return None, self.too_long_prompt
        return None, None

    def _key(self, key: str, prompt: list[int]) -> tuple[str, list[int]]:
        self.prompts.setdefault(key, prompt)
        return key, prompt


def soak_load(tokenizer, text: str, lengths: list[int], max_model_len: int,
              seed: int = 0) -> SoakLoad:
    """Plain-text prompts cut from the corpus at seeded offsets (no chat
    template, so any model serves them)."""
    rng = random.Random(seed)

    def passage(num_tokens: int) -> list[int]:
        start = rng.randrange(0, max(1, len(text) - 8 * num_tokens - 10_000))
        ids = tokenizer(text[start:start + 8 * num_tokens + 10_000],
                        add_special_tokens=False)["input_ids"]
        return ids[:num_tokens]

    longest = max(lengths)
    return SoakLoad(
        long_prompts=[passage(rng.choice(lengths)) for _ in range(6)],
        short_prompts=[passage(rng.randrange(100, 500)) for _ in range(6)],
        documents=[passage(longest // 2) for _ in range(REPEATED_DOCUMENTS)],
        questions=[tokenizer(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS],
        too_long_prompt=passage(max_model_len + 64),
    )


class SoakClient:
    """One server's load: request kinds, their outcomes, and the samples."""

    def __init__(self, base: str, load: SoakLoad, max_tokens: int) -> None:
        self.base = base
        self.load = load
        self.max_tokens = max_tokens
        self.records: list[SoakRequest] = []
        self.server_died_s: float | None = None
        """When a failed request found the server gone (the load stops)."""
        self._lock = threading.Lock()

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.base}/health", timeout=30).status_code == 200
        except requests.RequestException:
            return False

    def body(self, prompt: list[int], **extra) -> dict[str, Any]:
        return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": self.max_tokens,
                "temperature": 0, **extra}

    def send(self, kind: str, rng: random.Random, t0: float) -> SoakRequest:
        key, prompt = self.load.pick(kind, rng)
        record = SoakRequest(kind, key, start_s=time.monotonic() - t0)
        url = f"{self.base}/v1/completions"
        try:
            if kind == "malformed_json":
                response = requests.post(url, data=b'{"model": "' + SERVED_NAME.encode()
                                         + b'", "prompt": [1, 2,', timeout=600,
                                         headers={"Content-Type": "application/json"})
            elif kind == "bad_sampling":
                response = requests.post(url, json=self.body(
                    [1, 2, 3], **rng.choice(BAD_SAMPLING)), timeout=600)
            elif kind == "disconnect":
                keep_chunks = rng.randrange(1, 4)
                with requests.post(url, json=self.body(prompt, stream=True), stream=True,
                                   timeout=600) as response:
                    if not response.ok:
                        record.status, record.error = response.status_code, response.text[:300]
                    chunks = 0
                    for line in response.iter_lines():
                        chunks += line.startswith(b"data: ")
                        if chunks >= keep_chunks:
                            break  # the client drops the stream (status stays None)
                response = None
            else:
                response = requests.post(url, json=self.body(prompt), timeout=3600)
            if response is not None:
                record.status = response.status_code
                if response.ok:
                    record.text = response.json()["choices"][0]["text"]
                else:
                    record.error = response.text[:300]
        except requests.RequestException as error:
            record.error = f"{type(error).__name__}: {error}"[:300]
        record.end_s = time.monotonic() - t0
        with self._lock:
            self.records.append(record)
        return record

    def run(self, seconds: float, concurrency: int, seed: int, progress=None) -> None:
        kinds, weights = zip(*SOAK_MIX.items())
        t0 = time.monotonic()
        deadline = t0 + seconds

        def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            # Every kind is sent once first (the workers share them out),
            # then the mix picks at random.
            first = list(kinds[index::concurrency])
            while time.monotonic() < deadline and self.server_died_s is None:
                kind = first.pop(0) if first else rng.choices(kinds, weights)[0]
                record = self.send(kind, rng, t0)
                if record.failed and not self.healthy():
                    self.server_died_s = self.server_died_s or record.end_s
                if progress is not None:
                    progress.update(1)

        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(worker, range(concurrency)))

    def replay_alone(self, progress=None, seconds: float | None = None) -> dict[str, bool]:
        """Each distinct completed greedy request once more, alone, shortest
        prompt first, for at most ``seconds``: does its text equal every
        text it got under load?"""
        texts: dict[str, set[str]] = {}
        for record in self.records:
            if record.kind in GREEDY_KINDS and record.status == 200:
                texts.setdefault(record.prompt_key, set()).add(record.text)
        deadline = None if seconds is None else time.monotonic() + seconds
        equal = {}
        for key in sorted(texts, key=lambda k: len(self.load.prompts[k])):
            if deadline is not None and time.monotonic() > deadline:
                break
            seen = texts[key]
            response = requests.post(f"{self.base}/v1/completions",
                                     json=self.body(self.load.prompts[key]), timeout=3600)
            response.raise_for_status()
            equal[key] = seen == {response.json()["choices"][0]["text"]}
            if progress is not None:
                progress.update(1)
        return equal


def server_processes_rss_gib(pid: int) -> float:
    import psutil

    process = psutil.Process(pid)
    total = 0
    for p in [process, *process.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**30


def metric_values(base: str) -> dict[str, float]:
    """Sums over labels of each sample on /metrics."""
    values: dict[str, float] = {}
    for line in requests.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[-1])
    return values


def sample_server(base: str, pid: int, t0: float) -> SoakSample:
    metrics = metric_values(base)
    return SoakSample(
        time_s=time.monotonic() - t0,
        rss_gib=server_processes_rss_gib(pid),
        kv_cache_usage=metrics.get("vllm:kv_cache_usage_perc"),
        running=metrics.get("vllm:num_requests_running"),
        waiting=metrics.get("vllm:num_requests_waiting"),
        preemptions=metrics.get("vllm:num_preemptions_total"),
    )


def run_soak(args) -> dict[str, Any]:
    """Serve cmr + compact positions, load it for ``args.soak_minutes``, then
    replay every completed greedy request alone."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    max_model_len = max(args.lengths) + args.soak_tokens + 256
    load = soak_load(tokenizer, load_corpus(args.corpus), args.lengths, max_model_len)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = server_command(args, "cmr", port, max_model_len)
    with running_server(command, port, out_dir / "server.log") as (base, log):
        pid = _listening_server_pid(command, port)
        client = SoakClient(base, load, args.soak_tokens)
        samples: list[SoakSample] = []
        stop = threading.Event()
        t0 = time.monotonic()

        def monitor() -> None:
            while not stop.is_set():
                try:
                    samples.append(sample_server(base, pid, t0))
                except requests.RequestException:
                    pass  # the request records tell whether the server answered
                stop.wait(SAMPLE_PERIOD_S)

        sampler = threading.Thread(target=monitor, daemon=True)
        sampler.start()
        with tqdm(desc=f"soak ({args.soak_minutes:g} min)", unit="request") as progress:
            client.run(args.soak_minutes * 60, args.concurrency, seed=0, progress=progress)
        stop.set()
        sampler.join()
        completed = {r.prompt_key for r in client.records
                     if r.kind in GREEDY_KINDS and r.status == 200}
        alive = client.healthy()
        equal_alone, final_metrics = {}, {}
        if alive:
            samples.append(sample_server(base, pid, t0))
            replay_s = (None if args.soak_replay_minutes is None
                        else args.soak_replay_minutes * 60)
            with tqdm(total=len(completed), desc="replay alone", unit="request") as progress:
                equal_alone = client.replay_alone(progress, replay_s)
            final_metrics = {name: value for name, value in metric_values(base).items()
                             if name.startswith(("vllm:spec_extend_", "vllm:spec_decode_",
                                                 "vllm:num_preemptions"))}
        log.seek(0)
        server_errors = [line for line in log.read().splitlines()
                         if "Traceback" in line or "EngineDeadError" in line]
    return {
        "machine": machine_info(),
        "args": args_record(args),
        "max_model_len": max_model_len,
        "records": [asdict(r) for r in client.records],
        "samples": [asdict(s) for s in samples],
        "equal_alone": equal_alone,
        "server_alive": alive,
        "server_died_s": client.server_died_s,
        "final_metrics": final_metrics,
        "server_log_errors": server_errors[:20],
        "summary": {**soak_summary(client.records, samples, equal_alone),
                    "distinct_completed": len(completed)},
    }


def _listening_server_pid(command: list[str], port: int) -> int:
    """The ``vllm serve`` process listening on ``port``."""
    import psutil

    for process in psutil.process_iter(["cmdline"]):
        line = process.info["cmdline"] or []
        if "serve" in line and "--port" in line and line[line.index("--port") + 1] == str(port):
            return process.pid
    raise RuntimeError(f"no server process for port {port}: {command}")


def soak_summary(records: list[SoakRequest], samples: list[SoakSample],
                 equal_alone: dict[str, bool]) -> dict[str, Any]:
    """Per kind: sent, completed, refused (4xx), failed (anything else);
    memory after warm-up against the end; the replays."""
    kinds = {}
    for kind in SOAK_MIX:
        mine = [r for r in records if r.kind == kind]
        # A dropped stream ends after 1-3 chunks, or at the client's read
        # timeout when no chunk came in time (queued behind long prefills).
        dropped = [r.status is None and (r.error is None or kind == "disconnect")
                   for r in mine]
        kinds[kind] = {
            "sent": len(mine),
            "completed": sum(r.status == 200 for r in mine),
            "refused_4xx": sum(r.status is not None and 400 <= r.status < 500 for r in mine),
            "dropped_by_client": sum(dropped),
            "failed": sum(r.failed and not d for r, d in zip(mine, dropped)),
        }
    # Warm-up: the first quarter of the samples (every prompt kind has run).
    warm = samples[len(samples) // 4:] if len(samples) >= 4 else samples
    rss = [s.rss_gib for s in warm]
    kv = [s.kv_cache_usage for s in samples if s.kv_cache_usage is not None]
    good_failed = sum(kinds[k]["failed"] + kinds[k]["refused_4xx"]
                      for k in SOAK_MIX if k not in BAD_KINDS)
    bad_not_refused = sum(kinds[k]["sent"] - kinds[k]["refused_4xx"] for k in BAD_KINDS)
    return {
        "kinds": kinds,
        "good_requests_failed": good_failed,
        "bad_requests_not_refused": bad_not_refused,
        "rss_gib_after_warm_up": rss[0] if rss else None,
        "rss_gib_end": rss[-1] if rss else None,
        "rss_gib_max_after_warm_up": max(rss) if rss else None,
        "kv_cache_usage_max": max(kv) if kv else None,
        "replayed": len(equal_alone),
        "replays_equal": sum(equal_alone.values()),
    }


def soak_table(summary: dict[str, Any]) -> str:
    lines = ["| request kind | sent | completed | refused (4xx) | dropped by client | failed |",
             "|---|---:|---:|---:|---:|---:|"]
    for kind, row in summary["kinds"].items():
        lines.append(f"| {kind} | {row['sent']} | {row['completed']} | {row['refused_4xx']} | "
                     f"{row['dropped_by_client']} | {row['failed']} |")
    return "\n".join(lines)


def write_soak(result: dict[str, Any], out_dir: Path, title: str) -> str:
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = result["summary"]
    metrics = result["final_metrics"]
    (out_dir / "soak.json").write_text(json.dumps(result, indent=2))
    report = "\n".join([
        soak_table(summary), "",
        f"- good requests that failed: {summary['good_requests_failed']}; bad requests "
        f"not refused with a 4xx: {summary['bad_requests_not_refused']}",
        f"- server RSS after warm-up {summary['rss_gib_after_warm_up']:.2f} GiB, at the end "
        f"{summary['rss_gib_end']:.2f} GiB, highest after warm-up "
        f"{summary['rss_gib_max_after_warm_up']:.2f} GiB",
        f"- KV cache usage at most {100 * (summary['kv_cache_usage_max'] or 0):.0f}%",
        f"- replayed alone (shortest first, within the replay time): "
        f"{summary['replays_equal']} of {summary['replayed']} gave the same text "
        f"({summary['distinct_completed']} distinct greedy prompts completed)",
        f"- server alive at the end: {result['server_alive']}; tracebacks in its log: "
        f"{len(result['server_log_errors'])}",
        f"- preemptions: {metrics.get('vllm:num_preemptions_total', 0):.0f}; retrievals: "
        f"{metrics.get('vllm:spec_extend_retrievals_total', 0):.0f}; private layout areas: "
        f"{metrics.get('vllm:spec_extend_private_layout_areas', 0):.0f}, requests laid out in "
        f"place: {metrics.get('vllm:spec_extend_layouts_in_place_total', 0):.0f}",
    ])
    (out_dir / "soak.md").write_text(f"# Served soak: {title}\n\n{report}\n")
    samples = result["samples"]
    minutes = [s["time_s"] / 60 for s in samples]
    fig, (memory, kv) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    memory.plot(minutes, [s["rss_gib"] for s in samples], color="tab:blue", label="server RSS")
    memory.set_ylabel("GiB")
    memory.legend()
    kv.plot(minutes, [100 * (s["kv_cache_usage"] or 0) for s in samples], color="tab:red",
            label="KV cache usage")
    kv.plot(minutes, [s["running"] or 0 for s in samples], color="tab:green",
            label="running requests")
    kv.set_xlabel("minutes")
    kv.set_ylabel("% / requests")
    kv.legend()
    for ax in (memory, kv):
        ax.grid(alpha=0.3)
    save_figure(fig, out_dir / "soak.png", title)
    return report
