"""/dashboard and /dashboard/data on the session server: the API key (header, or `?key=` on
these two routes alone), the JSON's shape after some load, and the page itself in headless
Chromium (Debian's, driven by its chromedriver) drawing that load. Also the Grafana dashboard
and Prometheus config of examples/observability against the metrics the server exports."""

from __future__ import annotations

import http.server
import itertools
import json
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest
import yaml
from process_guard import dies_with_us, dying_with_parent
from server_utils import API_KEY, MODEL, wait_until
from tiers import slow_fixture

from pagedllm.entrypoints.openai import dashboard
from pagedllm.metrics.frontend.prometheus import PrometheusMetrics
from pagedllm.metrics.frontend.timeseries import PERCENTILES
from pagedllm.utils import free_port

OBSERVABILITY = Path(__file__).resolve().parents[2] / "examples" / "observability"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
NUM_REQUESTS = 6
SAMPLE_KEYS = {
    "t", "running", "waiting", "kv_cache_usage", "prompt_tokens_per_s",
    "prompt_tokens_computed_per_s", "generation_tokens_per_s", "prefix_cache_hit_rate",
    "preemptions", "finished", "failed", "aborted", "rejected", "ttft", "tpot", "tenants",
}  # fmt: skip
GENERATION_GREEN = (0x7E, 0xD3, 0x21)  # the page's third palette color: "generation" tokens/s


@pytest.fixture(scope="module")
def loaded(server, client):
    """The session server after NUM_REQUESTS concurrent completions."""
    errors: list[BaseException] = []

    def one(index: int) -> None:
        try:
            client.completions.create(
                model=MODEL, prompt=f"Count to ten, take {index}:", max_tokens=24, temperature=0
            )
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_REQUESTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    # Their last tokens may fall in the second still open: wait until it is a sample.
    finished_at = get(server, "/dashboard/data", headers=server.headers).json()["now"]
    wait_until(lambda: closed_after(server, finished_at), "the last second closed", 10)
    return server


def closed_after(server, when: float) -> bool:
    samples = get(server, "/dashboard/data", headers=server.headers).json()["samples"]
    return bool(samples) and samples[-1]["t"] > when


def get(server, path: str, **kwargs) -> httpx.Response:
    return httpx.get(server.base_url + path, timeout=10, **kwargs)


@pytest.mark.parametrize("path", ["/dashboard", "/dashboard/data"])
def test_dashboard_needs_the_key(server, path):
    assert get(server, path).status_code == 401
    assert get(server, path, params={"key": "sk-wrong"}).status_code == 401
    assert get(server, path, headers=server.headers).status_code == 200
    assert get(server, path, params={"key": API_KEY}).status_code == 200


def test_other_routes_take_the_key_from_the_header_only(server):
    assert get(server, "/v1/models", params={"key": API_KEY}).status_code == 401
    assert get(server, "/metrics", params={"key": API_KEY}).status_code == 401
    assert get(server, "/v1/models", headers=server.headers).status_code == 200


def test_page_is_self_contained(server):
    response = get(server, "/dashboard", params={"key": API_KEY})
    assert response.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in response.headers["content-security-policy"]
    assert response.headers["referrer-policy"] == "no-referrer"
    page = response.text
    for external in ("http://", "https://", "src=", "<link"):
        assert external not in page, external


@pytest.mark.parametrize("since", ["abc", "-1", "nan", "inf"])
def test_bad_since_is_a_400_naming_it(server, since):
    response = get(server, "/dashboard/data", params={"since": since}, headers=server.headers)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "since"


def test_data_after_load(loaded):
    data = get(loaded, "/dashboard/data", headers=loaded.headers).json()
    assert data["interval_s"] == 1 and data["window_s"] == 300
    assert data["percentiles"] == [f"p{p}" for p in PERCENTILES]
    assert data["totals"]["finished"] >= NUM_REQUESTS
    samples = data["samples"]
    assert samples and all(set(sample) >= SAMPLE_KEYS for sample in samples)
    times = [sample["t"] for sample in samples]
    assert all(b - a == pytest.approx(1) for a, b in itertools.pairwise(times))  # each second
    assert sum(s["generation_tokens_per_s"] for s in samples) >= NUM_REQUESTS * 2
    assert max(s["kv_cache_usage"] for s in samples) > 0
    assert max(s["running"] for s in samples) >= 1
    ttfts = [s["ttft"] for s in samples if s["ttft"] is not None]
    assert ttfts and all(0 < t["p50"] <= t["p90"] <= t["p99"] for t in ttfts)
    # The session server's one key is tenant key-1, and its requests are counted under it.
    tenant_finished = sum(s["tenants"]["key-1"]["finished"] for s in samples if s["tenants"])
    assert tenant_finished >= NUM_REQUESTS
    latest = times[-1]
    # Only newer samples (a second may have closed meanwhile).
    newer = get(loaded, "/dashboard/data", params={"since": latest}, headers=loaded.headers)
    assert all(sample["t"] > latest for sample in newer.json()["samples"])


