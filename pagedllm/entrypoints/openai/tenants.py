"""Tenants: who may call the server and under which name; keys never reach a log.

One API key is one tenant. Keys come from `--api-key` (repeatable; its tenants are named
`key-1`, `key-2`, ... in the order given, never after the key), from `--admin-api-key` (the
tenant `admin`) and from `--api-keys-file`, whose lines are `name key [admin] [limit=N ...]`
(limits from `TenantLimits`, `none` for no limit; `#` starts a comment), reloaded on SIGHUP.

An admin tenant may change what every tenant is served (runtime LoRA loads) and see every
tenant's figures (/metrics, /dashboard/data); the others see only their own. A server
without tenants (no keys file, no admin key, at most one `--api-key`) has one user, who is
the admin, as before there were roles. This module owns reading and checking those,
finding the tenant of the key a request presents (in constant time), each tenant's cache
salt, and the access-log filter that hides keys sent in a query string. Keys are found by
their digest in a dictionary (`key_index.py`), and a reload parses the file in a worker
thread, so neither costs the event loop time that grows with the number of tenants.

The server's middleware puts the request's tenant in `current_tenant`; the serving code reads
it from there and runs the request as that tenant (`EngineCoreRequest.tenant`), which is how
the metrics below learn it (`AsyncLLM`'s observer calls carry it).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import urllib.parse
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path

# DEFAULT_TENANT: the tenant of requests on a server that has no API keys.
from pagedllm.core.messages import DEFAULT_TENANT
from pagedllm.entrypoints.openai.key_index import KeyIndex, key_digest
from pagedllm.entrypoints.openai.tenant_limits import Clock, TenantLimiter, TenantLimits
from pagedllm.value_checks import INT64_MAX

logger = logging.getLogger("pagedllm")

# Names become metric labels and log fields: short, plain, and never a key.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# The keys-file column that makes a tenant an admin, and the tenant of `--admin-api-key`.
ADMIN_OPTION = "admin"
ADMIN_TENANT = "admin"


@dataclass(frozen=True)
class TenantSpec:
    """A tenant as configured: its name, a digest of its key (never the key) and its limits."""

    name: str
    key_digest: bytes = field(repr=False)
    limits: TenantLimits
    admin: bool = False


# ---- reading keys --------------------------------------------------------------------------
def tenants_from_api_keys(keys: Iterable[str], defaults: TenantLimits) -> list[TenantSpec]:
    """`--api-key` values, as tenants `key-1`, `key-2`, ... with the default limits."""
    specs = []
    for position, key in enumerate(keys, start=1):
        if not key or key != key.strip():
            raise ValueError(f"api_key: key {position} is empty or has surrounding spaces")
        specs.append(TenantSpec(f"key-{position}", key_digest(key), defaults))
    return specs


def parse_keys_file(text: str, defaults: TenantLimits, source: str) -> list[TenantSpec]:
    """The tenants of a keys file's text; ValueError naming `source` and the line at fault.

    Messages never quote a line: a mistyped line may hold a key in any column.
    """
    specs = []
    for number, line in enumerate(text.splitlines(), start=1):
        columns = line.split()
        comment = next((i for i, column in enumerate(columns) if column.startswith("#")), None)
        columns = columns[:comment]
        if not columns:
            continue
        where = f"api_keys_file: {source}, line {number}"
        if len(columns) < 2:
            raise ValueError(f"{where}: expected 'name key [admin] [limit=N ...]'")
        name, key, *options = columns
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"{where}: the name must be 1-64 letters, digits, '.', '_' or '-' "
                "(starting with a letter or digit)"
            )
        admin = ADMIN_OPTION in options
        options = [option for option in options if option != ADMIN_OPTION]
        limits = defaults.with_overrides(_parse_limits(options, where))
        specs.append(TenantSpec(name, key_digest(key), limits, admin))
    return specs


def _parse_limits(options: list[str], where: str) -> dict[str, int | None]:
    known = TenantLimits.names()
    overrides: dict[str, int | None] = {}
    for column, option in enumerate(options, start=3):
        name, equals, value = option.partition("=")
        if not equals or name not in known:
            raise ValueError(
                f"{where}, column {column}: expected LIMIT=N with LIMIT one of {', '.join(known)}"
            )
        if name in overrides:
            raise ValueError(f"{where}: {name} given twice")
        if value.lower() == "none":
            overrides[name] = None
        elif value.isascii() and value.isdigit() and 1 <= int(value) <= INT64_MAX:
            overrides[name] = int(value)
        else:
            raise ValueError(
                f"{where}: {name} must be an integer >= 1 and <= {INT64_MAX} or 'none'"
            )
    return overrides


def check_unique(specs: list[TenantSpec]) -> None:
    """Every name and every key once (a key shared by two names would be ambiguous)."""
    names: set[str] = set()
    owners: dict[bytes, str] = {}
    for spec in specs:
        if spec.name in names:
            raise ValueError(f"api keys: the tenant name {spec.name!r} is used twice")
        if spec.key_digest in owners:
            raise ValueError(
                f"api keys: tenants {owners[spec.key_digest]!r} and {spec.name!r} have the same key"
            )
        names.add(spec.name)
        owners[spec.key_digest] = spec.name


def load_tenants(
    api_keys: Iterable[str],
    api_keys_file: str | None,
    defaults: TenantLimits,
    admin_api_key: str | None = None,
) -> list[TenantSpec]:
    """Every configured tenant: `--api-key` ones first, then `--admin-api-key`'s, then the
    keys file's, checked."""
    specs = tenants_from_api_keys(api_keys, defaults)
    if admin_api_key is not None:
        if not admin_api_key or admin_api_key != admin_api_key.strip():
            raise ValueError("admin_api_key: the key is empty or has surrounding spaces")
        specs.append(TenantSpec(ADMIN_TENANT, key_digest(admin_api_key), defaults, admin=True))
    if api_keys_file is not None:
        try:
            text = Path(api_keys_file).read_text()
        except OSError as error:
            raise ValueError(
                f"api_keys_file: cannot read {api_keys_file}: {error.strerror}"
            ) from None
        from_file = parse_keys_file(text, defaults, api_keys_file)
        if not from_file:
            raise ValueError(f"api_keys_file: {api_keys_file} holds no keys")
        specs += from_file
    check_unique(specs)
    return specs


