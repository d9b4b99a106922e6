"""DeviceMesh, TensorLayout and LayoutMap (Keras 3's rules), the pure resolution of a
module's variables to layouts, the choice of torch's styles, and the strategy's
refusals that need no process group. No process is started here."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import distribute as ds
from distribute.strategies._layout import (
    map_paths,
    resolve_layouts,
    resolve_output_layouts,
    shard_dims,
    unmatched_keys,
)
from distribute.strategies._layout_hooks import warn_unmatched
from distribute.strategies._tensor_parallel import Style, choose_styles

DeviceMesh = ds.experimental.DeviceMesh
LayoutMap = ds.experimental.LayoutMap
TensorLayout = ds.experimental.TensorLayout


def _map(shape: tuple[int, ...] = (2, 4)) -> LayoutMap:
    return LayoutMap(DeviceMesh(shape, ("batch", "model")[: len(shape)]))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(4, 8)
        self.down = torch.nn.Linear(8, 4)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.register_buffer("scale", torch.ones(4))


# -- DeviceMesh ------------------------------------------------------------------------------


def test_a_mesh_names_its_axes_and_counts_its_devices() -> None:
    mesh = DeviceMesh((2, 4), ("batch", "model"))
    assert mesh.shape == (2, 4) and mesh.axis_names == ("batch", "model")
    assert mesh.size == 8 and mesh.axis_size("model") == 4 and mesh.devices is None


@pytest.mark.parametrize(
    "shape, names, devices, message",
    [
        ((2, 4), ("batch",), None, "one name per axis"),
        ((2, 0), ("batch", "model"), None, "at least 1"),
        ((2, 2), ("x", "x"), None, "differ"),
        ((2, 2), ("batch", "model"), ["cpu"] * 3, "holds 4 devices, but 3 were given"),
    ],
)
def test_a_malformed_mesh_is_refused_saying_what_it_expected(
    shape: tuple[int, ...], names: tuple[str, ...], devices: list[str] | None, message: str
) -> None:
    with pytest.raises(ds.errors.InvalidArgumentError, match=message):
        DeviceMesh(shape, names, devices)


# -- LayoutMap: Keras's lookup -----------------------------------------------------------------


def test_a_path_gets_the_layout_of_the_one_key_that_fullmatches_it() -> None:
    layout_map = _map()
    layout_map[r"blocks\.\d+\.up\.weight"] = ("model", None)
    layout_map[r".*down\.bias"] = TensorLayout(("model",))
    assert layout_map["blocks.1.up.weight"] == TensorLayout(("model", None), layout_map.device_mesh)
    assert layout_map["blocks.0.down.bias"].axes == ("model",)
    assert layout_map["blocks.0.up.weight"].device_mesh is layout_map.device_mesh


def test_a_key_matching_part_of_a_path_lays_out_nothing_as_keras_3_14() -> None:
    """keras-team/keras#22164: keys match the whole path; the old re.search keys get '.*'."""
    layout_map = _map()
    layout_map[r"up\.weight"] = ("model", None)
    layout_map[r"blocks\.0"] = (None, "model")
    assert layout_map["blocks.7.up.weight"] is None
    assert layout_map["blocks.0.up.weight"] is None
    layout_map[r".*up\.weight"] = ("model", None)
    assert layout_map["blocks.7.up.weight"].axes == ("model", None)


def test_a_path_no_key_matches_has_no_layout() -> None:
    layout_map = _map()
    layout_map[".*up.weight"] = ("model", None)
    assert layout_map["head.weight"] is None
    assert layout_map.get("head.weight", "default") == "default"
    assert "blocks.0.up.weight" not in layout_map and ".*up.weight" in layout_map


def test_an_exact_key_wins_over_regexes_that_also_match() -> None:
    layout_map = _map()
    layout_map["up.weight"] = ("model", None)
    layout_map["up.*"] = (None, "model")
    assert layout_map["up.weight"].axes == ("model", None)
    assert layout_map["up.bias"].axes == (None, "model")


def test_a_path_two_keys_match_is_refused_naming_the_path_and_both_keys() -> None:
    layout_map = _map()
    layout_map[r".*up\.weight"] = ("model", None)
    layout_map[r"blocks\.0\..*"] = (None, "model")
    with pytest.raises(ValueError, match="several LayoutMap keys") as info:
        layout_map["blocks.0.up.weight"]
    message = str(info.value)
    assert "'blocks.0.up.weight'" in message
    assert r".*up\\.weight" in message and r"blocks\\.0\\..*" in message
    assert isinstance(info.value, ds.errors.DistributeError)


