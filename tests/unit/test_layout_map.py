"""DeviceMesh, TensorLayout and LayoutMap (Keras 3's rules), the pure resolution of a
module's variables to layouts, the choice of torch's styles, and the strategy's
refusals that need no process group. No process is started here."""

from __future__ import annotations

import pytest
import torch

import distribute as ds
from distribute.strategies._layout import resolve_layouts, shard_dims
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


def test_a_path_gets_the_layout_of_the_one_key_that_searches_it() -> None:
    layout_map = _map()
    layout_map[r"blocks\.\d+\.up\.weight"] = ("model", None)
    layout_map["down.bias"] = TensorLayout(("model",))
    assert layout_map["blocks.1.up.weight"] == TensorLayout(("model", None))
    assert layout_map["blocks.0.down.bias"].axes == ("model",)
    assert layout_map["blocks.0.up.weight"].device_mesh is layout_map.device_mesh


def test_a_path_no_key_matches_has_no_layout() -> None:
    layout_map = _map()
    layout_map["up.weight"] = ("model", None)
    assert layout_map["head.weight"] is None
    assert layout_map.get("head.weight", "default") == "default"
    assert "head.weight" not in layout_map and "up.weight" in layout_map


def test_an_exact_key_wins_over_regexes_that_also_match() -> None:
    layout_map = _map()
    layout_map["up.weight"] = ("model", None)
    layout_map["up"] = (None, "model")
    assert layout_map["up.weight"].axes == ("model", None)


def test_a_path_two_keys_match_is_refused_naming_the_path_and_both_keys() -> None:
    layout_map = _map()
    layout_map[r"up\.weight"] = ("model", None)
    layout_map[r"blocks\.0\."] = (None, "model")
    with pytest.raises(ValueError, match="several LayoutMap keys") as info:
        layout_map["blocks.0.up.weight"]
    message = str(info.value)
    assert "'blocks.0.up.weight'" in message
    assert r"up\\.weight" in message and r"blocks\\.0\\." in message
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
    layout_map[r"up\.weight"] = ("model", None)
    layout_map[r"up\.bias"] = ("model",)
    layout_map[r"down\.weight"] = (None, "model")
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
    layout_map[r"up\.weight"] = ("model", None)
    layout_map[r"up\.bias"] = ("model",)
    layout_map[r"down\.weight"] = (None, "model")
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
    layout_map[r"up\.weight"] = ("model", None)  # its bias left whole: not torch's colwise
    layout_map[r"down\.bias"] = ("model",)  # a row-parallel bias split: not torch's
    layout_map[r"down\.weight"] = (None, "model")
    net = Net()
    resolved = resolve_layouts(layout_map, net)
    styles = choose_styles(net, resolved, ("model",))
    assert set(styles.values()) == {Style.PROPAGATE}
    # A mesh with two model axes has no torch style at all.
    layout_map = LayoutMap(DeviceMesh((1, 2, 2), ("batch", "x", "y")))
    layout_map[r"up\.weight"] = ("x", "y")
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
