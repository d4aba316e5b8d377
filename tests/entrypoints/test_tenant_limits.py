"""Tenants without a server: the limiter on a fake clock, the keys file parser, key lookup,
reload, cache salts, token charging of a generation and the access-log redaction."""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading

import pytest

from pagedllm.entrypoints.openai import tenants
from pagedllm.entrypoints.openai.key_index import KeyIndex, key_digest
from pagedllm.entrypoints.openai.serving import charge_generated_tokens
from pagedllm.entrypoints.openai.tenant_limits import (
    Refusal,
    TenantLimiter,
    TenantLimits,
    TokenBucket,
)
from pagedllm.entrypoints.openai.tenants import (
    DEFAULT_TENANT,
    REDACTED,
    RedactQuerySecrets,
    TenantRegistry,
    load_tenants,
    parse_keys_file,
    redact_query_secrets,
    tenants_from_api_keys,
)
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

WAIT_S = 60.0  # bound on what a test waits for (the machine may be busy)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ---- the limiter ---------------------------------------------------------------------------
def test_token_bucket_refills_continuously_and_may_be_overdrawn():
    bucket = TokenBucket(60, now=0.0)  # one a second
    assert bucket.seconds_until(60, 0.0) == 0.0
    bucket.take(70, 0.0)
    assert bucket.available(0.0) == -10
    assert bucket.seconds_until(1, 0.0) == pytest.approx(11.0)
    assert bucket.available(5.0) == pytest.approx(-5.0)
    assert bucket.available(1000.0) == 60  # never above a minute's allowance
    assert bucket.available(900.0) == 60  # a clock that steps back drains nothing


def test_requests_per_minute():
    clock = FakeClock()
    limiter = TenantLimiter(TenantLimits(max_requests_per_minute=3), clock)
    for _ in range(3):
        assert limiter.admit() is None
        limiter.release()
    refusal = limiter.admit()
    assert refusal is not None and refusal.limit == "max_requests_per_minute"
    assert refusal.retry_after_s == pytest.approx(20.0)
    assert refusal.retry_after_header == "20"
    clock.advance(19.0)
    assert limiter.admit() is not None
    clock.advance(1.0)
    assert limiter.admit() is None


def test_tokens_per_minute_admits_until_overdrawn_and_says_when_it_is_paid_back():
    clock = FakeClock()
    limiter = TenantLimiter(TenantLimits(max_tokens_per_minute=60), clock)
    assert limiter.admit() is None
    limiter.charge_tokens(50)
    limiter.release()
    assert limiter.admit() is None  # 10 left: still admitted
    limiter.charge_tokens(40)  # now 30 in debt
    limiter.release()
    refusal = limiter.admit()
    assert refusal is not None and refusal.limit == "max_tokens_per_minute"
    assert refusal.retry_after_s == pytest.approx(31.0)
    assert "tokens per minute" in refusal.message
    clock.advance(31.0)
    assert limiter.admit() is None


def test_concurrent_requests_and_a_refusal_costs_nothing():
    clock = FakeClock()
    limiter = TenantLimiter(
        TenantLimits(max_requests_per_minute=3, max_concurrent_requests=2), clock
    )
    assert limiter.admit() is None
    assert limiter.admit() is None
    for _ in range(5):  # refused for concurrency: no request-per-minute is spent
        refusal = limiter.admit()
        assert refusal is not None and refusal.limit == "max_concurrent_requests"
        assert refusal.retry_after_header == "1"
    limiter.release()
    assert limiter.admit() is None  # the third of three a minute
    limiter.release()
    assert limiter.admit().limit == "max_requests_per_minute"


def test_no_limits_admit_everything():
    limiter = TenantLimiter(TenantLimits(), FakeClock())
    for _ in range(1000):
        assert limiter.admit() is None
        limiter.charge_tokens(10**6)
    assert limiter.in_flight == 1000


