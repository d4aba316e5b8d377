"""benchmarks.train_eagle's prompts: never the same request twice, held-out chat only about
subjects and activities training never sees, and none of the chat benchmark's questions."""

from __future__ import annotations

import re

from benchmarks.eagle_train.prompts import (
    ACTIVITIES,
    ACTIVITY_TEMPLATES,
    MODIFIERS,
    SUBJECT_TEMPLATES,
    SUBJECTS,
    is_held_out,
    make_messages,
)
from benchmarks.spec_decode import CHAT_QUESTIONS

ANY_ITEM = "(" + "|".join(re.escape(x) for x in SUBJECTS + ACTIVITIES) + ")"


def _filled_in(templates: tuple[str, ...], message: str) -> set[str]:
    """The subjects and activities a message put into any of `templates`' slots."""
    for modifier in filter(None, MODIFIERS):
        message = message.removesuffix(modifier)
    words = set()
    for template in templates:
        pattern = re.escape(template)
        for slot in (r"\{t\}", r"\{u\}", r"\{a\}"):
            pattern = pattern.replace(slot, ANY_ITEM)
        found = re.fullmatch(pattern, message)
        if found:
            words.update(found.groups())
    return words


def _held_out(items: tuple[str, ...]) -> set[str]:
    return {x for i, x in enumerate(items) if is_held_out(items, i)}


def test_requests_are_all_different_and_parts_do_not_share_subjects():
    trained = [m for m, _ in make_messages(600, seed=0)]
    held_out = [m for m, _ in make_messages(40, seed=0, held_out=True)]
    assert len(set(trained)) == 600 and len(set(held_out)) == 40
    kept_apart = _held_out(SUBJECTS) | _held_out(ACTIVITIES)
    templates = SUBJECT_TEMPLATES + ACTIVITY_TEMPLATES
    trained_words = set().union(*(_filled_in(templates, m) for m in trained))
    held_out_words = set().union(*(_filled_in(templates, m) for m in held_out))
    assert trained_words and not trained_words & kept_apart
    assert held_out_words and held_out_words <= kept_apart
    assert not any(q in m for q in CHAT_QUESTIONS for m in trained + held_out)
    # The benchmark's own subjects are never trained on.
    assert not any(w in q.lower() for q in CHAT_QUESTIONS for w in trained_words)


def test_the_same_seed_gives_the_same_prompts():
    assert make_messages(50, seed=3) == make_messages(50, seed=3)
    assert make_messages(50, seed=3) != make_messages(50, seed=4)
