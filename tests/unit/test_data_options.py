"""InputOptions, InputContext and ValueContext: defaults, validation, batch-size arithmetic."""

from __future__ import annotations

import pytest

import distribute as ds
from distribute.data import AutoShardPolicy, InputOptions, InputReplicationMode


def test_input_options_defaults_match_tf():
    options = InputOptions()
    assert options.experimental_fetch_to_device is True
    assert options.experimental_replication_mode is InputReplicationMode.PER_WORKER
    assert options.experimental_place_dataset_on_device is False
    assert options.experimental_per_replica_buffer_size == 1
    assert options.auto_shard_policy is AutoShardPolicy.AUTO


def test_input_names_are_exported_at_top_level():
    assert ds.InputOptions is InputOptions
    assert ds.InputReplicationMode is InputReplicationMode
    assert ds.AutoShardPolicy is AutoShardPolicy
    assert ds.InputContext is ds.data.InputContext
    assert ds.experimental.ValueContext is ds.data.ValueContext


def test_place_dataset_on_device_without_per_replica_raises_value_error():
    with pytest.raises(ValueError, match="PER_REPLICA"):
        InputOptions(experimental_place_dataset_on_device=True, experimental_fetch_to_device=False)


def test_place_dataset_on_device_with_fetch_to_device_raises_value_error():
    with pytest.raises(ValueError, match="experimental_fetch_to_device=False"):
        InputOptions(
            experimental_place_dataset_on_device=True,
            experimental_replication_mode=InputReplicationMode.PER_REPLICA,
        )


def test_place_dataset_on_device_with_per_replica_and_no_fetch_is_accepted():
    options = InputOptions(
        experimental_place_dataset_on_device=True,
        experimental_replication_mode=InputReplicationMode.PER_REPLICA,
        experimental_fetch_to_device=False,
    )
    assert options.experimental_place_dataset_on_device


def test_option_errors_are_distribute_errors():
    with pytest.raises(ds.errors.DistributeError):
        InputOptions(experimental_per_replica_buffer_size=-1)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("per_replica", InputReplicationMode.PER_REPLICA),
        ("PER_WORKER", InputReplicationMode.PER_WORKER),
    ],
)
def test_replication_mode_accepts_enum_names_case_insensitively(value, expected):
    assert (
        InputOptions(experimental_replication_mode=value).experimental_replication_mode is expected
    )


@pytest.mark.parametrize("value", ["file", "DATA", "Off", "auto"])
def test_auto_shard_policy_accepts_enum_names(value):
    assert InputOptions(auto_shard_policy=value).auto_shard_policy is AutoShardPolicy[value.upper()]


def test_bad_replication_mode_string_raises_value_error_listing_choices():
    with pytest.raises(ValueError, match=r"PER_WORKER, PER_REPLICA.*'per_host'"):
        InputOptions(experimental_replication_mode="per_host")


@pytest.mark.parametrize("value", ["SHARD", 3, None])
def test_bad_auto_shard_policy_raises_value_error_listing_choices(value):
    with pytest.raises(ValueError, match="AUTO, FILE, DATA, OFF"):
        InputOptions(auto_shard_policy=value)


def test_negative_buffer_size_raises_value_error():
    with pytest.raises(ValueError, match=r">= 0.*-1"):
        InputOptions(experimental_per_replica_buffer_size=-1)


def test_zero_buffer_size_is_accepted():
    assert (
        InputOptions(experimental_per_replica_buffer_size=0).experimental_per_replica_buffer_size
        == 0
    )


def test_input_options_are_frozen():
    options = InputOptions()
    with pytest.raises(AttributeError):
        options.experimental_fetch_to_device = False  # type: ignore[misc]


def test_input_context_defaults_to_one_pipeline_one_replica():
    ctx = ds.InputContext()
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 1)
    assert ctx.get_per_replica_batch_size(7) == 7


def test_per_replica_batch_size_divides_the_global_batch():
    ctx = ds.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(64) == 16


def test_per_replica_batch_size_not_divisible_raises_value_error_with_counts():
    ctx = ds.InputContext(num_replicas_in_sync=4)
    with pytest.raises(ValueError, match=r"\(10\).*\(4\)"):
        ctx.get_per_replica_batch_size(10)


@pytest.mark.parametrize(("pipelines", "pipeline_id"), [(2, 2), (2, -1), (0, 0)])
def test_input_context_rejects_pipeline_id_out_of_range(pipelines, pipeline_id):
    with pytest.raises(ValueError, match="input_pipeline_id"):
        ds.InputContext(num_input_pipelines=pipelines, input_pipeline_id=pipeline_id)


def test_input_context_rejects_zero_replicas():
    with pytest.raises(ValueError, match="num_replicas_in_sync"):
        ds.InputContext(num_replicas_in_sync=0)


def test_value_context_holds_replica_id_and_count():
    ctx = ds.experimental.ValueContext(3, 4)
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync) == (3, 4)
