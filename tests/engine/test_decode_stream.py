"""Detokenization through DecodeStream: which tokenizers take it, and that it gives the window
decoder's text (and the full decode's) for real text and random token sequences, with split
and invalid UTF-8, special tokens skipped or kept, one or several tokens per step; and that
it never holds more than a few tokens back.

Stop strings and streaming hold-back run through both paths in test_detokenizer.py."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from model_utils import make_tiny_tokenizer
from tiers import slow_fixture
from tokenizer_utils import TRAINING_TEXT

from pagedllm.frontend.detokenizer import IncrementalDetokenizer
from pagedllm.frontend.token_decoder import (
    make_token_decoder,
    stream_backend,
    token_text_decoder,
)
from pagedllm.frontend.window_decoder import MAX_PENDING_TOKENS
from pagedllm.model.gguf_loader import load_gguf_tokenizer
from pagedllm.model.loader import gemma3_270m_path

TEXTS = [
    "🎉👍🏽 日本語のテキスト、中文文本 àéîõü ça déjà",
    "Hello, world! 42 × 3 = 126; naïve café — “quoted” 🎉 end.\n\tTabs and  spaces.",
    TRAINING_TEXT,
    "def f(x):\n    return x  # ok\n\n\n    \t  trailing   \n",
    "𓀀𠀋 ꙮ ﷽ Ⅻ 🏳️‍🌈 é",  # rare characters: byte fallback where the vocabulary lacks them
]


@pytest.fixture(scope="module")
@slow_fixture  # the Gemma 3 file is joined and checked, its 262k vocabulary converted
def gemma3():
    return load_gguf_tokenizer(gemma3_270m_path())


# gemma3 is fetched by name at run time, which the tiers cannot see: marked slow here.
@pytest.fixture(
    params=[
        "smollm2",
        "tiny",
        "sentencepiece_style",
        pytest.param("gemma3", marks=pytest.mark.slow),
    ]
)
def tokenizer(request):
    return request.getfixturevalue(request.param)


def feed(
    tokenizer: Any,
    ids: list[int],
    use_decode_stream: bool,
    prompt: Sequence[int] = (),
    sizes: list[int] | None = None,
    skip_special_tokens: bool = True,
) -> list[str]:
    """Each update's delta, then the one after finish(), with ``sizes`` tokens per update."""
    detok = IncrementalDetokenizer(
        tokenizer,
        list(prompt),
        skip_special_tokens=skip_special_tokens,
        use_decode_stream=use_decode_stream,
    )
    assert detok.decoder_name == ("decode_stream" if use_decode_stream else "window")
    deltas, start = [], 0
    for size in sizes or [1] * len(ids):
        detok.update(ids[start : start + size])
        deltas.append(detok.get_next_delta())
        start += size
    assert start == len(ids)
    detok.finish()
    deltas.append(detok.get_next_delta())
    return deltas


def both_paths(tokenizer: Any, ids: list[int], **kwargs: Any) -> tuple[list[str], list[str]]:
    return feed(tokenizer, ids, True, **kwargs), feed(tokenizer, ids, False, **kwargs)


def assert_same_text(fast: list[str], window: list[str], expected: str) -> None:
    """The stream's text is the full decode's; where the window's is too, delta for delta.

    The window decoder falls short of the full decode in two places, both with byte-fallback
    tokenizers: after an update of several tokens its window can begin inside a character,
    whose run of byte tokens then decodes to U+FFFD; and after a skipped special token a
    decoder that strips the first space drops a space between words."""
    assert "".join(fast) == expected
    assert not any("\ufffd" in delta for delta in fast)
    if "".join(window) == expected:
        assert fast == window


def random_sizes(rng: random.Random, num_tokens: int) -> list[int]:
    sizes = []
    while num_tokens:
        sizes.append(min(num_tokens, rng.choice([1, 2, 3, 5, 8])))
        num_tokens -= sizes[-1]
    return sizes


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------- which path


@pytest.mark.parametrize("name", ["smollm2", "tiny", "sentencepiece_style"])
def test_fast_tokenizers_take_the_stream_path(request, name):
    tok = request.getfixturevalue(name)
    assert make_token_decoder(tok, [1, 2]).name == "decode_stream"
    assert make_token_decoder(tok, [1, 2], use_decode_stream=False).name == "window"


def test_gemma3_takes_the_stream_path(gemma3):
    assert make_token_decoder(gemma3, []).name == "decode_stream"


class DecodeOnly:
    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        return "".join(chr(65 + t % 26) for t in token_ids)


def test_other_tokenizers_take_the_window_path(tiny):
    assert make_token_decoder(DecodeOnly(), [1, 2]).name == "window"

    class RewritingTokenizer(type(tiny)):  # a class of its own decides what decode means
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    rewriting = RewritingTokenizer(tokenizer_object=tiny.backend_tokenizer)
    assert stream_backend(rewriting) is None
    assert make_token_decoder(rewriting, []).name == "window"


