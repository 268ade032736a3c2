"""Chat prompts of an exact token length, cut from the corpus."""

from __future__ import annotations

SUMMARY_INSTRUCTION = "Summarize the following passage in a few sentences."


def summarization_prompt(tokenizer, text: str, total_tokens: int, offset: int = 0) -> list[int]:
    """A chat prompt of exactly ``total_tokens`` tokens asking for a summary of
    a passage cut from ``text`` at ``offset`` characters."""

    def render(passage_ids: list[int]) -> list[int]:
        passage = tokenizer.decode(passage_ids)
        messages = [{"role": "user", "content": f"{SUMMARY_INSTRUCTION}\n\n{passage}"}]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer(messages[0]["content"] + "\n\nSummary:")["input_ids"]

    chars = text[offset : offset + 8 * total_tokens + 10_000]
    passage_ids = tokenizer(chars, add_special_tokens=False)["input_ids"]
    overhead = len(render(passage_ids[:16])) - 16
    ids = render(passage_ids[: max(total_tokens - overhead, 16)])
    # Decoding and re-encoding can shift a few tokens; trim to the exact size.
    while len(ids) > total_tokens:
        passage_ids = passage_ids[: len(passage_ids) - (len(ids) - total_tokens) - 1]
        ids = render(passage_ids[: max(total_tokens - overhead, 16)])
    return ids


def needle_prompt(tokenizer, text: str, total_tokens: int, depth: float,
                  passkey: str) -> list[int]:
    """A chat prompt with a passkey hidden at ``depth`` of a real-text context."""
    needle = f" The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    question = ("There is a pass key hidden in the following text. Find it and "
                "memorize it.")
    ask = "What is the pass key? Answer with the number only."

    def render(filler_ids: list[int]) -> list[int]:
        cut = int(len(filler_ids) * depth)
        body = (tokenizer.decode(filler_ids[:cut]) + needle
                + tokenizer.decode(filler_ids[cut:]))
        messages = [{"role": "user", "content": f"{question}\n\n{body}\n\n{ask}"}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]

    filler = tokenizer(text[: 8 * total_tokens + 10_000], add_special_tokens=False)["input_ids"]
    overhead = len(render(filler[:64])) - 64
    return render(filler[: total_tokens - overhead])
