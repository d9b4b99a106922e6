"""Cluster resolvers: ClusterSpec, TF_CONFIG, torchrun, simple, SLURM, and selection."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from distribute.cluster_resolver import (
    ClusterResolver,
    ClusterSpec,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    expand_hostlist,
    expand_tasks_per_node,
    resolve_cluster,
)
from distribute.cluster_resolver.cluster_spec import split_host_port
from distribute.errors import InvalidArgumentError

CLUSTER = {
    "chief": ["c0:2222"],
    "worker": ["w0:2222", "w1:2222", "w2:2222"],
    "ps": ["p0:2222", "p1:2222"],
    "evaluator": ["e0:2222"],
}


def tf_config(task_type: str | None = "worker", index: int = 0, **extra: Any) -> dict[str, str]:
    config: dict[str, Any] = {"cluster": extra.pop("cluster", CLUSTER), **extra}
    if task_type is not None:
        config["task"] = {"type": task_type, "index": index}
    return {"TF_CONFIG": json.dumps(config)}


TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "host0",
    "MASTER_PORT": "29500",
    "GROUP_RANK": "1",
}


def slurm(procid: int, nodelist: str, tasks_per_node: str, **extra: str) -> dict[str, str]:
    num_tasks = sum(expand_tasks_per_node(tasks_per_node))
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_STEP_NUM_TASKS": str(num_tasks),
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        **extra,
    }


# ClusterSpec ---------------------------------------------------------------------------


def test_cluster_spec_lists_jobs_sorted_and_tasks_in_order() -> None:
    spec = ClusterSpec(CLUSTER)
    assert spec.jobs == ["chief", "evaluator", "ps", "worker"]
    assert spec.num_tasks("worker") == 3
    assert spec.task_addresses("worker") == ["w0:2222", "w1:2222", "w2:2222"]
    assert spec.task_address("ps", 1) == "p1:2222"
    assert spec.task_indices("worker") == [0, 1, 2]


def test_cluster_spec_as_dict_round_trips_dense_and_sparse_jobs() -> None:
    cluster: dict[str, list[str] | dict[int, str]] = {
        "ps": ["p0:1"],
        "worker": {1: "w1:1", 3: "w3:1"},
    }
    spec = ClusterSpec(cluster)
    assert spec.as_dict() == cluster
    assert ClusterSpec(spec.as_dict()) == spec
    assert spec.task_addresses("worker") == ["w1:1", "w3:1"]
    assert spec.task_indices("worker") == [1, 3]


def test_cluster_spec_dict_with_indices_zero_to_n_is_dense() -> None:
    assert ClusterSpec({"worker": {1: "b:1", 0: "a:1"}}).as_dict() == {"worker": ["a:1", "b:1"]}


def test_cluster_spec_equality_compares_contents() -> None:
    assert ClusterSpec(CLUSTER) == ClusterSpec(dict(CLUSTER))
    assert ClusterSpec(CLUSTER) == ClusterSpec(ClusterSpec(CLUSTER))
    assert ClusterSpec({"worker": ["a:1"]}) != ClusterSpec({"worker": ["b:1"]})
    assert ClusterSpec({"worker": ["a:1"]}) != {"worker": ["a:1"]}


def test_cluster_spec_is_false_only_when_empty() -> None:
    assert not ClusterSpec({})
    assert ClusterSpec({"worker": ["a:1"]})
    assert "worker" in ClusterSpec({"worker": ["a:1"]})
    assert list(ClusterSpec({"worker": ["a:1"], "chief": ["c:1"]})) == ["chief", "worker"]


def test_cluster_spec_unknown_job_error_lists_the_jobs() -> None:
    with pytest.raises(InvalidArgumentError, match=r"no job 'ps'.*\['worker'\]"):
        ClusterSpec({"worker": ["a:1"]}).num_tasks("ps")


def test_cluster_spec_unknown_task_index_error_lists_the_indices() -> None:
    with pytest.raises(InvalidArgumentError, match=r"no task 2.*\[0, 1\]"):
        ClusterSpec({"worker": ["a:1", "b:1"]}).task_address("worker", 2)


@pytest.mark.parametrize(
    "cluster, match",
    [
        ({"": ["a:1"]}, "job names must be non-empty strings"),
        ({"worker": "a:1"}, "must map to a list"),
        ({"worker": [1234]}, "addresses must be strings"),
        ({"worker": {-1: "a:1"}}, "task indices must be non-negative ints"),
        (["worker"], "expects a dict"),
    ],
)
def test_cluster_spec_rejects_malformed_clusters(cluster: Any, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        ClusterSpec(cluster)


def test_cluster_spec_copies_its_input() -> None:
    cluster = {"worker": ["a:1"]}
    spec = ClusterSpec(cluster)
    cluster["worker"].append("b:1")
    assert spec.num_tasks("worker") == 1


def test_split_host_port_parses_hostnames_ipv4_and_bracketed_ipv6() -> None:
    assert split_host_port("w0:2222") == ("w0", 2222)
    assert split_host_port("10.0.0.1:1") == ("10.0.0.1", 1)
    assert split_host_port("[::1]:65535") == ("::1", 65535)


@pytest.mark.parametrize("address", ["w0", "w0:", ":2222", "w0:http", "w0:0", "w0:70000", "::1:2"])
def test_split_host_port_rejects_addresses_without_a_valid_host_and_port(address: str) -> None:
    with pytest.raises(InvalidArgumentError, match="must be 'host:port'"):
        split_host_port(address)


# TFConfigClusterResolver -----------------------------------------------------------------


def test_tf_config_resolver_reads_cluster_and_task() -> None:
    resolver = TFConfigClusterResolver(environ=tf_config("worker", 1))
    assert resolver.cluster_spec() == ClusterSpec(CLUSTER)
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert isinstance(resolver.task_id, int)


@pytest.mark.parametrize(
    "task_type, index, rank", [("chief", 0, 0), ("worker", 0, 1), ("worker", 2, 3)]
)
def test_tf_config_rank_puts_the_chief_first_then_workers(
    task_type: str, index: int, rank: int
) -> None:
    assert TFConfigClusterResolver(environ=tf_config(task_type, index)).rank == rank


def test_tf_config_rank_without_chief_is_the_worker_index() -> None:
    environ = tf_config("worker", 1, cluster={"worker": ["a:1", "b:1"]})
    resolver = TFConfigClusterResolver(environ=environ)
    assert (resolver.rank, resolver.world_size) == (1, 2)


def test_tf_config_world_size_counts_chief_and_workers_not_ps_or_evaluator() -> None:
    assert TFConfigClusterResolver(environ=tf_config("ps", 0)).world_size == 4


@pytest.mark.parametrize("task_type", ["ps", "evaluator"])
def test_tf_config_rank_of_ps_or_evaluator_task_raises(task_type: str) -> None:
    resolver = TFConfigClusterResolver(environ=tf_config(task_type, 0))
    with pytest.raises(InvalidArgumentError, match="chief and worker tasks only"):
        _ = resolver.rank


def test_tf_config_rendezvous_is_the_chief() -> None:
    resolver = TFConfigClusterResolver(environ=tf_config("worker", 2))
    assert (resolver.master_addr, resolver.master_port) == ("c0", 2222)


def test_tf_config_rendezvous_is_worker_zero_without_chief() -> None:
    environ = tf_config("worker", 1, cluster={"worker": ["a:1111", "b:2222"], "ps": ["p:3"]})
    resolver = TFConfigClusterResolver(environ=environ)
    assert (resolver.master_addr, resolver.master_port) == ("a", 1111)


def test_tf_config_master_is_this_tasks_address_with_optional_rpc_layer() -> None:
    resolver = TFConfigClusterResolver(environ=tf_config("worker", 1))
    assert resolver.master() == "w1:2222"
    assert resolver.master("ps", 1) == "p1:2222"
    assert resolver.master(rpc_layer="grpc") == "grpc://w1:2222"


def test_tf_config_rpc_layer_and_environment_come_from_tf_config_unless_given() -> None:
    environ = tf_config("worker", 0, rpc_layer="grpc", environment="cloud")
    resolver = TFConfigClusterResolver(environ=environ)
    assert (resolver.rpc_layer, resolver.environment) == ("grpc", "cloud")
    assert resolver.master() == "grpc://w0:2222"
    other = TFConfigClusterResolver(rpc_layer="tcp", environment="local", environ=environ)
    assert (other.rpc_layer, other.environment) == ("tcp", "local")


def test_tf_config_is_re_read_on_each_call() -> None:
    environ = dict(tf_config("worker", 0))
    resolver = TFConfigClusterResolver(environ=environ)
    assert resolver.rank == 1
    environ.update(tf_config("worker", 2))
    assert (resolver.task_id, resolver.rank) == (2, 3)


def test_tf_config_constructor_task_overrides_tf_config() -> None:
    resolver = TFConfigClusterResolver(task_type="chief", task_id=0, environ=tf_config("ps", 1))
    assert (resolver.task_type, resolver.task_id, resolver.rank) == ("chief", 0, 0)


def test_tf_config_override_outside_the_cluster_raises() -> None:
    resolver = TFConfigClusterResolver(task_id=7, environ=tf_config("worker", 0))
    with pytest.raises(InvalidArgumentError, match="task index 7 is out of range"):
        _ = resolver.task_id


def test_tf_config_unset_gives_an_empty_single_worker_cluster() -> None:
    resolver = TFConfigClusterResolver(environ={})
    assert resolver.cluster_spec() == ClusterSpec({})
    assert (resolver.task_type, resolver.task_id, resolver.master()) == (None, None, "")
    assert (resolver.rank, resolver.world_size) == (0, 1)
    assert (resolver.local_rank, resolver.local_world_size) == (0, 1)


def test_tf_config_rendezvous_of_an_empty_cluster_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="no chief or worker task"):
        _ = TFConfigClusterResolver(environ={}).master_addr


def test_tf_config_cluster_without_task_has_unknown_rank() -> None:
    resolver = TFConfigClusterResolver(environ=tf_config(None))
    assert resolver.task_type is None
    with pytest.raises(InvalidArgumentError, match="task is unknown"):
        _ = resolver.rank


def test_tf_config_malformed_json_raises_naming_tf_config() -> None:
    resolver = TFConfigClusterResolver(environ={"TF_CONFIG": '{"cluster": '})
    with pytest.raises(InvalidArgumentError, match=r"TF_CONFIG.*not valid JSON"):
        resolver.cluster_spec()


@pytest.mark.parametrize(
    "config, match",
    [
        ([1, 2], "must be a JSON object"),
        ({"cluster": ["a:1"]}, '"cluster" must be an object'),
        ({"cluster": {"worker": "a:1"}}, "must be a list"),
        ({"cluster": {"worker": {"x": "a:1"}}}, "task indices must be non-negative integers"),
        ({"cluster": {"chief": ["a:1", "b:1"]}}, "at most one chief"),
        ({"task": "worker"}, '"task" must be an object'),
        ({"cluster": {"worker": ["a:1"]}, "task": {"index": 0}}, 'task "type" must be'),
        ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}, '"index" must be'),
        (
            {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}},
            '"index" must be',
        ),
        ({"cluster": {"worker": ["a:1"]}, "rpc_layer": 3}, '"rpc_layer" must be a string'),
        ({"cluster": {"worker": ["a:1"]}, "environment": 3}, '"environment" must be'),
    ],
)
def test_tf_config_of_the_wrong_shape_raises(config: Any, match: str) -> None:
    resolver = TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps(config)})
    with pytest.raises(InvalidArgumentError, match=match):
        resolver.cluster_spec()


def test_tf_config_address_without_port_raises() -> None:
    environ = tf_config("worker", 0, cluster={"worker": ["w0:2222", "w1"]})
    with pytest.raises(InvalidArgumentError, match=r"TF_CONFIG's worker 1.*'w1'.*w1:2222"):
        TFConfigClusterResolver(environ=environ).cluster_spec()


def test_tf_config_task_type_missing_from_cluster_raises() -> None:
    environ = tf_config("ps", 0, cluster={"worker": ["a:1"]})
    with pytest.raises(InvalidArgumentError, match=r"'ps' is not in the cluster.*\['worker'\]"):
        _ = TFConfigClusterResolver(environ=environ).task_type


def test_tf_config_task_index_out_of_range_raises() -> None:
    with pytest.raises(InvalidArgumentError, match=r"index 3 is out of range.*\[0, 1, 2\]"):
        _ = TFConfigClusterResolver(environ=tf_config("worker", 3)).rank


def test_tf_config_evaluator_may_be_missing_from_the_cluster() -> None:
    environ = tf_config("evaluator", 0, cluster={"worker": ["a:1"]})
    resolver = TFConfigClusterResolver(environ=environ)
    assert (resolver.task_type, resolver.world_size) == ("evaluator", 1)


def test_tf_config_index_given_as_a_digit_string_becomes_an_int() -> None:
    config = {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": "1"}}
    resolver = TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps(config)})
    assert resolver.task_id == 1


def test_tf_config_sparse_job_uses_its_indices() -> None:
    config = {
        "cluster": {"worker": {"0": "a:1", "2": "c:1"}},
        "task": {"type": "worker", "index": 2},
    }
    resolver = TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps(config)})
    assert (resolver.rank, resolver.world_size, resolver.master()) == (1, 2, "c:1")


def test_tf_config_local_rank_counts_training_tasks_on_the_same_host() -> None:
    cluster = {"chief": ["h0:1"], "worker": ["h0:2", "h1:1", "h0:3"], "ps": ["h0:9"]}
    resolver = TFConfigClusterResolver(environ=tf_config("worker", 2, cluster=cluster))
    assert (resolver.local_rank, resolver.local_world_size) == (2, 3)
    ps = TFConfigClusterResolver(environ=tf_config("ps", 0, cluster=cluster))
    assert (ps.local_rank, ps.local_world_size) == (0, 1)


def test_tf_config_default_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", tf_config("worker", 2)["TF_CONFIG"])
    assert TFConfigClusterResolver().rank == 3


def test_num_accelerators_counts_cuda_devices() -> None:
    resolver = TFConfigClusterResolver(environ=tf_config())
    assert resolver.num_accelerators() == {"GPU": torch.cuda.device_count()}


def test_tf_config_non_int_task_id_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="task_id must be an int"):
        TFConfigClusterResolver(task_id="1")  # type: ignore[arg-type]  # the point of the test


# TorchrunClusterResolver ----------------------------------------------------------------


def test_torchrun_resolver_reads_rank_sizes_and_rendezvous() -> None:
    resolver = TorchrunClusterResolver(TORCHRUN)
    assert (resolver.rank, resolver.world_size) == (5, 8)
    assert (resolver.local_rank, resolver.local_world_size) == (1, 4)
    assert (resolver.master_addr, resolver.master_port) == ("host0", 29500)
    assert resolver.group_rank == 1


def test_torchrun_task_is_worker_with_id_equal_to_rank() -> None:
    resolver = TorchrunClusterResolver(TORCHRUN)
    assert (resolver.task_type, resolver.task_id) == ("worker", 5)


def test_torchrun_cluster_spec_has_one_worker_per_rank_rank_zero_at_the_rendezvous() -> None:
    spec = TorchrunClusterResolver(TORCHRUN).cluster_spec()
    assert spec.jobs == ["worker"]
    assert spec.num_tasks("worker") == 8
    assert spec.task_address("worker", 0) == "host0:29500"
    assert spec.task_address("worker", 3) == "worker-3"
    assert TorchrunClusterResolver(TORCHRUN).master(task_id=0, rpc_layer="tcp") == (
        "tcp://host0:29500"
    )


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
def test_torchrun_missing_variable_is_named(missing: str) -> None:
    environ = {k: v for k, v in TORCHRUN.items() if k != missing}
    with pytest.raises(InvalidArgumentError, match=f"but {missing} is unset"):
        TorchrunClusterResolver(environ)


def test_torchrun_lists_every_missing_variable() -> None:
    with pytest.raises(InvalidArgumentError, match="MASTER_ADDR, MASTER_PORT are unset"):
        TorchrunClusterResolver({"RANK": "0", "WORLD_SIZE": "1"})


def test_torchrun_local_variables_default_to_a_single_local_process() -> None:
    environ = {k: v for k, v in TORCHRUN.items() if not k.startswith("LOCAL_")}
    resolver = TorchrunClusterResolver(environ)
    assert (resolver.local_rank, resolver.local_world_size) == (0, 1)


def test_torchrun_rank_not_below_world_size_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="RANK=8 and WORLD_SIZE=8"):
        TorchrunClusterResolver({**TORCHRUN, "RANK": "8"})


def test_torchrun_local_rank_not_below_local_world_size_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="LOCAL_RANK=4 and LOCAL_WORLD_SIZE=4"):
        TorchrunClusterResolver({**TORCHRUN, "LOCAL_RANK": "4"})


def test_torchrun_non_integer_rank_raises_naming_it() -> None:
    with pytest.raises(InvalidArgumentError, match=r"RANK.*'five'"):
        TorchrunClusterResolver({**TORCHRUN, "RANK": "five"})


# SimpleClusterResolver --------------------------------------------------------------------


def test_simple_resolver_derives_rank_world_size_and_rendezvous_from_the_spec() -> None:
    resolver = SimpleClusterResolver(ClusterSpec(CLUSTER), task_type="worker", task_id=2)
    assert (resolver.rank, resolver.world_size) == (3, 4)
    assert (resolver.master_addr, resolver.master_port) == ("c0", 2222)
    assert isinstance(resolver, ClusterResolver)


def test_simple_resolver_accepts_a_dict() -> None:
    resolver = SimpleClusterResolver({"worker": ["a:1", "b:2"]}, task_type="worker", task_id=0)
    assert resolver.cluster_spec() == ClusterSpec({"worker": ["a:1", "b:2"]})
    assert resolver.rank == 0


def test_simple_master_returns_the_given_master_or_a_tasks_address() -> None:
    resolver = SimpleClusterResolver(CLUSTER, master="m:1", rpc_layer="grpc")
    assert resolver.master() == "grpc://m:1"
    assert resolver.master("ps", 0) == "grpc://p0:2222"
    assert resolver.master("ps", 0, rpc_layer="tcp") == "tcp://p0:2222"
    assert SimpleClusterResolver(CLUSTER).master() == ""


def test_simple_resolver_keeps_task_environment_and_rpc_layer() -> None:
    resolver = SimpleClusterResolver(
        CLUSTER, task_type="ps", task_id=1, environment="cloud", rpc_layer="grpc"
    )
    assert (resolver.task_type, resolver.task_id) == ("ps", 1)
    assert (resolver.environment, resolver.rpc_layer) == ("cloud", "grpc")


def test_simple_num_accelerators_is_the_given_dict_else_the_cuda_count() -> None:
    given_ = SimpleClusterResolver(CLUSTER, num_accelerators={"GPU": 2})
    assert given_.num_accelerators() == {"GPU": 2}
    assert SimpleClusterResolver(CLUSTER).num_accelerators() == {"GPU": torch.cuda.device_count()}


def test_simple_negative_num_accelerators_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="counts >= 0"):
        SimpleClusterResolver(CLUSTER, num_accelerators={"GPU": -1})


def test_simple_rank_of_a_task_missing_from_the_spec_raises() -> None:
    resolver = SimpleClusterResolver(CLUSTER, task_type="worker", task_id=9)
    with pytest.raises(InvalidArgumentError, match="no task 9"):
        _ = resolver.rank


# SLURM parsers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("n[1-2],m5", ["n1", "n2", "m5"]),
        ("node[001-003]", ["node001", "node002", "node003"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("node[08-10]", ["node08", "node09", "node10"]),
        ("a[1,3-4]b", ["a1b", "a3b", "a4b"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("login1", ["login1"]),
        ("x[1],y[2-3],z", ["x1", "y2", "y3", "z"]),
        (" gpu-a[1-2].cluster ", ["gpu-a1.cluster", "gpu-a2.cluster"]),
    ],
)
def test_expand_hostlist_expands_ranges_lists_and_products(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    "hostlist", ["", "n[1-2", "n1-2]", "n[[1]]", "n[]", "n[2-1]", "n[a-b]", "n1,", "n[1-]"]
)
def test_expand_hostlist_rejects_malformed_lists(hostlist: str) -> None:
    with pytest.raises(InvalidArgumentError, match="SLURM host list"):
        expand_hostlist(hostlist)


@pytest.mark.parametrize(
    "text, counts",
    [("3(x2),2", [3, 3, 2]), ("4", [4]), ("1,2,3", [1, 2, 3]), ("2(x3)", [2, 2, 2])],
)
def test_expand_tasks_per_node_repeats_counts(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "3(x0)", "3(2)", "x2", "3(x2", "3,,2", "-1"])
def test_expand_tasks_per_node_rejects_malformed_lists(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="tasks-per-node"):
        expand_tasks_per_node(text)


def _compress_hostlist(hosts: list[tuple[str, int, int]]) -> str:
    """SLURM syntax for hosts `prefix + number padded to width`, keeping their order."""
    items: list[str] = []
    i = 0
    while i < len(hosts):
        prefix = hosts[i][0]
        entries: list[str] = []
        while i < len(hosts) and hosts[i][0] == prefix:
            _, low, width = hosts[i]
            high = low
            while (
                i + 1 < len(hosts)
                and hosts[i + 1][0] == prefix
                and hosts[i + 1][1] == high + 1
                and f"{high + 1:0{hosts[i + 1][2]}d}" == f"{high + 1:0{width}d}"
            ):
                i += 1
                high += 1
            low_text = f"{low:0{width}d}"
            entries.append(low_text if high == low else f"{low_text}-{high}")
            i += 1
        items.append(f"{prefix}[{','.join(entries)}]")
    return ",".join(items)


host_entries = st.lists(
    st.tuples(
        st.sampled_from(["n", "node", "gpu-", "r1x"]), st.integers(0, 120), st.integers(1, 4)
    ),
    min_size=1,
    max_size=30,
)


@given(host_entries)
def test_expand_hostlist_inverts_slurm_compression(hosts: list[tuple[str, int, int]]) -> None:
    names = [f"{prefix}{number:0{width}d}" for prefix, number, width in hosts]
    assert expand_hostlist(_compress_hostlist(hosts)) == names


@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=5),
    st.lists(st.integers(0, 30), min_size=1, max_size=5),
)
def test_expand_hostlist_expands_two_groups_as_a_product(left: list[int], right: list[int]) -> None:
    text = f"r[{','.join(map(str, left))}]n[{','.join(map(str, right))}]"
    assert expand_hostlist(text) == [f"r{a}n{b}" for a in left for b in right]


def _compress_tasks(counts: list[int]) -> str:
    items: list[str] = []
    i = 0
    while i < len(counts):
        j = i
        while j + 1 < len(counts) and counts[j + 1] == counts[i]:
            j += 1
        repeat = j - i + 1
        items.append(str(counts[i]) if repeat == 1 else f"{counts[i]}(x{repeat})")
        i = j + 1
    return ",".join(items)


@given(st.lists(st.integers(1, 8), min_size=1, max_size=40))
def test_expand_tasks_per_node_inverts_slurm_compression(counts: list[int]) -> None:
    assert expand_tasks_per_node(_compress_tasks(counts)) == counts


# SlurmClusterResolver ------------------------------------------------------------------------


def test_slurm_reference_example_sorts_hosts_and_numbers_ports_per_host() -> None:
    resolver = SlurmClusterResolver(environ=slurm(0, "n[1-2],m5", "3(x2),2"))
    assert resolver.cluster_spec().task_addresses("worker") == [
        "m5:8888",
        "m5:8889",
        "n1:8888",
        "n1:8889",
        "n1:8890",
        "n2:8888",
        "n2:8889",
        "n2:8890",
    ]


def test_slurm_rank_is_procid_with_default_jobs() -> None:
    for procid in range(6):
        resolver = SlurmClusterResolver(environ=slurm(procid, "n[1-2]", "3(x2)"))
        assert (resolver.task_type, resolver.task_id) == ("worker", procid)
        assert (resolver.rank, resolver.world_size) == (procid, 6)


def test_slurm_rendezvous_is_the_first_task_and_master_is_this_task() -> None:
    resolver = SlurmClusterResolver(port_base=9000, environ=slurm(4, "n[1-2]", "3(x2)"))
    assert (resolver.master_addr, resolver.master_port) == ("n1", 9000)
    assert resolver.master() == "n2:9001"
    assert SlurmClusterResolver(rpc_layer="grpc", environ=slurm(1, "n1", "2")).master() == (
        "grpc://n1:8889"
    )


def test_slurm_hosts_sort_naturally_so_node9_precedes_node10() -> None:
    resolver = SlurmClusterResolver(environ=slurm(0, "node[9-10]", "1(x2)"))
    assert resolver.cluster_spec().task_addresses("worker") == ["node9:8888", "node10:8888"]


def test_slurm_local_rank_is_the_index_on_the_host_unless_slurm_localid_is_set() -> None:
    resolver = SlurmClusterResolver(environ=slurm(4, "n[1-2]", "3(x2)"))
    assert (resolver.local_rank, resolver.local_world_size) == (1, 3)
    with_localid = SlurmClusterResolver(environ=slurm(4, "n[1-2]", "3(x2)", SLURM_LOCALID="2"))
    assert with_localid.local_rank == 2


def test_slurm_jobs_are_dealt_in_sorted_job_order_with_chief_rank_zero() -> None:
    jobs = {"worker": 3, "chief": 1}
    chief = SlurmClusterResolver(jobs=jobs, environ=slurm(0, "n[1-2]", "2(x2)"))
    assert chief.cluster_spec().as_dict() == {
        "chief": ["n1:8888"],
        "worker": ["n1:8889", "n2:8888", "n2:8889"],
    }
    assert (chief.task_type, chief.task_id, chief.rank, chief.world_size) == ("chief", 0, 0, 4)
    worker = SlurmClusterResolver(jobs=jobs, environ=slurm(3, "n[1-2]", "2(x2)"))
    assert (worker.task_type, worker.task_id, worker.rank) == ("worker", 2, 3)


def test_slurm_ps_tasks_are_excluded_from_the_training_ranks() -> None:
    jobs = {"ps": 1, "worker": 3}
    worker = SlurmClusterResolver(jobs=jobs, environ=slurm(1, "n[1-2]", "2(x2)"))
    assert (worker.task_type, worker.task_id, worker.rank, worker.world_size) == (
        "worker",
        0,
        0,
        3,
    )
    assert (worker.master_addr, worker.master_port) == ("n1", 8889)
    ps = SlurmClusterResolver(jobs=jobs, environ=slurm(0, "n[1-2]", "2(x2)"))
    with pytest.raises(InvalidArgumentError, match="chief and worker tasks only"):
        _ = ps.rank


def test_slurm_jobs_that_do_not_add_up_to_the_tasks_raise() -> None:
    with pytest.raises(InvalidArgumentError, match="adding up to the step's 4 tasks"):
        SlurmClusterResolver(jobs={"worker": 3}, environ=slurm(0, "n[1-2]", "2(x2)"))


def test_slurm_missing_variables_are_named() -> None:
    with pytest.raises(InvalidArgumentError, match=r"SLURM_STEP_NODELIST.*SLURM_STEP_TASKS"):
        SlurmClusterResolver(environ={"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"})
    with pytest.raises(InvalidArgumentError, match="but SLURM_PROCID is unset"):
        SlurmClusterResolver(
            environ={k: v for k, v in slurm(0, "n1", "2").items() if k != "SLURM_PROCID"}
        )


def test_slurm_job_level_variables_are_used_when_step_variables_are_missing() -> None:
    environ = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "a[1-2]",
        "SLURM_TASKS_PER_NODE": "1(x2)",
    }
    resolver = SlurmClusterResolver(environ=environ)
    assert resolver.master() == "a2:8888"


def test_slurm_tasks_per_node_count_mismatch_with_hosts_raises() -> None:
    environ = {**slurm(0, "n[1-3]", "2(x2)"), "SLURM_STEP_NUM_TASKS": "4"}
    with pytest.raises(InvalidArgumentError, match="gives 2 counts but the node list has 3"):
        SlurmClusterResolver(environ=environ)


def test_slurm_tasks_not_adding_up_to_num_tasks_raise() -> None:
    environ = {**slurm(0, "n[1-2]", "2(x2)"), "SLURM_STEP_NUM_TASKS": "5"}
    with pytest.raises(InvalidArgumentError, match=r"4 tasks on the nodes.*NUM_TASKS=5"):
        SlurmClusterResolver(environ=environ)


def test_slurm_procid_beyond_the_tasks_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="SLURM_PROCID=4"):
        SlurmClusterResolver(environ=slurm(4, "n[1-2]", "2(x2)"))


def test_slurm_duplicate_host_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="more than once"):
        SlurmClusterResolver(environ=slurm(0, "n1,n1", "1(x2)"))


def test_slurm_tasks_per_node_argument_overrides_the_variable() -> None:
    environ = {k: v for k, v in slurm(0, "n[1-2]", "2(x2)").items() if "PER_NODE" not in k}
    as_int = SlurmClusterResolver(tasks_per_node=2, environ=environ)
    assert as_int.cluster_spec().num_tasks("worker") == 4
    as_dict = SlurmClusterResolver(
        tasks_per_node={"n1": 3, "n2": 1}, environ={**environ, "SLURM_PROCID": "3"}
    )
    assert as_dict.master() == "n2:8888"
    with pytest.raises(InvalidArgumentError, match=r"no count for hosts \['n2'\]"):
        SlurmClusterResolver(tasks_per_node={"n1": 4}, environ=environ)


def test_slurm_gpus_are_split_evenly_between_a_hosts_tasks() -> None:
    resolver = SlurmClusterResolver(gpus_per_node=4, environ=slurm(3, "n[1-2]", "2(x2)"))
    assert resolver.gpu_ids == [2, 3]
    assert resolver.num_accelerators() == {"GPU": 2}
    one_each = SlurmClusterResolver(
        gpus_per_node=4, gpus_per_task=1, environ=slurm(1, "n[1-2]", "2(x2)")
    )
    assert one_each.gpu_ids == [1]


def test_slurm_more_gpus_than_a_host_has_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="gpus_per_task=3 GPUs must fit"):
        SlurmClusterResolver(gpus_per_node=4, gpus_per_task=3, environ=slurm(0, "n[1-2]", "2(x2)"))


def test_slurm_default_gpus_per_node_is_the_cuda_device_count() -> None:
    resolver = SlurmClusterResolver(environ=slurm(0, "n1", "2"))
    assert resolver.num_accelerators() == {"GPU": torch.cuda.device_count() // 2}


def test_slurm_auto_set_gpu_without_gpus_is_a_no_op() -> None:
    resolver = SlurmClusterResolver(auto_set_gpu=True, gpus_per_node=0, environ=slurm(0, "n1", "1"))
    assert resolver.gpu_ids == []


def test_slurm_port_beyond_65535_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="port_base"):
        SlurmClusterResolver(port_base=65535, environ=slurm(0, "n1", "2"))


@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=6),
    st.integers(0, 1000),
    st.integers(1000, 60000),
)
def test_slurm_every_task_gets_a_distinct_address_and_its_procid_as_rank(
    counts: list[int], seed: int, port_base: int
) -> None:
    procid = seed % sum(counts)
    hostlist = f"h[{1}-{len(counts)}]"
    environ = slurm(procid, hostlist, _compress_tasks(counts))
    resolver = SlurmClusterResolver(port_base=port_base, environ=environ)
    addresses = resolver.cluster_spec().task_addresses("worker")
    assert len(set(addresses)) == len(addresses) == sum(counts)
    assert resolver.rank == procid
    _, port = split_host_port(resolver.master())
    assert port - port_base == resolver.local_rank < resolver.local_world_size


# resolve_cluster --------------------------------------------------------------------------


def test_resolve_cluster_prefers_torchrun() -> None:
    environ = {**TORCHRUN, **tf_config(), **slurm(0, "n[1-2]", "2(x2)")}
    assert isinstance(resolve_cluster(environ), TorchrunClusterResolver)


def test_resolve_cluster_uses_tf_config_without_torchrun() -> None:
    environ = {**tf_config("worker", 1), **slurm(0, "n[1-2]", "2(x2)"), "RANK": "0"}
    resolver = resolve_cluster(environ)
    assert isinstance(resolver, TFConfigClusterResolver)
    assert resolver.rank == 2


def test_resolve_cluster_skips_a_tf_config_without_cluster() -> None:
    environ = {"TF_CONFIG": json.dumps({"task": {}}), **slurm(1, "n[1-2]", "2(x2)")}
    resolver = resolve_cluster(environ)
    assert isinstance(resolver, SlurmClusterResolver)
    assert resolver.rank == 1


def test_resolve_cluster_ignores_a_single_task_slurm_step() -> None:
    assert resolve_cluster(slurm(0, "n1", "1")) is None


def test_resolve_cluster_returns_none_for_a_single_worker() -> None:
    assert resolve_cluster({}) is None
    assert resolve_cluster({"TF_CONFIG": ""}) is None


def test_resolve_cluster_raises_on_malformed_tf_config() -> None:
    with pytest.raises(InvalidArgumentError, match="TF_CONFIG"):
        resolve_cluster({"TF_CONFIG": "not json"})


def test_resolve_cluster_raises_on_incomplete_torchrun_variables() -> None:
    with pytest.raises(InvalidArgumentError, match="MASTER_ADDR"):
        resolve_cluster({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"})


def test_torchrun_elastic_attempt_keys_the_rendezvous_and_joins_the_agent_store() -> None:
    base = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    elastic = {
        **base,
        "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    resolver = TorchrunClusterResolver(environ=elastic)
    assert resolver.rendezvous_prefix == "torchrun/job7/2/"
    assert resolver.launcher_serves_rendezvous
    plain = TorchrunClusterResolver(environ=base)
    assert plain.rendezvous_prefix == "" and not plain.launcher_serves_rendezvous
