"""IncrementalDetokenizer: streamed text equals the full decode, split characters are held
back, stop strings cut at the right place and never reach a stream, and each step decodes a
bounded window. Every test runs through both token decoders: DecodeStream (the fast
tokenizers' path) and the window decoder (every other tokenizer's)."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
from tokenizer_utils import TRAINING_TEXT

from pagedllm.frontend.detokenizer import IncrementalDetokenizer

EMOJI = "🎉👍🏽"
CJK = "日本語のテキスト、中文文本"
ACCENTED = "àéîõü ça déjà"
MIXED = "Hello, world! 42 × 3 = 126; naïve café — “quoted” 🎉 end.\n\tTabs and  spaces."
TEXTS = [EMOJI, CJK, ACCENTED, MIXED, f"{EMOJI}{CJK}{ACCENTED}"]
STORY = TRAINING_TEXT
IM_END = 2  # SmolLM2's <|im_end|>


@pytest.fixture(params=["smollm2", "tiny", "sentencepiece_style"])
def any_tokenizer(request):
    return request.getfixturevalue(request.param)


# The decoder path the running test takes; set by the autouse fixture below.
PATH = {"use_decode_stream": True}


@pytest.fixture(autouse=True, params=[True, False], ids=["decode_stream", "window"])
def decoder_path(request, monkeypatch):
    monkeypatch.setitem(PATH, "use_decode_stream", request.param)
    return request.param


def detokenizer(tokenizer: Any, prompt_ids: list[int], **kwargs: Any) -> IncrementalDetokenizer:
    """An IncrementalDetokenizer on the running test's decoder path."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **PATH, **kwargs)
    fast = PATH["use_decode_stream"] and not isinstance(tokenizer, RecordingTokenizer)
    assert detok.decoder_name == ("decode_stream" if fast else "window")
    return detok


class Streamed(NamedTuple):
    detokenizer: IncrementalDetokenizer
    deltas: list[str]  # one per update, then (if no stop matched) one after finish()
    stop: str | None
    num_tokens_fed: int


