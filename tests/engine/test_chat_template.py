"""The bounded chat-template renderer (`frontend/chat_template.py`): the text transformers'
`apply_chat_template` writes, Jinja's sandbox, and a time and size bound that stop a hostile
template instead of letting it burn the process."""

from __future__ import annotations

import math
import threading
import time
import tracemalloc

import jinja2
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidRequestError
from pagedllm.frontend.chat_template import (
    apply_chat_template,
    load_chat_template,
    render_template,
)
from pagedllm.frontend.processor import render_chat
from pagedllm.model.loader import load_tokenizer, resolve_model

# Loops that emit nothing: 10^10 iterations, so only the time bound ends them.
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
TIMEOUT_S = 0.5
# A bound on waits that only guards against a hang; nothing here should take a tenth of it.
HANG_GUARD_S = 60.0
# How long each rendering of the interrupt race lasts, sized from a measured rate.
RACE_RENDER_S = 0.02

# A template using what Hub templates use: namespace, loop controls, tojson, dict(), tools,
# documents, the generation tag, reasoning fields, special tokens, raise_exception.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system=none, seen=0) %}
{%- if tools %}Tools: {{ tools | tojson(indent=2) }}
{% endif %}
{%- for doc in documents or [] %}[doc {{ loop.index }}] {{ doc.title }}: {{ doc.text }}
{% endfor %}
{%- for message in messages %}
  {%- if message.role == 'system' %}{% set ns.system = message.content %}{% continue %}{% endif %}
  {%- if message.role not in ['user', 'assistant', 'tool'] %}
    {{- raise_exception('unknown role ' ~ message.role) }}
  {%- endif %}
  {%- set ns.seen = ns.seen + 1 %}
  {%- if message.role == 'assistant' %}
    {%- generation %}<assistant>
      {%- if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}
      {{- message.content }}</assistant>{% endgeneration %}
  {%- else %}<{{ message.role }}{% if message.name %} name="{{ message.name }}"{% endif %}>
    {{- message.content | trim }}</{{ message.role }}>
  {%- endif %}
  {%- if ns.seen > 20 %}{% break %}{% endif %}
{%- endfor %}
{%- if ns.system %}[system: {{ ns.system }}]{% endif %}
{{- dict(count=ns.seen) | tojson }}
{%- if add_generation_prompt %}<assistant>{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Hi  ", "name": "ann"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "Weather in Paris?", "name": None},
    ],
    [{"role": "user", "content": "Ünïcödé ✓ " * 50}, {"role": "assistant", "content": "ok"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))  # the default model's (SmolLM2)


def refused(source: str, max_output_chars: int = 1 << 20, timeout_s: float = TIMEOUT_S):
    with pytest.raises(InvalidRequestError) as error:
        render_template(source, {}, "chat_template", timeout_s, max_output_chars)
    assert error.value.param == "chat_template"
    return str(error.value)


# ---- the same text as transformers ---------------------------------------------------------


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_model_template_renders_as_transformers(tokenizer, conversation, add_generation_prompt):
    expected = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert apply_chat_template(tokenizer, conversation, add_generation_prompt, False) == expected


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_continue_final_message_as_transformers(tokenizer, conversation):
    conversation = [*conversation[:-1], {"role": "assistant", "content": "The answer is"}]
    expected = tokenizer.apply_chat_template(
        conversation, tokenize=False, continue_final_message=True
    )
    assert apply_chat_template(tokenizer, conversation, False, True) == expected
    assert expected.endswith("The answer is")


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_rich_template_renders_as_transformers(tokenizer, conversation):
    documents = [{"title": "Paris", "text": "Capital of France."}]
    expected = tokenizer.apply_chat_template(
        conversation,
        tools=TOOLS,
        documents=documents,
        chat_template=RICH_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    kwargs = {"tools": TOOLS, "documents": documents}
    ours = apply_chat_template(tokenizer, conversation, True, False, RICH_TEMPLATE, kwargs)
    assert ours == expected
    assert "get_weather" in ours and "<|im_start|>" in ours  # tools and bos_token reached it


def test_template_errors_pass_through(tokenizer):
    conversation = [{"role": "narrator", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="unknown role narrator"):
        tokenizer.apply_chat_template(conversation, chat_template=RICH_TEMPLATE, tokenize=False)
    with pytest.raises(jinja2.TemplateError, match="unknown role narrator"):
        apply_chat_template(tokenizer, conversation, False, False, RICH_TEMPLATE)


# ---- the sandbox -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__subclasses__() }}",
        "{% set x = [1] %}{{ x.append(2) }}",  # the immutable sandbox: no mutation
        "{% set ns = namespace() %}{% set ns._secret = 1 %}",
        "{{ cycler.__init__.__globals__ }}",
    ],
)
def test_sandbox_refuses_internals_and_mutation(source):
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_template(source, {"messages": []}, "chat_template")


