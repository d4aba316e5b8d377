"""The training prompts, generated here from templates and word lists: chat-like
instructions, and copy/rewrite tasks over this repository's code and documents (the
benchmark's own listing, core/block_pool.py, is left out so that the copy workload is not
trained on)."""

from __future__ import annotations

import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPICS = (
    "volcanoes", "the moon", "photosynthesis", "chess", "coffee", "bees", "rainbows",
    "the internet", "trains", "gardening", "the ocean", "music", "bread", "recycling",
    "dinosaurs", "electricity", "clouds", "libraries", "football", "sleep", "maps", "bridges",
    "the human heart", "snow", "robots", "money", "vaccines", "deserts", "languages", "stars",
    "magnets", "forests", "cheese", "airplanes", "batteries", "earthquakes", "painting",
    "rivers", "computers", "tea", "the Roman Empire", "climate change", "exercise", "cats",
    "dogs", "mountains", "solar panels", "the printing press", "friendship", "time zones",
)  # fmt: skip
CHAT_TEMPLATES = (
    "What is {t}?",
    "Explain {t} to a child.",
    "Give me three facts about {t}.",
    "Why is {t} important?",
    "Write a short poem about {t}.",
    "How does {t} work?",
    "Write a short story about {t}.",
    "What are the pros and cons of {t}?",
    "Summarize the history of {t} in a few sentences.",
    "List five questions a student might ask about {t}.",
    "Describe {t} in one paragraph.",
    "What should a beginner know about {t}?",
    "Compare {t} and {u}.",
    "Write a short essay on {t}.",
    "Give me some tips about {t}.",
)
TASKS = (
    "planning a trip", "learning to cook", "saving money", "writing a resume",
    "studying for exams", "starting a garden", "running a meeting", "learning a language",
    "keeping a journal", "moving to a new city", "training for a race", "baking a cake",
)  # fmt: skip
TASK_TEMPLATES = (
    "Give me tips for {a}.",
    "How do I get started with {a}?",
    "Make a step-by-step plan for {a}.",
    "What mistakes should I avoid when {a}?",
)
CODE_FENCE = "```python\n"
BENCHMARK_LISTING = "pagedllm/core/block_pool.py"


def chat_message(rng: random.Random) -> str:
    if rng.random() < 0.25:
        return rng.choice(TASK_TEMPLATES).format(a=rng.choice(TASKS))
    topic, other = rng.sample(TOPICS, 2)
    return rng.choice(CHAT_TEMPLATES).format(t=topic, u=other)


def _code_files() -> list[Path]:
    files = sorted((ROOT / "pagedllm").rglob("*.py"))
    return [f for f in files if f.relative_to(ROOT).as_posix() != BENCHMARK_LISTING]


def _window(text: str, rng: random.Random, num_chars: int) -> str:
    """`num_chars` or so of `text` from the start of a line."""
    lines = text.splitlines(keepends=True)
    start = rng.randrange(max(1, len(lines) - 10))
    out = ""
    for line in lines[start:]:
        if len(out) + len(line) > num_chars:
            break
        out += line
    return out or text[:num_chars]


def copy_message(rng: random.Random, files: list[Path]) -> tuple[str, str]:
    """(user message, the answer's opening): repeat a code listing, as the copy workload."""
    listing = _window(rng.choice(files).read_text(), rng, rng.randint(300, 900))
    return f"Repeat this code exactly:\n{CODE_FENCE}{listing}\n```", CODE_FENCE


def rewrite_message(rng: random.Random, docs: list[Path]) -> str:
    text = _window(rng.choice(docs).read_text(), rng, rng.randint(200, 600))
    verb = rng.choice(("Repeat this text exactly", "Rewrite this in plain words", "Summarize"))
    return f"{verb}:\n\n{text}"


def make_prompts(tokenizer, num_prompts: int, seed: int) -> list[str]:
    """Chat-templated prompts: ~70% chat, ~20% code to copy, ~10% text to repeat/rewrite."""
    rng = random.Random(seed)
    files, docs = _code_files(), sorted((ROOT / "docs").rglob("*.md"))
    prompts = []
    for _ in range(num_prompts):
        draw, opening = rng.random(), ""
        if draw < 0.7:
            message = chat_message(rng)
        elif draw < 0.9:
            message, opening = copy_message(rng, files)
        else:
            message = rewrite_message(rng, docs)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(text + opening)
    return prompts
