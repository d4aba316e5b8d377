"""What the KV tiers and KV transfer are asked to do (vLLM's names), checked on their own.

`KVTransferConfig` is `--kv-transfer-config` (prefill/decode disaggregation);
`KVTierConfig` is what the engine resolved for one rank: the host tier's size in blocks, the
disk tier's folder, the preemption mode, the transfer settings and the identity of the
cache's contents (model, dtypes, block size, layout), which keys the disk tier and is
checked by a peer before it accepts blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pagedllm.value_checks import check_known_keys, json_object

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
PREEMPTION_MODES = ("recompute", "swap")
# vLLM's connector name for this one; "TcpConnector" names the same.
KV_CONNECTORS = ("PagedTcpConnector", "TcpConnector")
# The receive buffer of a consumer without --kv-offload-memory (vLLM's kv_buffer_size: 1e9).
DEFAULT_KV_BUFFER_SIZE = 1_000_000_000
# The host tier that `preemption_mode='swap'` gets without --kv-offload-memory (vLLM's
# swap_space default, 4 GiB).
DEFAULT_SWAP_SPACE = 4 * 1024**3
EXTRA_KEYS = ("peer", "timeout_s")


@dataclass(frozen=True)
class KVTransferConfig:
    """`--kv-transfer-config '{json}'`.

    - `kv_role`: "kv_producer" (prefills and sends each prompt's blocks to `peer`),
      "kv_consumer" (listens on `kv_ip:kv_port` for blocks and serves prompts from them), or
      "kv_both".
    - `kv_connector_extra_config`: `peer` ("host:port" of the consumer a producer sends to)
      and `timeout_s` (how long a send may wait for the consumer's acknowledgement, 5 s).
    - `kv_buffer_size`: bytes of received blocks a consumer holds (its host tier, unless
      --kv-offload-memory is larger).
    """

    kv_role: str
    kv_connector: str = "PagedTcpConnector"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_buffer_size: int = DEFAULT_KV_BUFFER_SIZE
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config.kv_role must be one of {list(KV_ROLES)}, got {self.kv_role!r}"
            )
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config.kv_connector must be one of {list(KV_CONNECTORS)}, "
                f"got {self.kv_connector!r}"
            )
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config.kv_ip must be a host name, got {self.kv_ip!r}")
        _check_int("kv_port", self.kv_port, 0, 65535)
        _check_int("kv_buffer_size", self.kv_buffer_size, 1, 2**50)
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be an object")
        check_known_keys("kv_transfer_config.kv_connector_extra_config key", extra, EXTRA_KEYS)
        if self.sends and not _is_address(extra.get("peer")):
            raise ValueError(
                f"kv_transfer_config: kv_role {self.kv_role!r} sends blocks and needs "
                "kv_connector_extra_config.peer, the consumer's 'host:port'"
            )
        timeout = extra.get("timeout_s", 5.0)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not (0 < timeout <= 600)
        ):
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.timeout_s must be a number of "
                f"seconds in (0, 600], got {timeout!r}"
            )

    @property
    def sends(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def receives(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def peer(self) -> str | None:
        return self.kv_connector_extra_config.get("peer")

    @property
    def timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("timeout_s", 5.0))

    @classmethod
    def parse(cls, value: KVTransferConfig | dict[str, Any] | str | None):
        """From `LLM(kv_transfer_config={...})` or `--kv-transfer-config '{json}'`; None
        stays None. Unknown keys are an error naming them."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = json_object("kv_transfer_config", value)
        check_known_keys("kv_transfer_config key", value, {f.name for f in fields(cls)})
        if "kv_role" not in value:
            raise ValueError(f"kv_transfer_config.kv_role is required (one of {list(KV_ROLES)})")
        return cls(**value)


@dataclass(frozen=True)
class KVTierConfig:
    """The KV tiers of one engine (built by `core/engine_config.py`).

    `num_host_blocks`: blocks the host tier holds (0: none); `disk_dir`: the disk tier's
    folder (None: none); `identity`: a digest of what a block's bytes mean (model, dtypes,
    block size, layout), the disk tier's subfolder and what a peer must match.
    """

    identity: str
    num_host_blocks: int = 0
    disk_dir: str | None = None
    preemption_mode: str = "recompute"
    transfer: KVTransferConfig | None = None

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {list(PREEMPTION_MODES)}, "
                f"got {self.preemption_mode!r}"
            )
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if self.needs_host_tier and self.num_host_blocks < 1:
            raise ValueError(
                "the KV host tier holds no block: raise kv_offload_memory (swap, the disk "
                "tier and a KV consumer stage blocks in host memory)"
            )

    @property
    def swaps(self) -> bool:
        return self.preemption_mode == "swap"

    @property
    def needs_host_tier(self) -> bool:
        """Disk reads, swap and received blocks all land in host memory first."""
        receives = self.transfer is not None and self.transfer.receives
        return self.swaps or self.disk_dir is not None or receives

    @property
    def enabled(self) -> bool:
        return self.num_host_blocks > 0 or self.disk_dir is not None or self.transfer is not None


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(
            f"kv_transfer_config.{name} must be an integer in [{low}, {high}], got {value!r}"
        )


def _is_address(value: object) -> bool:
    if not isinstance(value, str) or value.count(":") != 1:
        return False
    host, port = value.split(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