def test_update_keeps_unchanged_buckets_and_requests_in_flight():
    clock = FakeClock()
    limiter = TenantLimiter(
        TenantLimits(max_requests_per_minute=1, max_tokens_per_minute=100), clock
    )
    assert limiter.admit() is None
    limiter.charge_tokens(500)
    limiter.update(TenantLimits(max_requests_per_minute=1, max_tokens_per_minute=100))
    assert limiter.in_flight == 1
    assert limiter.admit().limit == "max_tokens_per_minute"  # the debt is remembered
    limiter.update(TenantLimits(max_requests_per_minute=1, max_concurrent_requests=1))
    assert limiter.admit().limit == "max_concurrent_requests"
    limiter.release()
    assert limiter.admit().limit == "max_requests_per_minute"  # still spent this minute


@pytest.mark.parametrize("value", [0, -1, 1.5, "3", True, 2**63, 2**70])
def test_limits_must_be_positive_integers(value):
    with pytest.raises(ValueError, match="max_tokens_per_minute must be an integer >= 1"):
        TenantLimits(max_tokens_per_minute=value)


def test_retry_after_header_rounds_up_to_whole_seconds():
    assert Refusal("x", 0.2, "").retry_after_header == "1"
    assert Refusal("x", 2.01, "").retry_after_header == "3"


# ---- the keys file -------------------------------------------------------------------------
DEFAULTS = TenantLimits(max_requests_per_minute=10)


def test_keys_file_lines_comments_and_overrides():
    text = """
    # team keys
    alice   sk-alice-1
    bob     sk-bob-2   max_tokens_per_minute=500 max_requests_per_minute=none  # no rpm
    ops.team-1 sk-ops max_concurrent_requests=2
    """
    specs = parse_keys_file(text, DEFAULTS, "keys.txt")
    assert [s.name for s in specs] == ["alice", "bob", "ops.team-1"]
    assert specs[0].limits == DEFAULTS
    assert specs[1].limits == TenantLimits(max_tokens_per_minute=500)
    assert specs[2].limits == TenantLimits(max_requests_per_minute=10, max_concurrent_requests=2)
    assert "sk-" not in repr(specs)


@pytest.mark.parametrize(
    "line,message",
    [
        ("alice", "line 2: expected 'name key"),
        ("al/ice sk-secret", "line 2: the name must be"),
        ("alice sk-secret max_rpm=3", "line 2, column 3: expected LIMIT=N"),
        ("alice sk-secret sk-secret-too", "line 2, column 3: expected LIMIT=N"),
        ("alice sk-secret max_tokens_per_minute=0", "max_tokens_per_minute must be an integer"),
        ("alice sk-secret max_tokens_per_minute=x", "max_tokens_per_minute must be an integer"),
        (f"alice sk-secret max_tokens_per_minute={2**64}", "<= 9223372036854775807"),
        ("alice sk-secret max_tokens_per_minute=²", "max_tokens_per_minute must be an integer"),
        (
            "alice sk-secret max_tokens_per_minute=1 max_tokens_per_minute=2",
            "max_tokens_per_minute given twice",
        ),
    ],
)
def test_keys_file_errors_name_the_line_and_never_the_key(line, message):
    with pytest.raises(ValueError) as error:
        parse_keys_file(f"# header\n{line}\n", DEFAULTS, "keys.txt")
    assert message in str(error.value)
    assert str(error.value).startswith("api_keys_file: keys.txt, line 2")
    assert "secret" not in str(error.value)