# ---- the registry --------------------------------------------------------------------------
@dataclass(frozen=True)
class ActiveTenant:
    """The tenant a request runs as: its name, its limiter, whether its prefix-cache
    entries are kept apart from other tenants', and whether it is an admin."""

    name: str
    limiter: TenantLimiter
    isolate_cache: bool
    admin: bool = False

    def cache_salt(self, client_salt: str | None) -> str | None:
        """The salt of this tenant's requests: a request shares cached KV only with requests
        of the same salt, so folding the tenant in keeps one tenant from timing another's
        cached prompts. Names hold no '|', so no tenant's salt can imitate another's."""
        if not self.isolate_cache:
            return client_salt
        own = f"tenant:{self.name}"
        return own if client_salt is None else f"{own}|{client_salt}"


# The tenant of the request being served (None on routes that need no key).
current_tenant: ContextVar[ActiveTenant | None] = ContextVar("pagedllm_tenant", default=None)


def current_tenant_name() -> str:
    tenant = current_tenant.get()
    return DEFAULT_TENANT if tenant is None else tenant.name


@dataclass(frozen=True)
class _Reload:
    """A keys file read and matched against the tenants in use, ready to swap in; built in a
    worker thread, so that the event loop only applies it."""

    index: KeyIndex[ActiveTenant]
    # Tenants that stay with other limits: updated on the loop, where their limiters are used.
    changed: tuple[tuple[TenantLimiter, TenantLimits], ...]
    added: tuple[str, ...]
    removed: tuple[str, ...]


def current_tenant_is_admin() -> bool:
    """Whether the request being served comes from an admin (False on the open routes)."""
    tenant = current_tenant.get()
    return tenant is not None and tenant.admin


