"""The live dashboard: `GET /dashboard` (one self-contained HTML page drawing its charts on
canvases) and `GET /dashboard/data` (the JSON time series it polls each second).

Both sit behind the API key like every route but /health. A browser cannot send a header
when it opens a page, so these two routes alone also take the key as `?key=KEY`
(`DashboardMiddleware` moves it into the Authorization header the guard reads; the access
log redacts it); the page then sends it as a header. The samples come from a
`TimeSeries` that the Prometheus metrics feed (`PrometheusMetrics.follow`), plus the
requests this middleware sees refused (429, 503) on the generation routes. An admin key
reads every tenant's figures; any other key its own (`TimeSeries.snapshot(tenant=...)`).
"""

from __future__ import annotations

import math
import urllib.parse
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.tenants import (
    DEFAULT_TENANT,
    TenantRegistry,
    current_tenant_is_admin,
    current_tenant_name,
)
from pagedllm.metrics.frontend.prometheus import PrometheusMetrics
from pagedllm.metrics.frontend.timeseries import TimeSeries

# The only routes that take the key in the query string.
DASHBOARD_PATHS = frozenset({"/dashboard", "/dashboard/data"})
# Statuses of a request refused before it ran: a tenant limit, or admission / a down engine.
REJECTED_STATUSES = frozenset({429, 503})
# The page's inline script and style are its own; it talks to this server alone, and its URL
# (which may hold the key) goes to nobody.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
}


def install_dashboard(
    app: FastAPI,
    metrics: PrometheusMetrics,
    tenants: TenantRegistry,
    generation_paths: frozenset[str],
) -> TimeSeries:
    """Add the dashboard's routes and its middleware (added after the guard, so it runs
    before it: it sees the guard's refusals and hands it the key). Returns the series (also
    `app.state.timeseries`)."""
    series = TimeSeries()
    metrics.follow(series)
    page = resources.files(__package__).joinpath("static", "dashboard.html").read_text()

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers=PAGE_HEADERS)

    @app.get("/dashboard/data")
    async def dashboard_data(since: str | None = None) -> JSONResponse:
        """The samples after wall time `since` (Unix seconds; all kept ones without it)."""
        tenant = None if current_tenant_is_admin() else current_tenant_name()
        data = series.snapshot(_since(since), tenant)
        return JSONResponse(data, headers={"Cache-Control": "no-store"})

    app.add_middleware(
        DashboardMiddleware, series=series, tenants=tenants, generation_paths=generation_paths
    )
    app.state.timeseries = series
    return series


def _since(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        since = float(value)
    except ValueError:
        since = math.nan
    if not math.isfinite(since) or since < 0:
        raise OpenAIError(400, "since: expected a Unix time in seconds (a number >= 0)", "since")
    return since


class DashboardMiddleware:
    """Hands a dashboard route's `?key=` to the guard as a Bearer header, and counts the
    generation requests answered 429 or 503 (per tenant) as rejected."""

    def __init__(
        self,
        app: ASGIApp,
        series: TimeSeries,
        tenants: TenantRegistry,
        generation_paths: frozenset[str],
    ) -> None:
        self.app = app
        self.series = series
        self.tenants = tenants
        self.generation_paths = generation_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] in DASHBOARD_PATHS:
            scope = _key_from_query(scope)
        elif scope["path"] in self.generation_paths:
            send = self._counting_rejections(scope, send)
        await self.app(scope, receive, send)

    def _counting_rejections(self, scope: Scope, send: Send) -> Send:
        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] in REJECTED_STATUSES:
                # The guard has let go of the tenant by now: found again from the key (only
                # for a refused request, so the common path pays nothing).
                tenant = self.tenants.authenticate(Headers(scope=scope).get("authorization"))
                self.series.on_request_rejected(tenant.name if tenant else DEFAULT_TENANT)
            await send(message)

        return send_counted


def _key_from_query(scope: Scope) -> Scope:
    """`scope` with `?key=` as its Authorization header, unless it sends one already."""
    if any(name == b"authorization" for name, _ in scope["headers"]):
        return scope
    query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
    keys = query.get("key")
    if not keys:
        return scope
    header = (b"authorization", f"Bearer {keys[0]}".encode("latin-1", "replace"))
    return {**scope, "headers": [*scope["headers"], header]}