@pytest.fixture
@slow_fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    # chromedriver dies with pytest, and chromium (chromedriver's child) with chromedriver.
    options.binary_location = str(dying_with_parent(CHROMIUM, tmp_path))
    profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=tmp_path)
    for flag in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--window-size=1400,1300", f"--user-data-dir={profile}",
    ):  # fmt: skip
        options.add_argument(flag)
    service = Service(executable_path=CHROMEDRIVER, popen_kw={"preexec_fn": dies_with_us()})
    driver = webdriver.Chrome(options=options, service=service)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def test_page_draws_the_load(loaded, browser, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{loaded.base_url}/dashboard?key={API_KEY}")

    def summary() -> dict:
        return browser.execute_script(
            "return Object.assign({}, document.getElementById('summary').dataset)"
        )

    def drawn(_) -> bool:
        values = summary()
        return bool(values) and float(values["requestsFinished"]) >= NUM_REQUESTS

    WebDriverWait(browser, 30, poll_frequency=0.2).until(drawn)
    values = summary()
    assert float(values["maxGenerationTokensPerS"]) > 0
    assert float(values["maxPromptTokensPerS"]) > 0
    assert float(values["maxKvCacheUsage"]) > 0
    assert float(values["maxRunning"]) >= 1
    tokens = browser.find_element("id", "chart-tokens")
    assert int(tokens.get_attribute("data-points")) > 0
    assert float(tokens.get_attribute("data-max")) > 0
    assert int(browser.find_element("id", "chart-ttft").get_attribute("data-points")) > 0
    # The generation line is on the canvas: pixels of its color, not just numbers in the DOM.
    assert generation_pixels(browser) > 10
    assert browser.find_element("id", "tenant-title").is_displayed()
    screenshot = tmp_path / "dashboard.png"
    browser.save_screenshot(str(screenshot))
    assert screenshot.stat().st_size > 10_000
    print(f"dashboard screenshot: {screenshot}")


def generation_pixels(browser) -> int:
    return browser.execute_script(
        """
        const [r, g, b] = arguments[0];
        const canvas = document.getElementById('chart-tokens');
        const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        let count = 0;
        for (let i = 0; i < data.length; i += 4) {
          if (Math.abs(data[i] - r) < 24 && Math.abs(data[i + 1] - g) < 24
              && Math.abs(data[i + 2] - b) < 24 && data[i + 3] > 200) count++;
        }
        return count;
        """,
        list(GENERATION_GREEN),
    )


def exported_names() -> set[str]:
    """Every series name `/metrics` may show (LoRA on, so `lora_requests_info` is there)."""
    text = PrometheusMetrics("m", 64, max_loras=1).render().decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            names.update(name + suffix for suffix in suffixes)
    return names


def test_grafana_dashboard_charts_exported_metrics():
    dashboard = json.loads((OBSERVABILITY / "grafana.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"pagedllm:[a-z0-9_]+", expr)}
    assert used and used <= exported_names(), used - exported_names()
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Time to first token", "KV cache usage", "Generation tokens/s by tenant"} <= titles


def test_prometheus_config_sends_the_key():
    config = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["type"] == "Bearer" and job["authorization"]["credentials_file"]


def canned_data(now: float) -> dict:
    """/dashboard/data's shape with two tenants, rejections and LoRA adapters."""
    latencies = {"p50": 0.1, "p90": 0.2, "p99": 0.3}
    counts = {"finished": 1, "failed": 0, "aborted": 0}
    adapters = {"sql": {"running": 1, "waiting": 0}, "chat": {"running": 1, "waiting": 1}}
    tenants = {
        name: {"prompt_tokens_per_s": 5, "generation_tokens_per_s": 10 + i, "rejected": i}
        | counts
        | {"ttft": latencies}
        for i, name in enumerate(("alice", "bob"))
    }
    sample = {
        "running": 2,
        "waiting": 1,
        "kv_cache_usage": 0.25,
        "prompt_tokens_per_s": 10,
        "prompt_tokens_computed_per_s": 8,
        "generation_tokens_per_s": 21,
        "prefix_cache_hit_rate": 0.5,
        "preemptions": 0,
        "rejected": 1,
        "ttft": latencies,
        "tpot": None,
        "tenants": tenants,
        "lora_adapters": adapters,
    } | counts
    totals = {"prompt_tokens": 200, "generation_tokens": 420, "rejected": 20, "preemptions": 0}
    return {
        "interval_s": 1,
        "window_s": 300,
        "latency_window_s": 30.0,
        "percentiles": ["p50", "p90", "p99"],
        "now": now,
        "totals": totals | {"finished": 40, "failed": 0, "aborted": 0},
        "samples": [{"t": now - age} | sample for age in range(20, 0, -1)],
    }


@pytest.fixture
def canned_server():
    """The page and fixed data from a plain HTTP server: the page alone, no engine."""
    page = (Path(dashboard.__file__).parent / "static" / "dashboard.html").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/dashboard/data"):
                since = float(self.path.partition("since=")[2] or 0)
                data = canned_data(time.time())
                data["samples"] = [s for s in data["samples"] if s["t"] > since]
                body, kind = json.dumps(data).encode(), "application/json"
            else:
                body, kind = page, "text/html"
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_page_draws_tenants_and_adapters(canned_server, browser):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(canned_server + "/dashboard")
    WebDriverWait(browser, 20, poll_frequency=0.2).until(
        lambda b: b.execute_script("return document.getElementById('chart-lora-running') !== null")
    )

    def points(chart: str) -> int:
        return int(browser.find_element("id", "chart-" + chart).get_attribute("data-points"))

    for chart in ("lora-running", "lora-waiting", "tenant-tokens", "tenant-errors", "errors"):
        assert points(chart) > 0, chart
    legend = browser.execute_script(
        "return document.getElementById('chart-lora-running').parentNode"
        ".querySelector('.legend').textContent"
    )
    assert "chat" in legend and "sql" in legend
    assert browser.find_element("id", "lora-title").is_displayed()
    summary = browser.find_element("id", "summary")
    assert summary.get_attribute("data-requests-rejected") == "20"
    assert float(summary.get_attribute("data-max-kv-cache-usage")) == 0.25