def _word_piece_tokenizer(clean_up: bool) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "do": 1, "n't": 2, ".": 3, "it": 4, "##s": 5}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=clean_up
    )


def test_space_clean_up_after_decoding_keeps_the_window_path():
    """Transformers rewrites " ." after a WordPiece decode; the stream would not."""
    cleaning = _word_piece_tokenizer(clean_up=True)
    ids = [4, 5, 3]
    assert cleaning.decode(ids) != cleaning.backend_tokenizer.decode(ids)
    assert make_token_decoder(cleaning, []).name == "window"
    plain = _word_piece_tokenizer(clean_up=False)
    assert plain.decode(ids) == plain.backend_tokenizer.decode(ids)
    assert make_token_decoder(plain, []).name == "decode_stream"


def test_clean_up_flag_on_a_bpe_tokenizer_keeps_the_stream_path(tiny):
    """Transformers ignores clean-up for BPE models, so the stream's text is still decode's."""
    cleaning = make_tiny_tokenizer()
    cleaning.clean_up_tokenization_spaces = True
    ids = encode(cleaning, "The fox . What ?")
    assert cleaning.decode(ids) == cleaning.backend_tokenizer.decode(ids) == "The fox . What ?"
    assert make_token_decoder(cleaning, []).name == "decode_stream"


# --------------------------------------------------------------------------- same text


@pytest.mark.parametrize("text", TEXTS, ids=["mixed", "punctuation", "story", "code", "rare"])
@pytest.mark.parametrize("skip", [True, False])
def test_real_text_equals_window_and_full_decode(tokenizer, text, skip):
    ids = encode(tokenizer, text)
    rng = random.Random(len(ids))
    for sizes in (
        [1] * len(ids),
        [3] * (len(ids) // 3) + [len(ids) % 3],
        random_sizes(rng, len(ids)),
    ):
        sizes = [s for s in sizes if s]
        fast, window = both_paths(tokenizer, ids, sizes=sizes, skip_special_tokens=skip)
        assert_same_text(fast, window, tokenizer.decode(ids, skip_special_tokens=skip))
        if max(sizes) == 1:  # the engine's usual update: delta for delta, always
            assert fast == window


@pytest.mark.parametrize("skip", [True, False])
def test_after_a_prompt_the_first_token_decodes_in_context(tokenizer, skip):
    special = tokenizer.all_special_ids[0]
    prompt = [*encode(tokenizer, "Some words then"), special, *encode(tokenizer, " more 日本")]
    ids = [*encode(tokenizer, " the answer, 🎉 done"), special, *encode(tokenizer, "x")]
    fast, window = both_paths(tokenizer, ids, prompt=prompt, skip_special_tokens=skip)
    whole = tokenizer.decode(prompt + ids, skip_special_tokens=skip)
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=skip)
    assert whole.startswith(prompt_text)
    assert_same_text(fast, window, whole[len(prompt_text) :])


def test_stream_keeps_a_run_of_byte_tokens_whole(sentencepiece_style):
    """Where the window decoder, after an update of several tokens, starts its window inside
    a run of byte tokens and decodes U+FFFD, the stream still decodes the characters."""
    tok = sentencepiece_style
    ids = encode(tok, "日本語のテキスト、中文文本")
    assert all(token.startswith("<0x") for token in tok.convert_ids_to_tokens(ids[1:]))
    # The second update's window starts 8 tokens back, at the second of "日"'s three bytes.
    fast, window = both_paths(tok, ids, sizes=[2, 8] + [1] * (len(ids) - 10))
    assert "".join(fast) == tok.decode(ids) == "日本語のテキスト、中文文本"
    assert "\ufffd" in "".join(window)  # the fallback's known shortcoming


def test_spaces_between_special_tokens_is_ignored_as_fast_tokenizers_ignore_it(smollm2):
    ids = [*encode(smollm2, "a"), 1, 2, *encode(smollm2, "b"), 2]
    expected = smollm2.decode(ids, skip_special_tokens=False)
    assert expected == "a<|im_start|><|im_end|>b<|im_end|>"
    for use_decode_stream in (True, False):
        detok = IncrementalDetokenizer(
            smollm2,
            [],
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            use_decode_stream=use_decode_stream,
        )
        detok.update(ids)
        detok.finish()
        assert detok.output_text == expected


def _random_ids(tokenizer: Any, rng: random.Random, length: int) -> list[int]:
    """Ids mixing any token, tokens holding part of a character, and special tokens."""
    vocab_size = len(tokenizer)
    partial = _partial_character_tokens(tokenizer)
    specials = tokenizer.all_special_ids
    ids = []
    for _ in range(length):
        draw = rng.random()
        pool = specials if draw < 0.1 else partial if draw < 0.55 else None
        ids.append(rng.choice(pool) if pool else rng.randrange(vocab_size))
    return ids


def _partial_character_tokens(tokenizer: Any) -> list[int]:
    found = getattr(tokenizer, "_test_partial_tokens", None)
    if found is None:
        candidates = random.Random(0).sample(range(len(tokenizer)), min(len(tokenizer), 4000))
        found = [i for i in candidates if "\ufffd" in tokenizer.decode([i])]
        tokenizer._test_partial_tokens = found
    assert found, "the tokenizer must split characters for these tests to mean anything"
    return found


