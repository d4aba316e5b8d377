"""Stop strings, streaming (sync and async), output kinds, biases, bans and min_tokens
through the engine on a tiny model."""

import asyncio

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import RequestOutputKind

KNOWN_IDS: list[int] = []


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(str(tiny_llama), max_model_len=128, block_size=8)
    # The random model's favourite tokens are byte fragments; keep generation to tokens
    # that are whole printable ASCII pieces so texts and stop strings are readable.
    tokenizer = engine.get_tokenizer()
    KNOWN_IDS[:] = [
        i
        for i in range(3, len(tokenizer))
        if (text := tokenizer.decode([i])).isascii() and text.strip() and text.isprintable()
    ]
    return engine


@pytest.fixture(autouse=True)
def no_leaks(llm):
    yield
    llm.llm_engine.engine_core.check_integrity()


def greedy(**kwargs):
    return SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, allowed_token_ids=KNOWN_IDS, **kwargs
    )


PROMPT = "The quick brown fox"


def test_stop_string_spanning_tokens_cuts_the_text(llm):
    full = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    # A stop string made of the text of generated tokens 5..7 (three tokens).
    stop = tokenizer.decode(full.token_ids[5:8])
    assert len(stop) >= 3
    start = full.text.index(stop)
    cut = llm.generate(PROMPT, greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text[:start]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert len(cut.token_ids) < len(full.token_ids)
    kept = llm.generate(
        PROMPT, greedy(stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == full.text[: start + len(stop)]


def test_streamed_deltas_add_up_to_the_final_text(llm):
    params = greedy(output_kind=RequestOutputKind.DELTA)
    deltas = list(llm.llm_engine.stream(PROMPT, params))
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
    final = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    assert "".join(d.outputs[0].text for d in deltas) == final.text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == final.token_ids
    cumulative = list(llm.llm_engine.stream(PROMPT, greedy()))
    assert cumulative[-1].outputs[0].text == final.text
    assert len(cumulative) == len(final.token_ids)


def test_stream_with_a_stop_string_never_streams_text_that_gets_cut(llm):
    full = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    stop = llm.get_tokenizer().decode(full.token_ids[6:9])
    params = greedy(stop=[stop], output_kind=RequestOutputKind.DELTA)
    streamed = "".join(o.outputs[0].text for o in llm.llm_engine.stream(PROMPT, params))
    assert streamed == full.text[: full.text.index(stop)]


def test_two_streams_interleave_and_closing_one_aborts_it(llm):
    engine = llm.llm_engine
    first = engine.stream(PROMPT, greedy(output_kind=RequestOutputKind.DELTA), request_id="s1")
    second = engine.stream("What is the capital", greedy(), request_id="s2")
    next(first)
    next(second)
    first.close()  # the consumer went away
    assert "s1" not in engine.engine_core.scheduler.requests
    rest = list(second)
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "length"


def test_async_streams_run_concurrently(llm):
    async def collect(prompt, request_id):
        texts = []
        async for output in llm.llm_engine.astream(prompt, greedy(), request_id=request_id):
            texts.append(output.outputs[0].text)
        return texts[-1]

    async def main():
        return await asyncio.gather(collect(PROMPT, "a1"), collect("What is", "a2"))

    texts = asyncio.run(main())
    expected = [
        o.outputs[0].text for o in llm.generate([PROMPT, "What is"], greedy(), use_tqdm=False)
    ]
    assert texts == expected


def test_abort_by_request_id_ends_the_stream(llm):
    engine = llm.llm_engine
    stream = engine.stream(PROMPT, greedy(), request_id="to-abort")
    next(stream)
    engine.abort_request(["to-abort"])
    final = list(stream)
    assert final[-1].finished and final[-1].outputs[0].finish_reason == "abort"


def test_logit_bias_forces_a_token(llm):
    out = llm.generate(PROMPT, greedy(logit_bias={42: 100.0}), use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) == {42}


def test_bad_words_never_appear(llm):
    tokenizer = llm.get_tokenizer()
    full = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    word = tokenizer.decode(full.token_ids[0:1]).strip()
    assert word
    banned = llm.generate(PROMPT, greedy(bad_words=[word]), use_tqdm=False)[0].outputs[0]
    for ids in (
        tokenizer.encode(word, add_special_tokens=False),
        tokenizer.encode(" " + word, add_special_tokens=False),
    ):
        if len(ids) == 1:
            assert ids[0] not in banned.token_ids
    assert banned.token_ids != full.token_ids


def test_min_tokens_holds_off_stop_token_ids(llm):
    full = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[1]
    early = llm.generate(PROMPT, greedy(stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert len(early.token_ids) == full.token_ids.index(stop_id) + 1
    held = llm.generate(PROMPT, greedy(stop_token_ids=[stop_id], min_tokens=10), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(held.token_ids) >= 10
    assert stop_id not in held.token_ids[:10]


def test_repetition_penalty_changes_the_greedy_path(llm):
    plain = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    penalized = (
        llm.generate(PROMPT, greedy(repetition_penalty=5.0, presence_penalty=2.0), use_tqdm=False)[
            0
        ]
        .outputs[0]
        .token_ids
    )
    assert len(set(penalized)) >= len(set(plain))
    assert penalized != plain


def test_truncate_prompt_tokens_keeps_the_tail(llm):
    tokens = list(range(3, 60))
    out = llm.generate(
        {"prompt_token_ids": tokens}, greedy(truncate_prompt_tokens=10), use_tqdm=False
    )[0]
    assert out.prompt_token_ids == tokens[-10:]


def test_detokenize_false_leaves_text_empty(llm):
    out = llm.generate(PROMPT, greedy(detokenize=False), use_tqdm=False)[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 24


def test_async_consumer_that_leaves_early_aborts_its_request(llm):
    async def main():
        stream = llm.llm_engine.astream(PROMPT, greedy(), request_id="leaver")
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(main())
    assert "leaver" not in llm.llm_engine.engine_core.scheduler.requests
    assert not llm.llm_engine.has_unfinished_requests()


def test_stop_strings_wait_for_min_tokens(llm):
    full = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    stop = llm.get_tokenizer().decode(full.token_ids[1:3])
    early = llm.generate(PROMPT, greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 3
    held = llm.generate(PROMPT, greedy(stop=[stop], min_tokens=12), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 12
    assert held.text.startswith(full.text[: full.text.index(stop) + len(stop)])
