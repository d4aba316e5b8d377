"""The training prompts, generated here from templates and word lists: open chat questions
of many kinds (facts, how-to, advice, lists, creative writing, small coding and arithmetic
tasks, word meanings, short emails), never the same message twice, and copy/rewrite tasks
over this repository's code and documents (the benchmark's own listing,
core/block_pool.py, is left out so that the copy workload is not trained on).

Every tenth subject and activity is kept apart, and so are the subjects the chat benchmark's
questions name (benchmarks/spec_decode.py): the held-out prompts are chat built only from
those, so the held-out figures say how the head does on questions about things it was never
trained on."""

from __future__ import annotations

import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUBJECTS = (
    "volcanoes", "the moon", "photosynthesis", "chess", "coffee", "bees", "rainbows",
    "the internet", "trains", "gardening", "the ocean", "music", "bread", "recycling",
    "dinosaurs", "electricity", "clouds", "libraries", "football", "sleep", "maps", "bridges",
    "the human heart", "snow", "robots", "money", "vaccines", "deserts", "languages", "stars",
    "magnets", "forests", "cheese", "airplanes", "batteries", "earthquakes", "painting",
    "rivers", "computers", "tea", "the Roman Empire", "climate change", "exercise", "cats",
    "dogs", "mountains", "solar panels", "the printing press", "friendship", "time zones",
    "black holes", "the water cycle", "tides", "hurricanes", "glaciers", "coral reefs",
    "the immune system", "DNA", "gravity", "sound waves", "lightning", "the periodic table",
    "plastic", "wind turbines", "nuclear power", "rockets", "satellites", "telescopes",
    "microscopes", "smartphones", "passwords", "email", "spreadsheets", "databases",
    "video games", "social media", "cameras", "electric cars", "bicycles", "traffic lights",
    "the stock market", "inflation", "taxes", "banks", "credit cards", "budgets", "insurance",
    "the Olympic Games", "basketball", "tennis", "swimming", "yoga", "marathons", "jazz",
    "the piano", "the guitar", "opera", "movies", "photography", "poetry", "novels",
    "comic books", "theater", "sculpture", "architecture", "castles", "pyramids",
    "ancient Greece", "the Middle Ages", "the Renaissance", "the industrial revolution",
    "the Silk Road", "the Vikings", "the Moon landing", "democracy", "elections",
    "human rights", "newspapers", "podcasts", "penguins", "elephants", "whales", "owls",
    "ants", "butterflies", "sharks", "wolves", "horses", "octopuses", "rainforests",
    "grasslands", "lakes", "islands", "caves", "soil", "fungi", "seeds", "apples", "rice",
    "chocolate", "pizza", "soup", "spices", "vegetables", "vitamins", "sugar", "salt",
    "breakfast", "water", "fire", "glass", "steel", "wood", "paper", "cotton", "wool",
    "silk", "clocks", "calendars", "the alphabet", "numbers", "fractions", "geometry",
    "probability", "statistics", "algebra", "prime numbers", "the weather", "seasons",
    "the sun", "Mars", "Jupiter", "comets", "the Milky Way", "earth's atmosphere",
    "oxygen", "carbon", "bacteria", "viruses", "the brain", "memory", "dreams", "stress",
    "happiness", "habits", "motivation", "kindness", "teamwork", "leadership",
    "negotiation", "public speaking", "job interviews", "remote work", "online shopping",
    "cities", "villages", "public transport", "airports", "hotels", "museums", "zoos",
    "parks", "schools", "universities", "homework", "teachers", "doctors", "nurses",
    "farmers", "firefighters", "pilots", "engineers", "scientists", "artists", "chefs",
)  # fmt: skip
ACTIVITIES = (
    "planning a trip", "learning to cook", "saving money", "writing a resume",
    "studying for exams", "starting a garden", "running a meeting", "learning a language",
    "keeping a journal", "moving to a new city", "training for a race", "baking a cake",
    "learning to code", "painting a room", "buying a used car", "adopting a pet",
    "hosting a dinner party", "starting a small business", "learning to swim",
    "reading more books", "waking up early", "organizing a closet", "making new friends",
    "preparing for a job interview", "giving a presentation", "writing a novel",
    "learning to draw", "fixing a flat tire", "camping for the first time",
    "packing for a flight", "decluttering a house", "planting tomatoes",
    "teaching a child to read", "staying focused", "eating healthier", "drinking more water",
    "learning the guitar", "making coffee at home", "choosing a laptop", "caring for a plant",
    "writing a thank-you note", "planning a wedding", "running a marathon",
    "meditating", "taking better photos", "negotiating a salary", "renting an apartment",
)  # fmt: skip
SUBJECT_TEMPLATES = (
    "What is {t}?", "Tell me about {t}.", "Explain {t} to a child.",
    "Give me three facts about {t}.", "Why is {t} important?", "Write a short poem about {t}.",
    "How does {t} work?", "Write a short story about {t}.",
    "What are the pros and cons of {t}?", "Summarize the history of {t} in a few sentences.",
    "List five questions a student might ask about {t}.", "Describe {t} in one paragraph.",
    "What should a beginner know about {t}?", "Compare {t} and {u}.",
    "Write a short essay on {t}.", "What is the connection between {t} and {u}?",
    "What are some common myths about {t}?", "Write a haiku about {t}.",
    "What would the world be like without {t}?", "Give me a fun fact about {t}.",
    "Explain {t} in simple terms.", "What are the main parts of {t}?",
    "Write a riddle about {t}.", "What is the future of {t}?",
    "Write a limerick about {t}.", "How has {t} changed over time?",
    "Who should learn about {t}, and why?", "What are three surprising things about {t}?",
    "Write a dialogue between two friends talking about {t}.",
    "Describe {t} to someone who has never seen it.", "What problems does {t} solve?",
    "Make a short quiz with answers about {t}.", "Write a product description for {t}.",
    "Explain the science behind {t}.", "What is the most interesting thing about {t}?",
    "I am curious about {t}. Where should I start?", "Write a tweet about {t}.",
    "Give me an analogy that explains {t}.", "What jobs are related to {t}?",
)  # fmt: skip
ACTIVITY_TEMPLATES = (
    "Give me tips for {a}.", "How do I get started with {a}?",
    "Make a step-by-step plan for {a}.", "What mistakes should I avoid when {a}?",
    "I need advice on {a}.", "What do I need for {a}?", "Is {a} hard? How long does it take?",
    "Make a checklist for {a}.", "My friend is nervous about {a}. What can I tell them?",
    "Write a short motivational message about {a}.",
)  # fmt: skip
CODING_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the vowels in a word",
    "returns the largest item in a list", "removes duplicates from a list",
    "computes the factorial of a number", "checks whether a word is a palindrome",
    "sorts a list of names by length", "converts Celsius to Fahrenheit",
    "finds the average of a list of numbers", "returns the n-th Fibonacci number",
    "counts how often each word appears in a sentence", "merges two sorted lists",
    "capitalizes the first letter of every word", "checks whether a year is a leap year",
    "flattens a list of lists", "returns the even numbers from a list",
    "finds the longest word in a sentence", "reads a file and counts its lines",
    "adds up the digits of a number",
)  # fmt: skip
CODING_TEMPLATES = (
    "Write a Python function that {c}.", "How would I write a function in Python that {c}?",
    "Show me JavaScript code that {c}.", "Write a short program that {c} and explain it.",
)  # fmt: skip
WORDS = (
    "ephemeral", "serendipity", "resilient", "meticulous", "ubiquitous", "candid",
    "nostalgia", "pragmatic", "benevolent", "eloquent", "frugal", "gregarious", "tenacious",
    "ambiguous", "empathy", "curiosity", "diligent", "humble", "vivid", "whimsical",
)  # fmt: skip
WORD_TEMPLATES = (
    "What does the word '{w}' mean?", "Use '{w}' in three sentences.",
    "What is the opposite of '{w}'?", "Explain the word '{w}' with an example.",
)  # fmt: skip
PEOPLE = ("manager", "teacher", "landlord", "neighbour", "team", "friend", "doctor", "client")
EVENTS = (
    "a late report", "a party next week", "a broken heater", "a missed meeting",
    "a new project", "a holiday request", "a thank-you for their help", "a schedule change",
)  # fmt: skip
MODIFIERS = (
    "", "", "", " Keep it short.", " Answer in a few sentences.", " Use simple words.",
    " Use a bulleted list.", " Be specific.", " Explain it step by step.",
)  # fmt: skip
CODE_FENCE = "```python\n"
BENCHMARK_LISTING = "pagedllm/core/block_pool.py"
# One in this many subjects and activities is kept for the held-out prompts only, with
# the subjects of spec_decode.CHAT_QUESTIONS.
HELD_OUT_EVERY = 10
BENCHMARK_SUBJECTS = ("bicycles", "email", "seasons")


