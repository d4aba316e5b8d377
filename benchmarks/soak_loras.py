"""The soak's runtime LoRA adapters: random PEFT adapters of the default model written under
the server's `--lora-path-root`, and the admin task that loads and unloads them while tenants
send requests naming the loaded ones.

Every load takes a fresh name (`<adapter>-<n>`), so a name, once unloaded, is never served
again: a request naming it that is answered 404 after its unload is a refusal the soak allows
(`unloaded_since`), and one answered 404 while it was loaded is a failure.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import aiohttp

from benchmarks.lora import write_adapter
from pagedllm.config import EngineArgs
from pagedllm.core.engine_config import load_engine_config
from pagedllm.lora.peft import projection_shapes

ADAPTER_RANK = 8
# The server's flags for them: two in a batch, four kept in memory.
LORA_FLAGS = ["--enable-lora", "--allow-runtime-lora-updating", "--max-loras", "2",
              "--max-cpu-loras", "4", "--max-lora-rank", str(ADAPTER_RANK)]  # fmt: skip
# Adapters served at once: the churn keeps between one and this many loaded.
MAX_LOADED = 3


def write_adapters(root: Path, count: int) -> list[Path]:
    """`count` random adapters of the default model's projections under `root`."""
    _, _, config = load_engine_config(EngineArgs(), log=False)
    shapes = projection_shapes(config.model_config)
    return [write_adapter(root / f"adapter{i}", shapes, ADAPTER_RANK, seed=i) for i in range(count)]


class AdapterPool:
    def __init__(self, base_url: str, admin_key: str, paths: list[Path]) -> None:
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {admin_key}"}
        self.paths = paths
        self.loaded: dict[str, Path] = {}
        self.unloaded_at: dict[str, float] = {}
        self.num_loads = 0
        # (load|unload, HTTP status) → count; anything but 200 is an admin failure.
        self.admin_statuses: Counter[tuple[str, int]] = Counter()
        self.admin_failures: list[str] = []

    def pick(self, rng: random.Random) -> str | None:
        return rng.choice(sorted(self.loaded)) if self.loaded else None

    def unloaded_since(self, name: str, sent_at: float) -> bool:
        """Whether `name` was unloaded after a request naming it was sent at `sent_at`."""
        unloaded = self.unloaded_at.get(name)
        return unloaded is not None and unloaded >= sent_at

    async def load(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        path = rng.choice(self.paths)
        self.num_loads += 1
        name = f"{path.name}-{self.num_loads}"
        body = {"lora_name": name, "lora_path": str(path)}
        if await self._admin(session, "load", body):
            self.loaded[name] = path

    async def unload(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        name = rng.choice(sorted(self.loaded))
        # Unloaded for the clients from the moment it is asked: a request sent after this
        # may be refused, so it is no longer offered.
        del self.loaded[name]
        self.unloaded_at[name] = time.monotonic()
        await self._admin(session, "unload", {"lora_name": name})

    async def _admin(self, session: aiohttp.ClientSession, op: str, body: dict) -> bool:
        url = f"{self.base_url}/v1/{op}_lora_adapter"
        try:
            async with session.post(url, json=body, headers=self.headers) as reply:
                text = await reply.text()
                self.admin_statuses[(op, reply.status)] += 1
                if reply.status != 200:
                    self.admin_failures.append(f"{op} {body}: HTTP {reply.status} {text[:200]}")
                return reply.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            self.admin_statuses[(op, 0)] += 1
            self.admin_failures.append(f"{op} {body}: {type(error).__name__}: {error}")
            return False

    async def churn(self, deadline: float, every_s: float, seed: int) -> None:
        """Every `every_s`: load one when fewer than two are served, else unload one, and
        load one when under `MAX_LOADED`."""
        rng = random.Random(seed)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            while time.monotonic() + every_s < deadline:
                await asyncio.sleep(every_s)
                if len(self.loaded) >= 2:
                    await self.unload(session, rng)
                if len(self.loaded) < MAX_LOADED:
                    await self.load(session, rng)

    def report(self) -> dict:
        return {
            "loads": self.num_loads,
            "unloads": len(self.unloaded_at),
            "admin_statuses": {
                f"{op} {status}": n for (op, status), n in self.admin_statuses.items()
            },
            "admin_failures": self.admin_failures[:10],
        }