def stream(
    tokenizer: Any,
    output_ids: list[int],
    prompt_ids: list[int] | None = None,
    chunk: int = 1,
    **kwargs: Any,
) -> Streamed:
    """Feed `output_ids` `chunk` at a time, as the engine would, until a stop string fires."""
    detok = detokenizer(tokenizer, prompt_ids or [], **kwargs)
    deltas = []
    for start in range(0, len(output_ids), chunk):
        matched = detok.update(output_ids[start : start + chunk])
        deltas.append(detok.get_next_delta())
        if matched is not None:
            assert detok.finished and detok.stop_reason == matched
            return Streamed(detok, deltas, matched, min(start + chunk, len(output_ids)))
    detok.finish()
    deltas.append(detok.get_next_delta())
    return Streamed(detok, deltas, None, len(output_ids))


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def chat_prompt(tokenizer: Any) -> list[int]:
    return encode(tokenizer, "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------- plain decoding


@pytest.mark.parametrize("text", TEXTS, ids=["emoji", "cjk", "accented", "mixed", "all"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_equals_full_decode_without_replacement_chars(any_tokenizer, text, chunk):
    ids = encode(any_tokenizer, text)
    full = any_tokenizer.decode(ids, skip_special_tokens=True)
    assert _strip_leading_space(full) == _strip_leading_space(text)  # the tokenizer round-trips

    result = stream(any_tokenizer, ids, chunk=chunk)
    assert "".join(result.deltas) == result.detokenizer.output_text == full
    assert not any("\ufffd" in delta for delta in result.deltas), result.deltas


def _strip_leading_space(text: str) -> str:
    return text.removeprefix(" ")


@pytest.mark.parametrize("text", [EMOJI, CJK, ACCENTED])
def test_smollm2_really_splits_characters_across_tokens(smollm2, text):
    """Without this the replacement-character checks above would prove nothing."""
    ids = encode(smollm2, text)
    singles = [smollm2.decode([token_id]) for token_id in ids]
    assert any("\ufffd" in single for single in singles), singles


def test_emoji_bytes_split_over_tokens_are_held_back_until_complete(smollm2):
    ids = encode(smollm2, "🎉")
    assert len(ids) >= 2 and smollm2.decode(ids[:1]) == "\ufffd"
    detok = detokenizer(smollm2, [])
    for token_id in ids[:-1]:
        assert detok.update([token_id]) is None
        assert detok.output_text == detok.get_next_delta() == ""
    detok.update(ids[-1:])
    assert detok.get_next_delta() == "🎉"


def test_chat_prompt_context_does_not_leak_into_output(smollm2):
    """With prompt context (here ending in special tokens) the output is still its own decode."""
    ids = [*encode(smollm2, MIXED), IM_END]
    for skip in (True, False):
        result = stream(smollm2, ids, chat_prompt(smollm2), skip_special_tokens=skip)
        assert "".join(result.deltas) == smollm2.decode(ids, skip_special_tokens=skip)


def test_sentencepiece_style_keeps_spaces_between_streamed_words(sentencepiece_style):
    tok = sentencepiece_style
    ids = encode(tok, "Hello world, 日本 this is text.")
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # CJK falls back to byte tokens
    alone = stream(tok, ids)
    assert "".join(alone.deltas) == tok.decode(ids) == "Hello world, 日本 this is text."

    # After a prompt the first word keeps its leading space, as in the whole sequence (vLLM).
    prompt = encode(tok, "The fox")
    in_context = stream(tok, ids, prompt)
    whole = tok.decode(prompt + ids)
    assert "".join(in_context.deltas) == whole[len(tok.decode(prompt)) :]
    assert in_context.detokenizer.output_text == " Hello world, 日本 this is text."


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(smollm2, skip):
    assert smollm2.convert_ids_to_tokens(IM_END) == "<|im_end|>"
    ids = [*encode(smollm2, "Hello"), IM_END, *encode(smollm2, " world")]
    result = stream(smollm2, ids, skip_special_tokens=skip)
    expected = "Hello world" if skip else "Hello<|im_end|> world"
    assert "".join(result.deltas) == smollm2.decode(ids, skip_special_tokens=skip) == expected


def test_stop_string_made_of_special_token_text_needs_them_kept(smollm2):
    ids = [*encode(smollm2, "Hello"), IM_END, *encode(smollm2, " world")]
    kept = stream(smollm2, ids, skip_special_tokens=False, stop=["<|im_end|>"])
    assert (kept.stop, kept.detokenizer.output_text, kept.num_tokens_fed) == (
        "<|im_end|>",
        "Hello",
        len(ids) - len(encode(smollm2, " world")),
    )
    skipped = stream(smollm2, ids, skip_special_tokens=True, stop=["<|im_end|>"])
    assert skipped.stop is None and skipped.detokenizer.output_text == "Hello world"


# --------------------------------------------------------------------------- stop strings


def _token_ends(tokenizer: Any, ids: list[int]) -> list[int]:
    """Character offset where each token's text ends (ASCII text: decodes are prefixes)."""
    return [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]


@pytest.mark.parametrize("stop", ["jumps over the", "umps over th"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_three_tokens(smollm2, stop, include):
    assert len(encode(smollm2, stop)) >= 3
    ids = encode(smollm2, STORY)
    ends = _token_ends(smollm2, ids)
    start = STORY.index(stop)
    stop_end = start + len(stop)
    spanned = [
        i for i, end in enumerate(ends) if end > start and (i == 0 or ends[i - 1] < stop_end)
    ]
    assert len(spanned) >= 3, spanned  # in the stream too, the match crosses token boundaries

    result = stream(smollm2, ids, stop=[stop], include_stop_str_in_output=include)
    assert result.stop == stop
    # It fires on the token that completes the match, and not before.
    assert result.num_tokens_fed == next(i for i, end in enumerate(ends) if end >= stop_end) + 1
    expected = STORY[:stop_end] if include else STORY[:start]
    assert result.detokenizer.output_text == "".join(result.deltas) == expected


@pytest.mark.parametrize("chunk", [1, 100])
def test_earliest_stop_string_wins(smollm2, chunk):
    ids = encode(smollm2, STORY)
    # "slept" is listed first, but "fox" occurs earlier.
    result = stream(smollm2, ids, chunk=chunk, stop=["slept", "fox", "lazy dog"])
    assert result.stop == "fox"
    assert result.detokenizer.output_text == "The quick brown "


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_completed_together_cut_at_the_earliest_start(smollm2, include):
    ids = encode(smollm2, STORY)
    # One update completes all three; "jumps over" starts first although it ends last.
    result = stream(
        smollm2,
        ids,
        chunk=len(ids),
        stop=["over", "jumps over", "ver"],
        include_stop_str_in_output=include,
    )
    assert result.stop == "jumps over"
    expected = "The quick brown fox jumps over" if include else "The quick brown fox "
    assert result.detokenizer.output_text == expected
    # At the same start, the stop listed first wins.
    tie = stream(smollm2, ids, chunk=len(ids), stop=["The quick", "The"])
    assert tie.stop == "The quick"


@pytest.mark.parametrize("include", [False, True])
def test_streamed_text_is_never_cut_afterwards(smollm2, include):
    text = "one two one three; one two four — one two one three 🎉 done"
    ids = encode(smollm2, text)
    stops = [[text[i : i + n]] for i in range(0, len(text) - 2, 3) for n in (2, 5, 9)]
    stops += [["one three", "two f"], ["🎉", "one two one"], ["e; o", "xyz-never-there"]]
    for stop in stops:
        result = stream(smollm2, ids, stop=stop, include_stop_str_in_output=include)
        final = result.detokenizer.output_text
        # Deltas only append, so "never cut" means: all of them together are the final text.
        assert "".join(result.deltas) == final, stop
        assert result.stop in stop
        # It fired at its first occurrence, and no stop string occurred completely before.
        start = text.index(result.stop)
        assert final == text[: start + len(result.stop) if include else start], stop
        before = final[:-1] if include else final
        assert not any(s in before for s in stop), stop


def test_partial_stop_string_is_held_back_until_finish(smollm2):
    stop = ["NEVER!"]  # 6 characters: the last 5 are held back while a match could begin
    ids = encode(smollm2, ACCENTED + " and more")
    detok = detokenizer(smollm2, [], stop=stop)
    streamed = ""
    for token_id in ids:
        assert detok.update([token_id]) is None
        streamed += detok.get_next_delta()
        assert detok.output_text.startswith(streamed)
        assert len(streamed) == max(0, len(detok.output_text) - 5)
    detok.finish()
    streamed += detok.get_next_delta()
    assert streamed == detok.output_text == smollm2.decode(ids)
    detok.finish()  # idempotent
    assert detok.get_next_delta() == ""
    with pytest.raises(RuntimeError):
        detok.update([IM_END])


def test_include_stop_str_needs_no_hold_back(smollm2):
    ids = encode(smollm2, STORY)
    detok = detokenizer(smollm2, [], stop=["slept"], include_stop_str_in_output=True)
    detok.update(ids[:3])
    assert detok.get_next_delta() == detok.output_text == smollm2.decode(ids[:3])


def test_a_partial_match_that_does_not_complete_is_released(smollm2):
    # "fox s" is a prefix of the stop "fox sat" but the text goes on differently.
    result = stream(smollm2, encode(smollm2, STORY), stop=["fox sat"])
    assert result.stop is None
    assert "".join(result.deltas) == result.detokenizer.output_text == STORY


# --------------------------------------------------------------------------- cost per step


class RecordingTokenizer:
    """Forwards decode and records how many ids each call decoded."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        self.window_sizes.append(len(token_ids))
        return self.tokenizer.decode(token_ids, **kwargs)


def test_each_step_decodes_a_bounded_window(smollm2):
    paragraph = f"{MIXED} {CJK} {EMOJI} {ACCENTED} {STORY}\n"
    ids = encode(smollm2, paragraph * 60)[:2000]
    assert len(ids) == 2000
    recorder = RecordingTokenizer(smollm2)
    prompt = chat_prompt(smollm2) * 20  # a long prompt must not widen the window either
    detok = detokenizer(recorder, prompt, stop=["never appears"])
    streamed = ""
    for token_id in ids[:1000]:
        detok.update([token_id])
        streamed += detok.get_next_delta()
    assert max(recorder.window_sizes) <= 16 + 1
    # Even after one update of many tokens, later single-token steps stay small.
    detok.update(ids[1000:1500])
    recorder.window_sizes.clear()
    for token_id in ids[1500:]:
        detok.update([token_id])
        streamed += detok.get_next_delta()
    assert max(recorder.window_sizes) <= 16 + 1
    detok.finish()
    streamed += detok.get_next_delta()
    assert streamed == detok.output_text == smollm2.decode(ids)