def test_a_layout_naming_an_unknown_axis_is_refused_naming_the_key_and_layout() -> None:
    layout_map = _map()
    with pytest.raises(ValueError, match="'modle'") as info:
        layout_map["up.weight"] = ("modle", None)
    assert "up.weight" in str(info.value) and "('batch', 'model')" in str(info.value)


def test_keys_are_set_once_and_values_must_be_layouts() -> None:
    layout_map = _map()
    layout_map["up.weight"] = ("model", None)
    with pytest.raises(ValueError, match="already set"):
        layout_map["up.weight"] = (None, "model")
    with pytest.raises(ValueError, match="TensorLayout or a tuple"):
        layout_map["down.weight"] = "model"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="regular expression"):
        layout_map["up.(weight"] = ("model", None)
    del layout_map["up.weight"]
    assert len(layout_map) == 0


def test_a_layout_names_each_axis_once() -> None:
    with pytest.raises(ValueError, match="at most once"):
        TensorLayout(("model", "model"))


# -- resolving a module ------------------------------------------------------------------------


def test_every_parameter_and_buffer_resolves_to_its_layout_or_none() -> None:
    layout_map = _map()
    layout_map[r".*up\.weight"] = ("model", None)
    layout_map[r".*up\.bias"] = ("model",)
    layout_map[r".*down\.weight"] = (None, "model")
    resolved = resolve_layouts(layout_map, Net())
    assert resolved["blocks.1.up.weight"].axes == ("model", None)
    assert resolved["blocks.0.up.bias"].axes == ("model",)
    assert resolved["blocks.0.down.bias"] is None
    assert resolved["embed.weight"] is None and resolved["scale"] is None
    assert list(resolved)[-1] == "scale"  # buffers after parameters


def test_a_layout_of_the_wrong_rank_is_refused_naming_the_variable_and_the_layout() -> None:
    layout_map = _map()
    layout_map[r"blocks\.0\.up\.weight"] = ("model",)
    with pytest.raises(ValueError, match=r"'blocks\.0\.up\.weight'") as info:
        resolve_layouts(layout_map, Net())
    message = str(info.value)
    assert "('model',)" in message and "2 dimensions" in message and "(8, 4)" in message


def test_tied_paths_must_agree_on_their_layout() -> None:
    net = Net()
    net.head.weight = net.embed.weight  # (10, 4) both
    layout_map = _map()
    layout_map[r"^embed\.weight$"] = ("model", None)
    with pytest.raises(ValueError, match="tied"):
        resolve_layouts(layout_map, net)
    layout_map[r"^head\.weight$"] = ("model", None)
    assert resolve_layouts(layout_map, net)["head.weight"].axes == ("model", None)


def test_shard_dims_gives_the_split_dimension_per_mesh_axis() -> None:
    assert shard_dims(TensorLayout(("model", None)), ("model",)) == (0,)
    assert shard_dims(TensorLayout((None, "y", "x")), ("x", "y")) == (2, 1)
    assert shard_dims(None, ("model",)) == (None,)


# -- torch's styles, recognised from the map ---------------------------------------------------


def test_column_then_row_parallel_linears_and_embeddings_get_torch_s_styles() -> None:
    layout_map = _map()
    layout_map[r".*up\.weight"] = ("model", None)
    layout_map[r".*up\.bias"] = ("model",)
    layout_map[r".*down\.weight"] = (None, "model")
    layout_map[r"embed\.weight"] = ("model", None)
    net = Net()
    styles = choose_styles(net, resolve_layouts(layout_map, net), ("model",))
    assert styles == {
        "embed": Style.ROWWISE,
        "blocks.0.up": Style.COLWISE,
        "blocks.0.down": Style.ROWWISE,
        "blocks.1.up": Style.COLWISE,
        "blocks.1.down": Style.ROWWISE,
    }


def test_other_layouts_fall_back_to_dtensor_propagation() -> None:
    layout_map = _map()
    layout_map[r".*up\.weight"] = ("model", None)  # its bias left whole: not torch's colwise
    layout_map[r".*down\.bias"] = ("model",)  # a row-parallel bias split: not torch's
    layout_map[r".*down\.weight"] = (None, "model")
    net = Net()
    resolved = resolve_layouts(layout_map, net)
    styles = choose_styles(net, resolved, ("model",))
    assert set(styles.values()) == {Style.PROPAGATE}
    # A mesh with two model axes has no torch style at all.
    layout_map = LayoutMap(DeviceMesh((1, 2, 2), ("batch", "x", "y")))
    layout_map[r".*up\.weight"] = ("x", "y")
    resolved = resolve_layouts(layout_map, net)
    assert set(choose_styles(net, resolved, ("x", "y")).values()) == {Style.PROPAGATE}


