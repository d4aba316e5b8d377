"""Request-level chat templates against the server: refused unless the operator passes
`--trust-request-chat-template`; when trusted, a benign one renders and a hostile one (nested
loops, or output past the context window) is refused with a 400 naming `chat_template` within
the time bound, while the server goes on answering everyone else. The operator's own
`--chat-template` replaces the model's."""

from __future__ import annotations

import threading
import time

import httpx2 as httpx
import pytest
from server_utils import API_KEY, RunningServer
from tiers import slow_fixture

from pagedllm.frontend.chat_template import RENDER_TIMEOUT_S
from pagedllm.model.loader import load_tokenizer, resolve_model

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
BENIGN = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
HUGE_OUTPUT = "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}"
# A bound on waits that only guards against a hang (the machine may be busy).
HANG_GUARD_S = 60.0
# The trusted server's --chat-template (a file), in place of the model's.
SERVER_TEMPLATE = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}<<bot>> "


@pytest.fixture(scope="module")
@slow_fixture
def trusted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("trusted")
    template = directory / "template.jinja"
    template.write_text(SERVER_TEMPLATE)
    running = RunningServer(
        ["--trust-request-chat-template", "--chat-template", str(template)],
        directory / "server.log",
        api_key=API_KEY,
    )
    yield running
    assert running.stop() == 0, running.log()


def chat(template: str | None = None, **extra) -> dict:
    body = {"messages": QUESTION, "max_tokens": 2, "temperature": 0, **extra}
    if template is not None:
        body["chat_template"] = template
    return body


def assert_refused(response: httpx.Response, param: str = "chat_template") -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"], error["type"]) == (param, 400, "BadRequestError")
    return error["message"]


def assert_healthy(server: RunningServer) -> None:
    assert server.get("/health").status_code == 200
    response = server.post("/v1/chat/completions", chat())
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat(BENIGN)),
        ("/v1/chat/completions", chat(NESTED_LOOPS, stream=True)),
        ("/v1/chat/completions", chat(chat_template_kwargs={"chat_template": BENIGN})),
        ("/tokenize", {"messages": QUESTION, "chat_template": BENIGN}),
    ],
)
def test_request_template_refused_without_the_flag(server, path, body):
    message = assert_refused(server.post(path, body))
    assert "--trust-request-chat-template" in message
    assert_healthy(server)


def test_trusted_benign_template_renders(trusted):
    tokenizer = load_tokenizer(resolve_model(None))
    expected = tokenizer.encode(
        "[user] What is the capital of France?\n[assistant] ", add_special_tokens=False
    )
    tokenized = trusted.post("/tokenize", {"messages": QUESTION, "chat_template": BENIGN})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == expected
    response = trusted.post("/v1/chat/completions", chat(BENIGN))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


def test_trusted_hostile_template_is_stopped_while_others_are_served(trusted):
    hostile: dict[str, float | httpx.Response] = {}

    def send_hostile() -> None:
        hostile["sent_at"] = time.monotonic()
        hostile["response"] = trusted.post("/v1/chat/completions", chat(NESTED_LOOPS))
        hostile["done_at"] = time.monotonic()

    def send_short() -> None:
        hostile["short"] = trusted.post("/v1/chat/completions", chat())

    thread = threading.Thread(target=send_hostile, daemon=True)
    thread.start()
    other = threading.Thread(target=send_short, daemon=True)
    other.start()
    # /health asked again and again (sent, answered, status) while the hostile request is out.
    polls: list[tuple[float, float, int]] = []
    deadline = time.monotonic() + HANG_GUARD_S
    while thread.is_alive() and time.monotonic() < deadline:
        sent = time.monotonic()
        status = trusted.get("/health").status_code
        polls.append((sent, time.monotonic(), status))
        time.sleep(0.02)
    thread.join(timeout=HANG_GUARD_S)
    other.join(timeout=HANG_GUARD_S)
    assert not thread.is_alive() and not other.is_alive()

    # Stopped by the time bound: it would otherwise loop for hours.
    message = assert_refused(hostile["response"])
    assert "did not finish rendering" in message
    assert hostile["short"].status_code == 200, hostile["short"].text
    assert all(status == 200 for _, _, status in polls), polls
    # The server answered others while the template ran. Its rendering began after the
    # request was sent, ended before the answer came, and lasted at least RENDER_TIMEOUT_S
    # (it never finishes on its own), so it covered [done_at - T, sent_at + T]: a /health
    # asked and answered within that span was answered mid-rendering. No guess at when the
    # rendering started, and no speed, decides this.
    began_by = hostile["done_at"] - RENDER_TIMEOUT_S
    still_on = hostile["sent_at"] + RENDER_TIMEOUT_S
    during = [
        (sent, answered) for sent, answered, _ in polls if began_by <= sent and answered <= still_on
    ]
    assert during, (hostile["sent_at"], hostile["done_at"], polls)
    assert_healthy(trusted)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat(HUGE_OUTPUT)),
        ("/v1/chat/completions", chat("{{ 'x' * 1000000000 }}", stream=True)),
        ("/tokenize", {"messages": QUESTION, "chat_template": HUGE_OUTPUT}),
        ("/tokenize", {"messages": QUESTION, "chat_template": NESTED_LOOPS}),
    ],
)
def test_trusted_template_past_a_bound_is_refused(trusted, path, body):
    # Refused by a bound (the answer says which), not rendered: these would loop for hours
    # or write far past the context window.
    message = assert_refused(trusted.post(path, body))
    assert "too large" in message or "did not finish rendering" in message
    assert_healthy(trusted)


def test_server_chat_template_replaces_the_models(trusted):
    tokenizer = load_tokenizer(resolve_model(None))
    expected = tokenizer.encode(
        "<<user>> What is the capital of France?\n<<bot>> ", add_special_tokens=False
    )
    tokenized = trusted.post("/tokenize", {"messages": QUESTION})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == expected
    response = trusted.post("/v1/chat/completions", chat())
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(expected)
