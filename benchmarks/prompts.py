"""Chat prompts of an exact token length, cut from the corpus."""

from __future__ import annotations

import numpy as np

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
    return hidden_text_prompt(
        tokenizer, text, total_tokens, depth,
        needle=f" The pass key is {passkey}. Remember it. {passkey} is the pass key. ",
        question="There is a pass key hidden in the following text. Find it and memorize it.",
        ask="What is the pass key? Answer with the number only.",
    )


def secret_sentence_prompt(tokenizer, text: str, total_tokens: int, depth: float,
                           sentence: str) -> list[int]:
    """A chat prompt with a sentence hidden at ``depth`` of a real-text context,
    asking to repeat it word for word (a needle with a long answer)."""
    return hidden_text_prompt(
        tokenizer, text, total_tokens, depth,
        needle=f" The secret sentence is: {sentence} ",
        question="There is a secret sentence hidden in the following text.",
        ask="Repeat the secret sentence word for word, and nothing else.",
    )


def hidden_text_prompt(tokenizer, text: str, total_tokens: int, depth: float, needle: str,
                       question: str, ask: str) -> list[int]:
    """A chat prompt of ``total_tokens`` tokens: ``question``, a real-text
    context with ``needle`` at ``depth``, then ``ask``."""

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


def secret_sentence(rng) -> str:
    """A made-up sentence of about 40 tokens that no text predicts."""
    words = ["saffron", "walnuts", "cinnamon", "lemon peel", "dark rye", "honey", "thyme",
             "almonds", "cardamom", "ginger", "copper", "clay", "brick", "iron", "stone"]
    pick = rng.sample(words, 6)
    n = [rng.randrange(2, 97) for _ in range(4)]
    return (f"The recipe of the old mill calls for {n[0]} cups of {pick[0]}, {n[1]} spoons "
            f"of {pick[1]} and a pinch of {pick[2]}, baked for {n[2]} minutes in the "
            f"{pick[3]} oven, then served on {n[3]} plates of {pick[4]} with {pick[5]}.")


def two_passages_prompt(tokenizer, text: str, total_tokens: int,
                        depths: tuple[float, float] = (0.2, 0.7)) -> list[int]:
    """A chat prompt of about ``total_tokens`` tokens asking to copy, word for
    word, the paragraph at ``depths[0]`` of a real-text context and then the
    one at ``depths[1]``: the generation's topic moves mid-answer from one
    part of the context to another."""
    filler = tokenizer(text[: 8 * total_tokens + 10_000], add_special_tokens=False)["input_ids"]
    body = tokenizer.decode(filler[: total_tokens - 120])
    paragraphs = body.split("\n\n")
    starts = np.cumsum([0] + [len(p) + 2 for p in paragraphs])
    chosen = []
    for depth in depths:
        # The first paragraph of 300+ characters from the depth on.
        index = min(int(np.searchsorted(starts, depth * len(body), side="right")) - 1,
                    len(paragraphs) - 1)
        while index < len(paragraphs) - 1 and len(paragraphs[index]) < 300:
            index += 1
        chosen.append(" ".join(paragraphs[index].split()[:8]).lstrip("\"'_"))
    ask = (f'Copy two paragraphs of the text above word for word: first the paragraph '
           f'that begins with "{chosen[0]}", then the paragraph that begins with '
           f'"{chosen[1]}". Write nothing else.')
    messages = [{"role": "user", "content": f"{body}\n\n{ask}"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]