def test_a_tied_weight_propagates_rather_than_taking_a_style() -> None:
    net = Net()
    net.head.weight = net.embed.weight
    layout_map = _map()
    layout_map[r"(embed|head)\.weight"] = ("model", None)
    styles = choose_styles(net, resolve_layouts(layout_map, net), ("model",))
    assert styles == {"embed": Style.PROPAGATE, "head": Style.PROPAGATE}


# -- refusals at construction (before any process group) -----------------------------------------


def test_a_mesh_whose_size_is_not_the_number_of_workers_names_both_numbers() -> None:
    layout_map = _map((1, 2))
    with pytest.raises(ValueError, match="holds 2 devices but the cluster has 1 worker") as info:
        ds.experimental.ModelParallelStrategy(layout_map)
    assert "--nproc_per_node=2" in str(info.value)


def test_several_local_replicas_per_worker_are_refused() -> None:
    layout_map = LayoutMap(DeviceMesh((1, 2), ("batch", "model"), devices=["cpu:0", "cpu:1"]))
    with pytest.raises(ValueError, match="one process per") as info:
        ds.experimental.ModelParallelStrategy(layout_map)
    assert "2 devices" in str(info.value) and "1 worker" in str(info.value)


def test_an_unknown_batch_dim_name_and_a_wrong_map_are_refused() -> None:
    with pytest.raises(ValueError, match="'data' is not an axis"):
        ds.experimental.ModelParallelStrategy(_map((1, 1)), batch_dim_name="data")
    with pytest.raises(ValueError, match=r"needs a ds\.experimental\.LayoutMap"):
        ds.experimental.ModelParallelStrategy({"up": ("model", None)})  # type: ignore[arg-type]


# -- ds.Model paths and keys that match nothing --------------------------------------------------


def test_a_network_wrapped_in_ds_model_resolves_under_its_own_paths() -> None:
    layout_map = _map()
    layout_map[r"blocks\.\d+\.up\.weight"] = ("model", None)
    layout_map["embed.weight"] = (None, "model")
    bare = resolve_layouts(layout_map, Net())
    wrapped = resolve_layouts(layout_map, ds.Model(Net()))
    assert {f"module.{k}": v for k, v in bare.items()} == wrapped
    assert wrapped["module.blocks.1.up.weight"].axes == ("model", None)
    assert wrapped["module.embed.weight"].axes == (None, "model")
    assert map_paths(ds.Model(Net())) == map_paths(Net())


def test_keys_that_match_no_variable_are_named_with_the_nearest_paths() -> None:
    layout_map = _map()
    layout_map[r"blocks\.\d+\.up\.weight"] = ("model", None)
    layout_map[r"up\.bias"] = ("model",)  # the old re.search rule: matches nothing now
    layout_map[r"blocks\.\d+\.dwon\.weight"] = (None, "model")  # a typo
    unmatched = unmatched_keys(layout_map, map_paths(Net()))
    assert list(unmatched) == [r"up\.bias", r"blocks\.\d+\.dwon\.weight"]
    assert "blocks.0.up.bias" in unmatched[r"up\.bias"]
    assert unmatched[r"blocks\.\d+\.dwon\.weight"][0].endswith("down.weight")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warn_unmatched(layout_map, map_paths(ds.Model(Net())))
    messages = [str(w.message) for w in record]
    assert len(messages) == 2, messages
    assert r"'up\\.bias' matches no variable" in messages[0] and "'.*'" in messages[0]
    assert "blocks.0.up.bias" in messages[0] and "dwon" in messages[1]


# -- Keras 3's distribution tests, in this library's names ---------------------------------------
# keras/src/distribution/distribution_lib_test.py (DeviceMeshTest, TensorLayoutTest,
# LayoutMapTest, ModelParallelDistributionTest): Keras's "dense/kernel" paths become
# torch's "dense.weight"; ValueError is InvalidArgumentError (a ValueError).

CPUS = [f"cpu:{i}" for i in range(8)]


def test_keras_mesh_creation_with_a_flat_list_or_a_grid_of_devices() -> None:
    mesh = DeviceMesh((4, 2), ["batch", "model"], CPUS)
    assert mesh.shape == (4, 2) and mesh.axis_names == ("batch", "model")
    assert mesh.devices == tuple(CPUS)
    grid = np.array(CPUS).reshape((4, 2))  # as Keras writes it
    assert DeviceMesh((4, 2), ["batch", "model"], grid) == mesh
    nested = [CPUS[i : i + 2] for i in range(0, 8, 2)]
    assert DeviceMesh((4, 2), ["batch", "model"], nested).devices == tuple(CPUS)


