"""`distribute._env`: the one reader of environment variables."""

from __future__ import annotations

import dataclasses
import os

import pytest

from distribute._env import Environment, read_environment
from distribute.errors import InvalidArgumentError

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "host0",
    "MASTER_PORT": "29500",
    "GROUP_RANK": "1",
}


def test_torchrun_variables_are_parsed_as_ints_and_strings() -> None:
    env = read_environment(TORCHRUN)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 8, 1, 2)
    assert (env.master_addr, env.master_port, env.group_rank) == ("host0", 29500, 1)


def test_unset_variables_are_none() -> None:
    env = read_environment({})
    assert env == Environment()
    assert all(getattr(env, f.name) is None for f in dataclasses.fields(Environment))


@pytest.mark.parametrize(
    "name", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "SLURM_PROCID", "SLURM_LOCALID"]
)
def test_non_integer_value_raises_naming_the_variable_and_value(name: str) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"{name}.*'two'"):
        read_environment({name: "two"})


def test_negative_integer_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="RANK must be a non-negative integer"):
        read_environment({"RANK": "-1"})


def test_empty_integer_variable_counts_as_unset() -> None:
    assert read_environment({"RANK": "", "WORLD_SIZE": "  "}).rank is None


def test_surrounding_whitespace_is_ignored() -> None:
    env = read_environment({"RANK": " 2 ", "MASTER_ADDR": " h "})
    assert (env.rank, env.master_addr) == (2, "h")


@pytest.mark.parametrize("port", ["0", "65536"])
def test_master_port_outside_tcp_range_raises(port: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"MASTER_PORT.*{port}"):
        read_environment({"MASTER_PORT": port})


def test_tf_config_is_kept_as_the_raw_string() -> None:
    raw = '{"cluster": {"worker": ["a:1"]}'  # malformed on purpose: not parsed here
    assert read_environment({"TF_CONFIG": raw}).tf_config == raw


def test_slurm_step_variables_are_read() -> None:
    env = read_environment(
        {
            "SLURM_PROCID": "4",
            "SLURM_STEP_NUM_TASKS": "6",
            "SLURM_STEP_NODELIST": "n[1-2]",
            "SLURM_STEP_TASKS_PER_NODE": "3(x2)",
            "SLURM_LOCALID": "1",
        }
    )
    assert (env.slurm_procid, env.slurm_num_tasks, env.slurm_localid) == (4, 6, 1)
    assert (env.slurm_nodelist, env.slurm_tasks_per_node) == ("n[1-2]", "3(x2)")


def test_slurm_job_variables_are_fallbacks_for_missing_step_variables() -> None:
    env = read_environment(
        {"SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "a[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    )
    assert (env.slurm_num_tasks, env.slurm_nodelist, env.slurm_tasks_per_node) == (
        4,
        "a[1-2]",
        "2(x2)",
    )
    assert read_environment({"SLURM_NODELIST": "b1"}).slurm_nodelist == "b1"


def test_slurm_step_variables_take_precedence_over_job_variables() -> None:
    env = read_environment(
        {
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_NTASKS": "8",
            "SLURM_STEP_NODELIST": "step1",
            "SLURM_JOB_NODELIST": "job[1-4]",
            "SLURM_NODELIST": "old[1-4]",
            "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_TASKS_PER_NODE": "2(x4)",
        }
    )
    assert (env.slurm_num_tasks, env.slurm_nodelist, env.slurm_tasks_per_node) == (
        2,
        "step1",
        "2",
    )


def test_device_variables_are_kept_as_strings() -> None:
    env = read_environment(
        {"CUDA_VISIBLE_DEVICES": "0,2", "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    )
    assert (env.cuda_visible_devices, env.pjrt_device, env.cpu_num_devices) == ("0,2", "CPU", "4")


def test_empty_cuda_visible_devices_is_kept_as_no_gpu() -> None:
    assert read_environment({"CUDA_VISIBLE_DEVICES": ""}).cuda_visible_devices == ""


def test_has_torchrun_needs_rank_and_world_size() -> None:
    assert read_environment(TORCHRUN).has_torchrun
    assert not read_environment({"RANK": "0"}).has_torchrun
    assert not read_environment({"WORLD_SIZE": "2"}).has_torchrun


def test_has_tf_config_is_false_for_a_blank_value() -> None:
    assert read_environment({"TF_CONFIG": "{}"}).has_tf_config
    assert not read_environment({"TF_CONFIG": "  "}).has_tf_config
    assert not read_environment({}).has_tf_config


def test_has_slurm_follows_slurm_procid() -> None:
    assert read_environment({"SLURM_PROCID": "0"}).has_slurm
    assert not read_environment({"SLURM_NTASKS": "2"}).has_slurm


def test_environment_is_frozen() -> None:
    env = read_environment({"RANK": "0"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.rank = 1  # type: ignore[misc]  # the point of the test


def test_default_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("WORLD_SIZE", "9")
    env = read_environment()
    assert (env.rank, env.world_size) == (7, 9)


def test_reading_never_writes_os_environ() -> None:
    before = dict(os.environ)
    read_environment()
    read_environment(TORCHRUN)
    assert dict(os.environ) == before