def test_random_sequences_one_token_per_step_equal_the_window(tokenizer):
    """Invalid bytes, skipped specials, prompts: one token per step (the engine's usual
    update) gives the window decoder's deltas. The one exception is where the window loses a
    space that the full decode keeps (a skipped special token before a word, with a decoder
    that strips the first space); the stream decodes across the skipped token."""
    rng = random.Random(1234)
    for _ in range(150):
        ids = _random_ids(tokenizer, rng, rng.randint(1, 40))
        prompt = _random_ids(tokenizer, rng, rng.randint(0, 8))
        skip = rng.random() < 0.5
        fast, window = both_paths(tokenizer, ids, prompt=prompt, skip_special_tokens=skip)
        if "".join(window) == tokenizer.decode(ids, skip_special_tokens=skip):
            assert fast == window
        elif fast != window:
            assert skip and set(tokenizer.all_special_ids) & set(prompt + ids)


def test_valid_text_with_special_tokens_several_per_step(tokenizer):
    rng = random.Random(99)
    words = " ".join(TEXTS).split(" ")
    specials = tokenizer.all_special_ids
    for _ in range(40):
        ids = []
        for _ in range(rng.randint(1, 20)):
            if rng.random() < 0.15:  # between words, where a model would put one
                ids.append(rng.choice(specials))
            ids += encode(tokenizer, " " + rng.choice(words))
        for skip in (True, False):
            sizes = random_sizes(rng, len(ids))
            fast, window = both_paths(tokenizer, ids, sizes=sizes, skip_special_tokens=skip)
            assert_same_text(fast, window, tokenizer.decode(ids, skip_special_tokens=skip))


# --------------------------------------------------------------------------- held back


def test_a_character_unfinished_at_the_end_is_flushed_as_the_window_does(smollm2):
    ids = encode(smollm2, "ab🎉")[:-1]
    fast, window = both_paths(smollm2, ids)
    assert fast == window
    assert not any("\ufffd" in delta for delta in fast[:-1]) and fast[-1].endswith("\ufffd")


def test_invalid_bytes_are_released_and_the_stream_resumes(smollm2):
    continuation = next(
        i for i in _partial_character_tokens(smollm2) if smollm2.decode([i]) == "\ufffd"
    )
    ids = [
        *encode(smollm2, "ok"),
        *[continuation] * (MAX_PENDING_TOKENS + 2),
        *encode(smollm2, " then fine"),
    ]
    fast, window = both_paths(smollm2, ids)
    assert fast == window
    assert "".join(fast).startswith("ok\ufffd") and "".join(fast).endswith(" then fine")

    decoder = make_token_decoder(smollm2, [])
    for token_id in ids:
        decoder.push([token_id])
        assert decoder.num_pending_tokens <= MAX_PENDING_TOKENS
    assert decoder.streaming  # back on the fast path once the invalid bytes were released


def test_a_decode_that_rewrites_earlier_text_is_settled_by_the_window(sentencepiece_style):
    """Byte fallback turns a whole run of bytes into U+FFFD when any of them is invalid, so a
    byte token can change the text already emitted for the one before it."""
    tok = sentencepiece_style
    ids = [*tok.convert_tokens_to_ids(["<0x41>", "<0xE6>", "<0x42>"]), *encode(tok, " the fox")]
    assert tok.decode(ids[:1]) == "A" and not tok.decode(ids).startswith("A")
    fast, window = both_paths(tok, ids)
    assert fast == window


def test_pending_tokens_stay_bounded(tokenizer):
    """Runs of skipped special tokens and invalid bytes never pile up in the stream."""
    rng = random.Random(7)
    special = tokenizer.all_special_ids[0]
    for _ in range(30):
        ids = _random_ids(tokenizer, rng, 30) + [special] * 20 + _random_ids(tokenizer, rng, 30)
        decoder = make_token_decoder(tokenizer, [], skip_special_tokens=True)
        for size in random_sizes(rng, len(ids)):
            decoder.push(ids[:size])
            ids = ids[size:]
            assert decoder.num_pending_tokens <= MAX_PENDING_TOKENS


# --------------------------------------------------------------------------- logprobs' text


def test_one_token_text_equals_its_decode(tokenizer):
    """Logprobs' token strings: the backend's text is ``tokenizer.decode([id])``'s, special
    tokens and partial characters included."""
    decode_token = token_text_decoder(tokenizer)
    rng = random.Random(5)
    ids = [*tokenizer.all_special_ids, *_random_ids(tokenizer, rng, 300)]
    assert [decode_token(i) for i in ids] == [tokenizer.decode([i]) for i in ids]
    assert decode_token(tokenizer.all_special_ids[0]) != ""  # special tokens are kept


def test_one_token_text_of_other_tokenizers_is_their_decode():
    assert token_text_decoder(DecodeOnly())(3) == "D"