def test_keras_mesh_input_validation() -> None:
    devices = CPUS[:4]
    with pytest.raises(ValueError, match="one name per axis"):
        DeviceMesh((4,), "", devices)
    with pytest.raises(ValueError, match="one name per axis"):
        DeviceMesh((4, 2), ["batch"], devices)
    with pytest.raises(ValueError, match="holds 8 devices, but 4 were given"):
        DeviceMesh((4, 2), ["batch", "model"], devices)
    with pytest.raises(ValueError, match=r"grid of devices of shape \(2, 4\)"):
        DeviceMesh((4, 2), ["batch", "model"], np.array(CPUS).reshape((2, 4)))


def test_keras_tensor_layout_creation_and_validation() -> None:
    mesh = DeviceMesh((4, 2), ["data", "model"], CPUS)
    layout = TensorLayout(("data", None), mesh)
    assert layout.device_mesh == mesh and layout.axes == ("data", None)
    with pytest.raises(ValueError, match="'unknown'"):
        TensorLayout(("data", "unknown", None), mesh)
    lazy = TensorLayout(("data", None), None)  # the mesh injected later
    assert lazy.device_mesh is None and lazy.axes == ("data", None)
    lazy.device_mesh = mesh
    assert lazy.device_mesh == mesh and lazy == layout
    late = TensorLayout(("data", "unknown", None), None)
    with pytest.raises(ValueError, match="'unknown'"):
        late.device_mesh = mesh


def test_tensor_layouts_on_different_meshes_differ() -> None:
    first = DeviceMesh((4, 2), ["data", "model"], CPUS)
    second = DeviceMesh((2, 4), ["data", "model"], CPUS)
    assert TensorLayout(("data", None), first) == TensorLayout(("data", None), first)
    assert TensorLayout(("data", None), first) != TensorLayout(("data", None), second)
    assert TensorLayout(("data", None), first) != TensorLayout(("data", None))
    assert TensorLayout(("data", None)) == TensorLayout(("data", None))


def _keras_map() -> tuple[LayoutMap, TensorLayout, TensorLayout, TensorLayout, TensorLayout]:
    layout_map = LayoutMap(DeviceMesh((4, 2), ["data", "model"], CPUS))
    return (
        layout_map,
        TensorLayout([None, "model"]),
        TensorLayout(["model"]),
        TensorLayout([None, None]),
        TensorLayout([None]),
    )


def test_keras_layout_map_add() -> None:
    layout_map, sharded_2d, sharded_1d, _, _ = _keras_map()
    layout_map["dense.weight"] = sharded_2d
    layout_map["dense.bias"] = sharded_1d
    layout_map["conv.bias"] = ("model",)  # a tuple is a TensorLayout
    assert len(layout_map) == 3
    for key, axes in [("dense.weight", (None, "model")), ("dense.bias", ("model",))]:
        assert layout_map[key].axes == axes
        assert layout_map[key].device_mesh is layout_map.device_mesh
    assert layout_map["conv.bias"].axes == ("model",)
    with pytest.raises(ValueError, match="already set"):
        layout_map["dense.weight"] = sharded_2d
    with pytest.raises(ValueError, match="TensorLayout or a tuple"):
        layout_map["conv.weight"] = 3  # type: ignore[assignment]


def test_keras_layout_map_get_with_full_match() -> None:
    layout_map, sharded_2d, sharded_1d, replicated_2d, replicated_1d = _keras_map()
    layout_map["dense.weight"] = sharded_2d
    layout_map["dense.bias"] = sharded_1d
    layout_map[".*dense.*weight"] = replicated_2d
    layout_map[".*dense.*bias"] = replicated_1d
    layout_map[".*bias"] = sharded_1d
    assert layout_map["dense.weight"] == sharded_2d  # exact wins
    assert layout_map["dense.bias"] == sharded_1d
    assert layout_map["dense_2.weight"] == replicated_2d
    with pytest.raises(ValueError, match=r"'dense_2\.bias' matches several LayoutMap keys"):
        layout_map["dense_2.bias"]
    assert layout_map["conv2d.weight"] is None
    assert layout_map["conv2d.bias"] == sharded_1d