class TenantRegistry:
    """The configured tenants; `authenticate` finds a request's, `reload` re-reads the file.

    With no keys at all every request runs as `DEFAULT_TENANT`, an admin. Requests and the
    swap of a reload run on the event loop, so the swap (one assignment of a new index) needs
    no lock; the file is read and the new index built in a worker thread
    (`reload_in_background`), which only reads the index in use: only the loop replaces it,
    one reload at a time.
    """

    def __init__(
        self,
        api_keys: Iterable[str] = (),
        api_keys_file: str | None = None,
        defaults: TenantLimits | None = None,
        share_prefix_cache: bool = False,
        clock: Clock = time.monotonic,
        admin_api_key: str | None = None,
    ) -> None:
        self.api_keys = tuple(api_keys)
        self.api_keys_file = api_keys_file
        self.defaults = defaults or TenantLimits()
        self.share_prefix_cache = share_prefix_cache
        self.clock = clock
        self.admin_api_key = admin_api_key
        # Without tenants, the one key (or everybody, without keys) is the operator: an admin,
        # as before roles existed. A keys file, an admin key or a second key make tenants,
        # and then only a designated admin is one.
        self.implicit_admin = (
            api_keys_file is None and admin_api_key is None and len(self.api_keys) <= 1
        )
        limiter = TenantLimiter(self.defaults, clock)
        self.default = ActiveTenant(DEFAULT_TENANT, limiter, False, admin=True)
        self._index: KeyIndex[ActiveTenant] = KeyIndex()
        self._install(self._plan(self._load()))
        self._reload_lock = asyncio.Lock()  # one background reload at a time
        self._reload_tasks: set[asyncio.Task[bool]] = set()

    @property
    def requires_key(self) -> bool:
        return bool(self._index)

    @property
    def names(self) -> list[str]:
        return [tenant.name for tenant in self._index]

    @property
    def has_admin(self) -> bool:
        return not self._index or any(tenant.admin for tenant in self._index)

    def _load(self) -> list[TenantSpec]:
        return load_tenants(self.api_keys, self.api_keys_file, self.defaults, self.admin_api_key)

    def authenticate(self, authorization: str | None) -> ActiveTenant | None:
        """The tenant whose key `Authorization: Bearer KEY` carries, else None."""
        if not self._index:
            return self.default
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            return None
        return self._index.find(key)  # by digest: constant time, whatever the number of keys

    def reload(self) -> bool:
        """Re-read the keys file in the caller's thread. A file that fails to load keeps the
        old keys. The server reloads with `reload_in_background` instead."""
        plan = self._read_and_plan()
        return plan is not None and self._apply(plan)

    def reload_in_background(self, on_done: Callable[[bool], None] | None = None) -> None:
        """SIGHUP's handler (on the event loop): reload without blocking the loop, then call
        `on_done` with whether the new keys are in."""
        task = asyncio.get_running_loop().create_task(self.reload_off_loop())
        self._reload_tasks.add(task)  # a task nothing refers to may be collected mid-run
        task.add_done_callback(self._reload_tasks.discard)
        if on_done is not None:
            task.add_done_callback(lambda done: on_done(_reloaded(done)))

    async def reload_off_loop(self) -> bool:
        """Read and parse the keys file in a worker thread, then swap the new keys in on the
        loop at once; requests go on being served with the old keys meanwhile."""
        async with self._reload_lock:  # a second SIGHUP re-reads after this one, not beside
            try:
                plan = await asyncio.to_thread(self._read_and_plan)
            except Exception:  # a bug must not go unseen in a task nobody awaits
                logger.exception("Keeping the old API keys: the reload failed")
                return False
            return plan is not None and self._apply(plan)

    def _read_and_plan(self) -> _Reload | None:
        """The keys file, ready to swap in; None (logged) if there is none or it is bad."""
        if self.api_keys_file is None:
            logger.warning("SIGHUP: no --api-keys-file to reload; keys unchanged")
            return None
        try:
            specs = self._load()
        except ValueError as error:
            logger.error("Keeping the old API keys: %s", error)
            return None
        return self._plan(specs)

    def _plan(self, specs: list[TenantSpec]) -> _Reload:
        # A tenant that stays keeps its limiter: a reload neither refills its budget nor
        # forgets its requests in flight.
        previous = {tenant.name: tenant for tenant in self._index}
        entries, changed = [], []
        for spec in specs:
            admin = spec.admin or self.implicit_admin
            tenant = previous.get(spec.name)
            if tenant is None:
                limiter = TenantLimiter(spec.limits, self.clock)
                tenant = ActiveTenant(spec.name, limiter, not self.share_prefix_cache, admin)
            else:
                if tenant.limiter.limits != spec.limits:
                    changed.append((tenant.limiter, spec.limits))
                if tenant.admin != admin:  # the file's `admin` column changed
                    tenant = replace(tenant, admin=admin)
            entries.append((spec.key_digest, tenant))
        names = {spec.name for spec in specs}
        added = tuple(sorted(names - previous.keys()))
        removed = tuple(sorted(previous.keys() - names))
        return _Reload(KeyIndex(entries), tuple(changed), added, removed)

    def _apply(self, plan: _Reload) -> bool:
        self._install(plan)
        logger.info(
            "Reloaded API keys from %s: %d tenants (added: %s; removed: %s)",
            self.api_keys_file,
            len(plan.index),
            ", ".join(plan.added) or "none",
            ", ".join(plan.removed) or "none",
        )
        return True

    def _install(self, plan: _Reload) -> None:
        """On the loop: only the tenants whose limits changed are touched, then one swap."""
        for limiter, limits in plan.changed:
            limiter.update(limits)
        self._index = plan.index


# ---- logs ----------------------------------------------------------------------------------
_QUERY_PARAM = re.compile(r"([?&;])([^=&;#\s\"]*)=([^&;#\s\"]*)")
_SECRET_NAME = re.compile(r"key|token|secret|passw|auth|signature|credential", re.IGNORECASE)
REDACTED = "[REDACTED]"


def redact_query_secrets(text: str) -> str:
    """`text` with the values of query parameters named like a key or token replaced."""

    def redact(match: re.Match[str]) -> str:
        separator, name, _ = match.groups()
        if _SECRET_NAME.search(urllib.parse.unquote_plus(name)):
            return f"{separator}{name}={REDACTED}"
        return match.group(0)

    return _QUERY_PARAM.sub(redact, text) if "=" in text else text


class RedactQuerySecrets(logging.Filter):
    """On uvicorn's access log, which prints each request's path with its query string: a
    client that sends its key as `?api_key=...` must not leave it in the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                redact_query_secrets(arg) if isinstance(arg, str) else arg for arg in record.args
            )
        elif isinstance(record.msg, str):
            record.msg = redact_query_secrets(record.msg)
        return True


def redact_access_log(logger_name: str = "uvicorn.access") -> None:
    """Install `RedactQuerySecrets` on the access logger (once)."""
    access = logging.getLogger(logger_name)
    if not any(isinstance(f, RedactQuerySecrets) for f in access.filters):
        access.addFilter(RedactQuerySecrets())


def _reloaded(task: asyncio.Task[bool]) -> bool:
    return not task.cancelled() and task.exception() is None and task.result()
