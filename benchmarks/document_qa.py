"""Document QA: several questions on one long document, drafted by cmr at
compact positions, with and without prefix caching (private layouts, and in
place), against each question asked alone.

    python -m benchmarks --document-qa [--lengths 8192] [--concurrency 4]

The document is ``--lengths[0]`` tokens of the corpus, followed by
questions of different lengths; where their layouts differ on a shared
document block (lengths more than a KV block apart, or different retrieved
chunks), laying out in place lets one request draft over another's keys.
Configurations:

- ``alone``: prefix caching, the document cached by a first request, then
  each question alone (nothing else running);
- ``private``: the same engine, all questions at once (private layouts);
- ``in_place``: a prefix-caching engine with ``private_layouts`` off;
- ``unshared``: all questions at once without prefix caching (nothing shared).

The target alone (prefix caching, all questions at once) gives the tokens
every configuration must repeat.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.corpus import load_corpus
from benchmarks.machine import machine_info
from benchmarks.report import args_record, config_color, pyplot, save_figure
from benchmarks.runs import engine_kwargs, started_engine

QUESTIONS = (
    " Question: who speaks last?",
    " Question: where does the passage take place, and who is there at the time?",
    " Question: what does the first person mentioned in the passage want, and what"
    " stands in the way of it? Answer in two sentences, naming the people involved.",
    " Question: summarize the passage in three sentences. Mention every name that"
    " appears in it, say what each of them does, and say how the passage ends, in"
    " the words of the narrator where you can, without adding anything the passage"
    " does not say.",
)
CONFIGS = ("alone", "private", "in_place", "unshared")


def document_questions(tokenizer, text: str, length: int, count: int,
                       offset: int) -> tuple[list[int], list[list[int]]]:
    """A plain-text document of ``length`` tokens and ``count`` prompts:
    the document followed by each question."""
    document = tokenizer(text[offset:offset + 8 * length + 10_000],
                         add_special_tokens=False)["input_ids"][:length]
    questions = [tokenizer(QUESTIONS[i % len(QUESTIONS)] + " Answer:",
                           add_special_tokens=False)["input_ids"] for i in range(count)]
    return document, [document + q for q in questions]


def run_document_qa(args, engines: tuple[str, ...] = ("private", "in_place", "unshared",
                                                     "target")) -> dict[str, Any]:
    """``engines``: ``private`` also runs ``alone`` (the same engine, one
    question at a time); ``target`` is the target alone."""
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    document, prompts = document_questions(
        tokenizer, load_corpus(args.corpus), args.lengths[0], args.concurrency, args.offset)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    base = {**(json.loads(args.spec_extend) if args.spec_extend else {}), "mode": "cmr"}

    def generate(llm, batch: list[list[int]]) -> list[dict[str, Any]]:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                               use_tqdm=False)
        return [request_row(o.outputs[0]) for o in outputs]

    runs: dict[str, list[dict[str, Any]]] = {}
    with tqdm(total=len(engines), desc="document QA", unit="engine") as progress:
        for name in engines:
            progress.set_postfix_str(name)
            prefix_caching = name != "unshared"
            spec_extend = None if name == "target" else {
                **base, "private_layouts": name != "in_place"}
            kwargs = engine_kwargs(args, name if name == "target" else "cmr", spec_extend) | {
                "max_model_len": len(max(prompts, key=len)) + args.max_tokens + 64,
                "max_num_seqs": len(prompts), "enable_prefix_caching": prefix_caching}
            if name != "target":
                kwargs["per_request_spec_decode_metrics"] = "detailed"
            with started_engine(**kwargs) as llm:
                if prefix_caching:
                    generate(llm, [document])  # caches the document
                if name == "private":
                    runs["alone"] = [generate(llm, [p])[0] for p in prompts]
                runs[name] = generate(llm, prompts)
            progress.update(1)
    return {"machine": machine_info(), "args": args_record(args),
            "document_tokens": len(document),
            "question_tokens": [len(p) - len(document) for p in prompts],
            "runs": runs}


def request_row(output) -> dict[str, Any]:
    metrics = output.spec_decode_metrics
    if metrics is None:  # the target alone
        return {"token_ids": list(output.token_ids)}
    accepted = sum(j * count for j, count in enumerate(metrics.histogram))
    return {"token_ids": list(output.token_ids), "drafted": metrics.num_draft_tokens,
            "accepted": accepted,
            "acceptance": accepted / metrics.num_draft_tokens if metrics.num_draft_tokens
            else None}


def document_qa_table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    alone = runs["alone"]
    reference = runs.get("target", alone)
    lines = ["| question (tokens) | " + " | ".join(CONFIGS)
             + f" | same tokens as {'the target alone' if 'target' in runs else 'alone'} |",
             "|---|" + "---:|" * (len(CONFIGS) + 1)]
    for i, tokens in enumerate(result["question_tokens"]):
        cells = []
        for config in CONFIGS:
            row = runs[config][i]
            ratio = (row["acceptance"] / alone[i]["acceptance"]
                     if row["acceptance"] is not None and alone[i]["acceptance"] else None)
            cells.append(f"{100 * (row['acceptance'] or 0):.1f}%"
                         + ("" if config == "alone" or ratio is None else f" ({ratio:.2f}x)"))
        same = all(runs[c][i]["token_ids"] == reference[i]["token_ids"] for c in CONFIGS)
        lines.append(f"| {i + 1} ({tokens}) | " + " | ".join(cells) + f" | {same} |")
    return "\n".join(lines)


def write_document_qa(result: dict[str, Any], out_dir: Path, title: str) -> str:
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "document_qa.json").write_text(json.dumps(result, indent=2))
    table = document_qa_table(result)
    (out_dir / "document_qa.md").write_text(
        f"# Document QA, {result['document_tokens']}-token document: draft acceptance per "
        f"question\n\n{title}\n\n{table}\n")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    questions = range(len(result["question_tokens"]))
    width = 0.8 / len(CONFIGS)
    for j, config in enumerate(CONFIGS):
        ax.bar([q + j * width for q in questions],
               [result["runs"][config][q]["acceptance"] or 0 for q in questions],
               width, label=config, color=config_color(config))
    ax.set_xticks([q + 0.4 - width / 2 for q in questions],
                  [f"question {q + 1}" for q in questions])
    ax.set_ylabel("draft acceptance")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    save_figure(fig, out_dir / "document_qa.png", title)
    return table
