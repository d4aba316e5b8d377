"""The KV tier flags and `--kv-transfer-config`: good values resolve, bad ones are a
`ValueError` naming the setting, and no value raises anything else (hypothesis)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import EngineArgs
from pagedllm.kv_transfer.config import KVTierConfig, KVTransferConfig

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
keys = st.sampled_from(
    ["kv_role", "kv_connector", "kv_ip", "kv_port", "kv_buffer_size",
     "kv_connector_extra_config", "peer", "timeout_s", "other"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(value=st.dictionaries(keys, json_values | st.sampled_from(["kv_consumer", "kv_both"])))
def test_any_transfer_config_parses_or_names_the_problem(value):
    for candidate in (value, json.dumps(value, default=str)):
        try:
            config = KVTransferConfig.parse(candidate)
        except ValueError as error:
            assert "kv_transfer_config" in str(error)
        else:
            assert config.kv_role in ("kv_producer", "kv_consumer", "kv_both")


@settings(max_examples=200, deadline=None)
@given(
    memory=st.none() | st.integers() | st.text(max_size=10) | st.floats(),
    mode=st.text(max_size=10) | st.sampled_from(["swap", "recompute"]),
)
def test_tier_engine_args_parse_or_name_the_problem(memory, mode):
    try:
        args = EngineArgs(kv_offload_memory=memory, preemption_mode=mode)
    except ValueError as error:
        assert "kv_offload_memory" in str(error) or "preemption_mode" in str(error)
    else:
        assert args.preemption_mode in ("swap", "recompute")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"kv_role": "kv_producer"}, "needs kv_connector_extra_config.peer"),
        ({"kv_role": "decode"}, "kv_role must be one of"),
        ({"kv_role": "kv_consumer", "kv_port": 70000}, "kv_port must be an integer"),
        ({"kv_role": "kv_consumer", "kv_port": True}, "kv_port must be an integer"),
        ({"kv_role": "kv_consumer", "kv_connector": "NixlConnector"}, "kv_connector must be"),
        ({"kv_role": "kv_consumer", "kv_rank": 0}, "unknown kv_transfer_config key"),
        (
            {"kv_role": "kv_both", "kv_connector_extra_config": {"peer": "h:1", "timeout_s": 0}},
            "timeout_s must be",
        ),
        ("{not json", "not valid JSON"),
        ({}, "kv_role is required"),
    ],
)
def test_bad_transfer_configs_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.parse(value)


def test_a_tier_that_stages_in_host_memory_needs_room():
    with pytest.raises(ValueError, match="host tier holds no block"):
        KVTierConfig("id", num_host_blocks=0, preemption_mode="swap")
    assert KVTierConfig("id", num_host_blocks=0, disk_dir=None).enabled is False