def is_held_out(items: tuple[str, ...], index: int) -> bool:
    return index % HELD_OUT_EVERY == 0 or items[index] in BENCHMARK_SUBJECTS


def _part(items: tuple[str, ...], held_out: bool) -> tuple[str, ...]:
    return tuple(x for i, x in enumerate(items) if is_held_out(items, i) == held_out)


def _arithmetic(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 90), rng.randint(2, 40), rng.randint(2, 12)
    return rng.choice(
        (
            f"A shop sells pens at {c} dollars each. How much do {b} pens cost?",
            f"If a train travels {a} km per hour for {c} hours, how far does it go?",
            f"I have {a} apples and give away {min(a, b)}. How many are left?",
            f"What is {a} times {b}? Show your work.",
            f"What is {a} percent of {b * 10}?",
            f"Split {a * c} cookies equally among {c} children. How many does each get?",
        )
    )


def chat_message(rng: random.Random, held_out: bool = False) -> str:
    """One chat request: about one of this part's subjects or activities, or a task whose
    words appear in both parts (code, arithmetic, word meanings, emails) for training."""
    subjects, activities = _part(SUBJECTS, held_out), _part(ACTIVITIES, held_out)
    draw = rng.random()
    if draw < 0.6 or (held_out and draw < 0.8):
        topic, other = rng.sample(subjects, 2)
        message = rng.choice(SUBJECT_TEMPLATES).format(t=topic, u=other)
    elif draw < 0.8 or held_out:
        message = rng.choice(ACTIVITY_TEMPLATES).format(a=rng.choice(activities))
    elif draw < 0.87:
        message = rng.choice(CODING_TEMPLATES).format(c=rng.choice(CODING_TASKS))
    elif draw < 0.92:
        message = _arithmetic(rng)
    elif draw < 0.96:
        message = rng.choice(WORD_TEMPLATES).format(w=rng.choice(WORDS))
    else:
        message = f"Write a short email to my {rng.choice(PEOPLE)} about {rng.choice(EVENTS)}."
    return message + rng.choice(MODIFIERS)


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


def make_messages(num_prompts: int, seed: int, held_out: bool = False) -> list[tuple[str, str]]:
    """(user message, the answer's opening), all different. Training: ~70% chat, ~20% code
    to copy, ~10% text to repeat/rewrite; held out: chat about held-out subjects only."""
    rng = random.Random(f"{seed}-{'held-out' if held_out else 'train'}")
    files, docs = _code_files(), sorted((ROOT / "docs").rglob("*.md"))
    messages: list[tuple[str, str]] = []
    seen: set[str] = set()
    for _ in range(num_prompts * 50):  # a bound, never reached by any size asked for here
        if len(messages) == num_prompts:
            break
        draw, opening = rng.random(), ""
        if draw < 0.7 or held_out:
            message = chat_message(rng, held_out)
        elif draw < 0.9:
            message, opening = copy_message(rng, files)
        else:
            message = rewrite_message(rng, docs)
        if message not in seen:
            seen.add(message)
            messages.append((message, opening))
    return messages


def make_prompts(tokenizer, num_prompts: int, seed: int, held_out: bool = False) -> list[str]:
    """make_messages' requests, chat-templated."""
    prompts = []
    for message, opening in make_messages(num_prompts, seed, held_out):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(text + opening)
    return prompts