# ---- the time bound --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        NESTED_LOOPS,
        # Output nobody sees: a loop that writes into a variable.
        "{% set ns = namespace(n=0) %}{% for a in range(100000) %}{% for b in range(100000) %}"
        "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}{{ ns.n }}",
        # Exponential recursion through a macro.
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(60) }}",
        # Slow filters: Python loops inside Jinja's own code.
        "{% for i in range(100000) %}{{ lipsum(100) | length }}{% endfor %}",
    ],
)
def test_time_bound_stops_the_template(source):
    # Each would run for hours: that it ends at all, refused by the time bound, shows the
    # bound stopped it (how soon after TIMEOUT_S is a benchmark's question, not a test's).
    message = refused_in_a_thread(source)
    assert "did not finish rendering within" in message
    assert render_template("{{ 1 + 1 }}", {}, "chat_template") == "2"  # and renders again


def refused_in_a_thread(source: str) -> str:
    """`refused(source)` on a thread of its own, so that a bound that never stops the template
    fails the test after a hang-guard instead of hanging it."""
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["message"] = refused(source)
        except BaseException as error:
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=HANG_GUARD_S)
    assert not thread.is_alive(), "the time bound did not stop the template"
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return str(result["message"])


def busy(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def fastest_rendering_s(source: str, n: int) -> float:
    """The fastest of three renderings of `source` with `n`, under a deadline never reached."""
    took = []
    for _ in range(3):
        started = time.perf_counter()
        render_template(source, {"n": n}, "c", HANG_GUARD_S)
        took.append(time.perf_counter() - started)
    return min(took)


def sized_to_last(source: str, seconds: float) -> tuple[int, float]:
    """The `n` for which rendering `source` takes at least `seconds` on this machine, measured
    here (the fastest of three, so a busy moment does not inflate it), and that time."""
    n = 1
    while True:
        took = fastest_rendering_s(source, n)
        if took >= seconds:
            return n, took
        n = max(n + 1, math.ceil(1.1 * n * seconds / max(took, 1e-6)))


def test_the_interrupt_never_lands_after_the_rendering():
    """Deadlines that fall just as renderings finish: the interrupt hits the rendering it was
    meant for or none, never the code the worker thread runs next.

    The work is sized from this machine's measured rate, not fixed: each rendering lasts about
    RACE_RENDER_S, and the deadlines run from a twentieth of a rendering (always inside it,
    however fast or slow the CPU) to twice its length (around and after its end)."""
    # n thousands of steps (the sandbox refuses a range past 100,000).
    source = "{% for a in range(n) %}{% for i in range(1000) %}{{ i }}{% endfor %}{% endfor %}"
    n, rendering_s = sized_to_last(source, RACE_RENDER_S)
    deadlines = [rendering_s * (0.05 + 1.95 * (attempt % 20) / 19) for attempt in range(200)]
    expected = busy(20000)
    outcomes = {"rendered": 0, "refused": 0}
    escaped: list[BaseException] = []

    def worker() -> None:
        try:
            for timeout_s in deadlines:
                try:
                    render_template(source, {"n": n}, "c", timeout_s)
                    outcomes["rendered"] += 1
                except InvalidRequestError:
                    outcomes["refused"] += 1
                # The same thread goes on running Python code, untouched.
                assert busy(20000) == expected
        except BaseException as error:  # DeadlineExceeded landing after a rendering, above all
            escaped.append(error)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    thread.join(timeout=HANG_GUARD_S)
    assert not thread.is_alive(), "the renderings did not finish"
    assert escaped == []
    assert outcomes["refused"] > 0, (n, rendering_s, outcomes)
    assert sum(outcomes.values()) == len(deadlines)


# Loops that emit nothing and end only when the test releases them (or at a hang-guard).
HELD_LOOPS = (
    "{% for a in range(100000) %}{% for b in range(100000) %}"
    "{% if released() %}{{ raise_exception('released') }}{% endif %}"
    "{% endfor %}{% endfor %}"
)


def test_a_hostile_template_does_not_hold_up_another_thread(tokenizer):
    """Another rendering finishes while a hostile template is still looping: the hostile one
    runs until the test releases it, so no deadline decides which ends first. (That the time
    bound stops such loops is test_time_bound_stops_the_template's part.)"""
    looping, release = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def released() -> bool:
        looping.set()
        return release.is_set()

    def hostile() -> None:
        try:
            render_template(HELD_LOOPS, {"released": released}, "chat_template", HANG_GUARD_S)
        except jinja2.TemplateError as error:
            results["hostile"] = error

    thread = threading.Thread(target=hostile, daemon=True)
    thread.start()
    try:
        assert looping.wait(HANG_GUARD_S), "the hostile template never started looping"
        # Rendered (with its own bounds, here only a hang-guard) while the other one loops.
        text = apply_chat_template(tokenizer, CONVERSATIONS[0], True, False, timeout_s=HANG_GUARD_S)
        finished_first = thread.is_alive()
    finally:
        release.set()
        thread.join(timeout=HANG_GUARD_S)
    assert not thread.is_alive()
    assert text == tokenizer.apply_chat_template(
        CONVERSATIONS[0], tokenize=False, add_generation_prompt=True
    )
    assert finished_first
    assert "released" in str(results["hostile"])


# ---- the size bound --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",  # only the output is large
        "{{ 'x' * 1000000000 }}",
        "{{ ['x'] * 100000000 }}",
        "{{ 'x' | center(1000000000) }}",
        "{{ 'x'.ljust(1000000000) }}",
        "{{ '%999999999s' % 1 }}",
        "{{ ('{0}' * 100000).format('y' * 100000) }}",
        "{{ ('y' * 100000) | replace('', 'z' * 1000) }}",
        "{{ ('y' * 100000).replace('', 'z' * 1000) }}",
        "{{ range(100000) | join('z' * 100000) }}",
        "{{ ('z' * 100000).join(range(1000) | map('string')) }}",
        "{{ ('\t' * 100000).expandtabs(1000000) }}",
        "{{ ('a\n' * 100000) | indent(1000000) }}",
        "{{ ('a ' * 100000) | wordwrap(1, wrapstring='z' * 100000) }}",
        "{{ ('a' * 100000).translate({97: 'b' * 100000}) }}",
        "{{ {'a': {'b': [1, 2, 3]}} | tojson(indent=1000000) }}",
        # Doubling a value again and again, with ~, + and a block set.
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}",
        "{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
        "{% endfor %}",
        "{{ 7 ** 100000 }}",
    ],
)
def test_size_bound_refuses_before_memory_goes(source):
    tracemalloc.start()
    try:
        # A long time bound: here only the size bound may stop the template.
        message = refused(source, max_output_chars=1 << 20, timeout_s=30.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "too large" in message
    # Never much more than the 1 Mi-character budget (4 bytes a character at worst).
    assert peak < 64 << 20


def test_output_at_the_budget_renders():
    assert render_template("{{ 'x' * 1000 }}", {}, "chat_template", 1.0, 1000) == "x" * 1000
    assert "too large" in refused("{{ 'x' * 1000 }}{{ 'y' }}", max_output_chars=1000)


def test_the_models_template_names_messages(tokenizer):
    huge = [{"role": "user", "content": "x" * 5000}]
    with pytest.raises(InvalidRequestError) as error:
        apply_chat_template(tokenizer, huge, True, False, max_output_chars=4096)
    assert error.value.param == "messages"


# ---- processor.render_chat and the offline LLM --------------------------------------------------


def test_render_chat_kwargs(tokenizer):
    conversation = CONVERSATIONS[0]
    with pytest.raises(InvalidRequestError) as error:
        render_chat(tokenizer, conversation, True, False, None, {"add_generation_prompt": False})
    assert error.value.param == "chat_template_kwargs"
    # vLLM's chat_template_kwargs.chat_template is the template; other kwargs are variables.
    template = "{{ greeting }} {{ messages[0].content }}"
    text = render_chat(
        tokenizer, conversation, True, False, None, {"chat_template": template, "greeting": "Hi"}
    )
    assert text == "Hi What is the capital of France?"
    with pytest.raises(InvalidRequestError) as error:
        render_chat(tokenizer, conversation, True, False, "{{ 'x' * 1000000000 }}")
    assert error.value.param == "chat_template"


def test_offline_chat_template_is_bounded_and_the_engine_goes_on(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=128, block_size=8)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(InvalidRequestError) as error:
        llm.chat(messages, params, use_tqdm=False, chat_template=NESTED_LOOPS)
    assert error.value.param == "chat_template"
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    output = llm.chat(messages, params, use_tqdm=False, chat_template=template)[0]
    assert output.prompt_token_ids == llm.get_tokenizer().encode(
        messages[0]["content"], add_special_tokens=False
    )
    assert len(output.outputs[0].token_ids) == 2


def test_load_chat_template_reads_a_file_or_takes_the_template(tmp_path):
    """`--chat-template`: a file or the template itself, compiled at start-up."""
    source = "{% for m in messages %}{{ m.content }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(source)
    assert load_chat_template(str(path)) == source
    assert load_chat_template(source) == source
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template("{% for m in messages %}")