def test_keras_layout_map_delete_len_and_iter() -> None:
    layout_map, sharded_2d, sharded_1d, _, _ = _keras_map()
    assert len(layout_map) == 0
    layout_map["dense.weight"] = sharded_2d
    layout_map["dense.bias"] = sharded_1d
    assert len(layout_map) == 2
    assert list(layout_map.keys()) == ["dense.weight", "dense.bias"]  # insertion order
    assert list(layout_map.items()) == [("dense.weight", sharded_2d), ("dense.bias", sharded_1d)]
    assert layout_map.pop("dense.weight") == sharded_2d
    with pytest.raises(KeyError):
        layout_map.pop(".*bias")  # the exact key, not a regex
    del layout_map["dense.bias"]
    assert len(layout_map) == 0


def test_keras_model_parallel_variable_layouts() -> None:
    """ModelParallelDistributionTest.test_distribute_weights: the map's layouts, and a
    variable no key matches is whole (Keras's (None,) is this library's None)."""
    layout_map = LayoutMap(DeviceMesh((2, 4), ["data", "model"], CPUS))
    layout_map[".*weight"] = TensorLayout([None, "model"])
    layout_map[".*bias"] = TensorLayout(["model"])
    net = torch.nn.Linear(8, 4)
    net.register_buffer("seed", torch.tensor([0, 1]))
    resolved = resolve_layouts(layout_map, net)
    assert resolved["weight"].axes == (None, "model")
    assert resolved["weight"].device_mesh is layout_map.device_mesh
    assert resolved["bias"].axes == ("model",)
    assert resolved["seed"] is None
    assert shard_dims(resolved["weight"], ("data", "model")) == (None, 1)


def test_keras_get_tensor_layout_by_path() -> None:
    """ModelParallelDistributionTest.test_get_tensor_layout."""
    layout_map = LayoutMap(DeviceMesh((2, 4), ["data", "model"], CPUS))
    layout_map[".*weight"] = TensorLayout([None, "model"])
    layout_map[".*bias"] = TensorLayout(["model"])
    layout_map["/model/layer/tensor"] = ("data", None)
    layout = layout_map["/model/layer/tensor"]
    assert layout.device_mesh is layout_map.device_mesh and layout.axes == ("data", None)
    assert layout_map["/model/layer/other_tensor"] is None


def test_transformers_conv1d_takes_the_linear_styles_with_its_layouts_transposed() -> None:
    from transformers.pytorch_utils import Conv1D  # weight (in, out)

    mlp = torch.nn.Sequential(Conv1D(8, 4), torch.nn.GELU(), Conv1D(4, 8))
    layout_map = _map()
    layout_map[r"0\.weight"] = (None, "model")
    layout_map[r"0\.bias"] = ("model",)
    layout_map[r"2\.weight"] = ("model", None)
    styles = choose_styles(mlp, resolve_layouts(layout_map, mlp), ("model",))
    assert styles == {"0": Style.COLWISE, "2": Style.ROWWISE}
    linear_layouts = _map()
    linear_layouts[r"0\.weight"] = ("model", None)  # a Linear's column layout: on (in, out)
    resolved = resolve_layouts(linear_layouts, mlp)  # it splits the input: row-parallel
    assert choose_styles(mlp, resolved, ("model",)) == {"0": Style.ROWWISE}
    linear_layouts[r"0\.bias"] = ("model",)  # a split bias under a row split: propagates
    resolved = resolve_layouts(linear_layouts, mlp)
    assert choose_styles(mlp, resolved, ("model",)) == {"0": Style.PROPAGATE}


# -- output layouts (Keras's "<layer path>/output") ----------------------------------------------


def test_an_output_key_names_a_module_s_output_and_no_variable() -> None:
    layout_map = _map()
    layout_map[r"blocks\.\d+/output"] = ("batch", "model", None)
    layout_map[r"blocks\.0\.up/output"] = ("batch", None, "model")
    layout_map[r"blokcs\.\d+/output"] = ("batch", "model", None)  # a typo
    net = Net()
    assert resolve_output_layouts(layout_map, net) == {
        "blocks.0": TensorLayout(("batch", "model", None), layout_map.device_mesh),
        "blocks.0.up": TensorLayout(("batch", None, "model"), layout_map.device_mesh),
        "blocks.1": TensorLayout(("batch", "model", None), layout_map.device_mesh),
    }
    wrapped = resolve_output_layouts(layout_map, ds.Model(net))
    assert sorted(wrapped) == ["module.blocks.0", "module.blocks.0.up", "module.blocks.1"]
    assert all(layout is None for layout in resolve_layouts(layout_map, net).values())
    assert list(unmatched_keys(layout_map, map_paths(net))) == [r"blokcs\.\d+/output"]