def test_duplicate_names_and_keys_are_refused(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice sk-1\nalice sk-2\n")
    with pytest.raises(ValueError, match="the tenant name 'alice' is used twice"):
        load_tenants([], str(path), DEFAULTS)
    path.write_text("alice sk-1\nbob sk-1\n")
    with pytest.raises(ValueError, match="tenants 'alice' and 'bob' have the same key"):
        load_tenants([], str(path), DEFAULTS)
    # A file key equal to an --api-key is just as ambiguous.
    path.write_text("alice sk-1\n")
    with pytest.raises(ValueError, match="'key-1' and 'alice' have the same key"):
        load_tenants(["sk-1"], str(path), DEFAULTS)
    with pytest.raises(ValueError, match="'key-1' and 'key-2' have the same key"):
        load_tenants(["sk-9", "sk-9"], None, DEFAULTS)


def test_an_empty_or_missing_keys_file_is_refused(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# nobody yet\n")
    with pytest.raises(ValueError, match="holds no keys"):
        load_tenants([], str(path), DEFAULTS)
    with pytest.raises(ValueError, match="cannot read"):
        load_tenants([], str(tmp_path / "absent"), DEFAULTS)


def test_api_keys_are_named_by_position_never_by_key():
    specs = tenants_from_api_keys(["sk-first", "sk-second"], DEFAULTS)
    assert [s.name for s in specs] == ["key-1", "key-2"]
    with pytest.raises(ValueError, match="key 2 is empty"):
        tenants_from_api_keys(["sk-first", ""], DEFAULTS)


# ---- the registry --------------------------------------------------------------------------
def test_authenticate_finds_the_tenant_of_each_key(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice sk-alice\nbob sk-bob\n")
    registry = TenantRegistry(["sk-flag"], str(path), DEFAULTS)
    assert registry.names == ["key-1", "alice", "bob"]
    assert registry.authenticate("Bearer sk-alice").name == "alice"
    assert registry.authenticate("bearer sk-bob").name == "bob"
    assert registry.authenticate("Bearer sk-flag").name == "key-1"
    for header in (None, "", "Bearer", "Bearer ", "sk-alice", "Basic sk-alice", "Bearer sk-al"):
        assert registry.authenticate(header) is None, header


def test_without_keys_every_request_is_the_default_tenant():
    registry = TenantRegistry(defaults=DEFAULTS)
    tenant = registry.authenticate(None)
    assert tenant.name == DEFAULT_TENANT and not registry.requires_key
    assert tenant.limiter.limits == DEFAULTS
    assert tenant.cache_salt(None) is None and tenant.cache_salt("mine") == "mine"


def test_tenants_get_their_own_cache_salt_unless_shared(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice sk-alice\nbob sk-bob\n")
    registry = TenantRegistry([], str(path))
    alice, bob = (registry.authenticate(f"Bearer sk-{n}") for n in ("alice", "bob"))
    salts = {alice.cache_salt(None), bob.cache_salt(None), alice.cache_salt("x")}
    assert len(salts) == 3 and None not in salts
    # A client's own salt cannot make one tenant's salt equal another's.
    assert alice.cache_salt("|x") != bob.cache_salt("x")
    assert bob.cache_salt("tenant:alice") != alice.cache_salt(None)
    shared = TenantRegistry([], str(path), share_prefix_cache=True)
    assert shared.authenticate("Bearer sk-alice").cache_salt(None) is None
    assert shared.authenticate("Bearer sk-bob").cache_salt("x") == "x"


def test_reload_adds_and_removes_keys_and_a_bad_file_keeps_the_old(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text("alice sk-alice max_concurrent_requests=1\ngone sk-gone\n")
    registry = TenantRegistry([], str(path), clock=FakeClock())
    alice = registry.authenticate("Bearer sk-alice")
    assert alice.limiter.admit() is None
    path.write_text("alice sk-alice max_concurrent_requests=1\nnew sk-new\n")
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert registry.reload()
    assert registry.authenticate("Bearer sk-gone") is None
    assert registry.authenticate("Bearer sk-new").name == "new"
    # alice's request in flight still counts after the reload
    assert registry.authenticate("Bearer sk-alice").limiter.admit() is not None
    assert "added: new; removed: gone" in caplog.text

    path.write_text("alice sk-alice\nalice sk-other\n")
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert not registry.reload()
    assert "Keeping the old API keys" in caplog.text
    assert registry.authenticate("Bearer sk-new").name == "new"
    assert registry.authenticate("Bearer sk-other") is None
    path.write_text("")  # an emptied file must not open the server to everyone
    assert not registry.reload() and registry.requires_key
    assert "sk-" not in caplog.text


def test_a_key_is_found_by_its_digest_without_comparing_it_to_every_key(tmp_path, monkeypatch):
    # 100,000 tenants, as the issue measured: a request (a wrong key too) used to compare its
    # key's digest with every one of them on the event loop.
    path = tmp_path / "keys"
    path.write_text("".join(f"t{i} sk-{i:08d}\n" for i in range(100_000)))
    registry = TenantRegistry([], str(path), clock=FakeClock())
    comparisons = []

    def counted(a: bytes, b: bytes) -> bool:
        comparisons.append(1)
        return a == b

    monkeypatch.setattr(hmac, "compare_digest", counted)
    assert registry.authenticate("Bearer sk-00099999").name == "t99999"
    assert registry.authenticate("Bearer sk-00000000").name == "t0"
    assert registry.authenticate("Bearer sk-wrong") is None
    assert comparisons == []
    index = registry._index  # the lookup structure: one entry per key, by its digest
    assert isinstance(index, KeyIndex) and len(index) == 100_000
    assert index.digests() == {key_digest(f"sk-{i:08d}") for i in range(100_000)}


def test_key_index_keeps_digests_never_keys():
    index = KeyIndex([(key_digest("sk-a"), "a"), (key_digest("sk-b"), "b")])
    assert index.find("sk-a") == "a" and index.find("sk-b") == "b"
    assert index.find("sk-") is None and index.find("") is None
    assert list(index) == ["a", "b"] and len(index) == 2
    assert all(len(digest) == 32 for digest in index.digests())
    assert "sk-a" not in repr(vars(index))


def test_a_reload_parses_in_a_worker_thread_while_the_loop_serves(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text("alice sk-alice\n")
    registry = TenantRegistry([], str(path), clock=FakeClock())
    path.write_text("bob sk-bob\n")
    parsing, release = threading.Event(), threading.Event()
    parsed_in: list[threading.Thread] = []
    real_load = tenants.load_tenants

    def slow_load(*args):
        parsed_in.append(threading.current_thread())
        parsing.set()
        # Let go by the test's coroutine on the event loop: a parse that ran on the loop
        # would wait here in vain.
        assert release.wait(WAIT_S), "the event loop was blocked while the file was parsed"
        return real_load(*args)

    monkeypatch.setattr(tenants, "load_tenants", slow_load)

    async def run() -> None:
        reload = asyncio.create_task(registry.reload_off_loop())
        assert await asyncio.to_thread(parsing.wait, WAIT_S), "the reload never started"
        # The loop serves meanwhile, with the old keys only: the swap is all or nothing.
        assert registry.authenticate("Bearer sk-alice").name == "alice"
        assert registry.authenticate("Bearer sk-bob") is None
        release.set()
        assert await reload
        assert registry.authenticate("Bearer sk-alice") is None
        assert registry.authenticate("Bearer sk-bob").name == "bob"

    asyncio.run(run())
    assert parsed_in and parsed_in[0] is not threading.main_thread()


def test_a_bad_file_reloaded_off_the_loop_keeps_the_old_keys(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text("alice sk-alice\n")
    registry = TenantRegistry([], str(path), clock=FakeClock())
    path.write_text("alice sk-alice\nbob\n")
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert not asyncio.run(registry.reload_off_loop())
    assert "Keeping the old API keys" in caplog.text and "line 2" in caplog.text
    assert registry.authenticate("Bearer sk-alice").name == "alice"


# ---- token charging of one generation -------------------------------------------------------
def _output(index: int, token_ids: list[int], finished: bool) -> RequestOutput:
    completion = CompletionOutput(index, "", token_ids, None, "length" if finished else None)
    return RequestOutput("r", None, [1], [completion], finished=finished)


async def _replay(outputs: list[tuple[int, RequestOutput]], held: asyncio.Event | None = None):
    """`outputs`, one by one; with `held`, then set it and wait (as a request still
    generating does) until cancelled."""
    for item in outputs:
        yield item
    if held is not None:
        held.set()
        await asyncio.Event().wait()


def test_generated_tokens_are_charged_as_they_arrive():
    clock = FakeClock()
    limiter = TenantLimiter(TenantLimits(max_tokens_per_minute=1000), clock)
    delta = SamplingParams(max_tokens=5, n=2, output_kind=RequestOutputKind.DELTA)
    final = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
    outputs = [
        (0, _output(0, [1, 2], False)),
        (0, _output(1, [1], False)),
        (1, _output(0, [7, 8, 9], True)),
        (0, _output(0, [3, 4, 5], True)),
        (0, _output(1, [2], True)),
    ]

    async def run():
        return [
            item
            async for item in charge_generated_tokens(_replay(outputs), limiter, [delta, final])
        ]

    assert len(asyncio.run(run())) == 5
    assert limiter.tokens.available(clock()) == 1000 - (2 + 1 + 3 + 3 + 1)


def test_a_generation_cut_short_is_charged_its_max_tokens():
    clock = FakeClock()
    limiter = TenantLimiter(TenantLimits(max_tokens_per_minute=1000), clock)
    params = SamplingParams(max_tokens=50, n=2, output_kind=RequestOutputKind.DELTA)
    outputs = [(0, _output(0, [1, 2], False)), (0, _output(1, [3], True))]

    async def run():
        held = asyncio.Event()
        stream = charge_generated_tokens(_replay(outputs, held), limiter, [params])
        task = asyncio.create_task(anext_all(stream))
        await held.wait()  # every output went through: the cut comes mid-generation
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def anext_all(stream):
        async for _ in stream:
            pass

    asyncio.run(run())
    # sample 0: 50 (cut short), sample 1: its 1 token (it finished)
    assert limiter.tokens.available(clock()) == 1000 - 50 - 1


# ---- logs ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path,expected",
    [
        ("/v1/models?api_key=sk-1", f"/v1/models?api_key={REDACTED}"),
        ("/x?a=1&key=sk-1&b=2", f"/x?a=1&key={REDACTED}&b=2"),
        ("/x?access_token=abc;Secret=def", f"/x?access_token={REDACTED};Secret={REDACTED}"),
        ("/x?api%5Fkey=sk-1", f"/x?api%5Fkey={REDACTED}"),
        ("/x?model=a&n=2", "/x?model=a&n=2"),
        ("/v1/models", "/v1/models"),
    ],
)
def test_query_secrets_are_redacted(path, expected):
    assert redact_query_secrets(path) == expected


def test_access_log_filter_redacts_the_formatted_line():
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5", "GET", "/v1/models?api_key=sk-live-123", "1.1", 200), None,
    )  # fmt: skip
    assert RedactQuerySecrets().filter(record)
    assert "sk-live-123" not in record.getMessage()
    assert f"api_key={REDACTED}" in record.getMessage()


# ---- the engine requests of one HTTP request ------------------------------------------------
def test_generations_run_as_the_tenant_with_its_salt_and_budget(tmp_path):
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.serving import OpenAIServing, Prompt
    from pagedllm.entrypoints.openai.tenants import current_tenant

    calls = []

    def process_inputs(
        request_id, prompt, params, priority, tenant=None, lora_request=None, pooling_params=None
    ):
        calls.append((prompt.get("cache_salt"), tenant))
        return None, SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"])

    async def generate(_text, _request):
        yield _output(0, [5, 6], True)

    serving = OpenAIServing.__new__(OpenAIServing)
    serving.engine = SimpleNamespace(process_inputs=process_inputs, generate=generate)
    serving.admit = lambda processed: None
    path = tmp_path / "keys"
    path.write_text("alice sk-alice max_tokens_per_minute=100\n")
    clock = FakeClock()
    alice = TenantRegistry([], str(path), clock=clock).authenticate("Bearer sk-alice")
    prompts = [Prompt(None, [1, 2, 3]), Prompt(None, [4])]
    params = [SamplingParams(max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY)] * 2
    request = SimpleNamespace(cache_salt="mine", priority=0, model="m")

    async def run():
        context = current_tenant.set(alice)
        try:
            results = serving.generations("r", prompts, params, request)
            return [item async for item in results]
        finally:
            current_tenant.reset(context)

    assert len(asyncio.run(run())) == 2
    assert calls == [("tenant:alice|mine", "alice")] * 2
    assert alice.limiter.tokens.available(clock()) == 100 - 4 - 2 * 2  # prompts + generated


def test_a_bad_keys_file_stops_serve_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from pagedllm.entrypoints import cli

    def never(*_):
        raise AssertionError("the server started")

    monkeypatch.setattr("pagedllm.entrypoints.openai.api_server.run_server", never)
    path = tmp_path / "keys"
    path.write_text("alice sk-secret-1\nalice sk-secret-2\n")
    assert cli.main(["serve", "--api-keys-file", str(path)]) == 2
    message = capsys.readouterr().err
    assert "the tenant name 'alice' is used twice" in message and "secret" not in message
    assert cli.main(["serve", "--api-key", "sk-a", "--tenant-max-tokens-per-minute", "0"]) == 2
    assert "max_tokens_per_minute must be an integer >= 1" in capsys.readouterr().err
