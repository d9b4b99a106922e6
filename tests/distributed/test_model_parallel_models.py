"""ModelParallelStrategy on real models and the layout rules around them, in real
worker processes joined by gloo on 127.0.0.1.

What these pin: transformers' ``LlamaForCausalLM`` (built from a tiny config, no
download) with its default config (``use_cache=True``: ``DynamicCache``'s empty
``torch.tensor([])`` concatenated with split keys), untied and tied
(``tie_word_embeddings=True``, the vocabulary split: the embedding's output is read
twice), trains to one process's losses and weights (1e-5 SGD, 5e-5 AdamW) on (1, 2)
and (2, 2) meshes, and ``generate()`` gives one process's tokens; ``load_state_dict`` of
whole (plain) tensors on a laid-out model lays each one out (a bare network and one
wrapped in ``ds.Model``); a network wrapped in ``ds.Model`` in the scope is laid out by
its own paths; a key that matches no variable is warned about on the chief, naming the
nearest paths; GPT-2's ``Conv1D`` (weight ``(in, out)``) laid out column- then
row-parallel costs the collectives of the same ``nn.Linear`` pair, and a tiny
``GPT2LMHeadModel`` (tied vocabulary split too) trains as one process; BERT
(``BertForMaskedLM``: its word table, and the tied MLM decoder, split along the
vocabulary) trains as one process on (1, 2) with SGD and (2, 2) with AdamW.

One launch per world size (2 and 4 workers), shared by the tests.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

import distribute as ds
from distribute import launch

pytest.importorskip("transformers")  # the README's test extras install it

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

VOCAB, STEPS, GLOBAL_BATCH, SEQ = 32, 3, 4, 6

#: Every strategy a worker makes, kept until the worker ends: the first made the process
#: group and the later ones adopted it; collecting the first would destroy it under them.
_KEEP: list[Any] = []

# -- Llama ---------------------------------------------------------------------------------------


def build(kind: str, tied: bool) -> torch.nn.Module:
    """A tiny LlamaForCausalLM, or (kind "gpt2") a GPT2LMHeadModel: its projections are
    transformers' Conv1D, its head tied to the token embedding, dropout off."""
    import transformers

    if kind == "bert":  # its MLM head's decoder tied to the word table
        bert = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=32,
            max_position_embeddings=16,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return transformers.BertForMaskedLM(bert)
    if kind == "gpt2":
        gpt2 = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=16,
            n_embd=16,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(gpt2)
    return transformers.LlamaForCausalLM(config(tied))


def gpt2_layout_map(shape: tuple[int, int]) -> ds.experimental.LayoutMap:
    """Conv1D weights are (in, out): column-parallel is (None, "model")."""
    layouts = ds.experimental.LayoutMap(ds.experimental.DeviceMesh(shape, ("batch", "model")))
    layer = r"transformer\.h\.\d+\."
    layouts[layer + r"(attn\.c_attn|mlp\.c_fc)\.weight"] = (None, "model")
    layouts[layer + r"(attn\.c_attn|mlp\.c_fc)\.bias"] = ("model",)
    layouts[layer + r"(attn|mlp)\.c_proj\.weight"] = ("model", None)
    layouts[r"transformer\.wte\.weight|lm_head\.weight"] = ("model", None)  # tied
    return layouts


def bert_layout_map(shape: tuple[int, int]) -> ds.experimental.LayoutMap:
    """BERT's attention and MLP column- then row-parallel, its word table (and the tied
    MLM decoder) split along the vocabulary."""
    layouts = ds.experimental.LayoutMap(ds.experimental.DeviceMesh(shape, ("batch", "model")))
    layer = r"bert\.encoder\.layer\.\d+\."
    layouts[layer + r"attention\.self\.(query|key|value)\.weight"] = ("model", None)
    layouts[layer + r"attention\.self\.(query|key|value)\.bias"] = ("model",)
    layouts[layer + r"attention\.output\.dense\.weight"] = (None, "model")
    layouts[layer + r"intermediate\.dense\.weight"] = ("model", None)
    layouts[layer + r"intermediate\.dense\.bias"] = ("model",)
    layouts[layer + r"output\.dense\.weight"] = (None, "model")
    layouts[r"bert\.embeddings\.word_embeddings\.weight"] = ("model", None)
    layouts[r"cls\.predictions\.decoder\.weight"] = ("model", None)  # tied to the table
    return layouts


def config(tied: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )  # use_cache=True: the default


def layout_map(shape: tuple[int, int]) -> ds.experimental.LayoutMap:
    mesh = ds.experimental.DeviceMesh(shape, ("batch", "model"))
    layouts = ds.experimental.LayoutMap(mesh)
    layer = r"model\.layers\.\d+\."
    layouts[layer + r"self_attn\.(q|k|v)_proj\.weight"] = ("model", None)
    layouts[layer + r"self_attn\.o_proj\.weight"] = (None, "model")
    layouts[layer + r"mlp\.(gate|up)_proj\.weight"] = ("model", None)
    layouts[layer + r"mlp\.down_proj\.weight"] = (None, "model")
    layouts[r"model\.embed_tokens\.weight"] = ("model", None)  # the vocabulary split
    layouts[r"lm_head\.weight"] = ("model", None)
    return layouts


def data() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, SEQ), generator=g)


def optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=0.01)


def _per_example(model: Any, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    targets = ids[:, 1:]
    return (
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none"
        )
        .view(len(ids), -1)
        .mean(dim=1)
    )


def _prompt() -> torch.Tensor:
    return data()[:2, :3]


def _generate(model: Any) -> list[list[int]]:
    prompt = _prompt()
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False
    )
    return [list(map(int, row)) for row in out]


def _tokens(model: Any, kind: str) -> list[list[int]]:
    """``generate()``'s tokens; BERT (no causal generation): its predicted tokens."""
    if kind != "bert":
        return _generate(model)
    logits = model(input_ids=_prompt()).logits
    return [list(map(int, row)) for row in logits.argmax(-1)]


def _whole(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    value = value.full_tensor() if isinstance(value, DTensor) else value
    return value.detach().clone().cpu()


def reference(tied: bool, name: str, kind: str = "llama") -> dict[str, Any]:
    torch.manual_seed(100)
    model = build(kind, tied)
    opt = optimizer(name, model.parameters())
    ids = data()
    losses = []
    for step in range(STEPS):
        batch = ids[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        loss = _per_example(model, batch).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        tokens = _tokens(model, kind)
    return {
        "losses": losses,
        "state": {k: _whole(v) for k, v in model.state_dict().items()},
        "tokens": tokens,
    }


def parallel(
    shape: tuple[int, int], tied: bool, name: str, kind: str = "llama", outputs: bool = False
) -> dict[str, Any]:
    maps = {"gpt2": gpt2_layout_map, "bert": bert_layout_map}
    layouts = maps.get(kind, layout_map)(shape)
    if outputs:  # Keras's output layouts: sequence-parallel between the decoder layers
        layouts[r"model\.layers\.\d+/output"] = ("batch", "model", None)
        layouts[r"model\.layers\.\d+\.mlp\.up_proj/output"] = ("batch", None, "model")
    strategy = ds.experimental.ModelParallelStrategy(layouts)
    _KEEP.append(strategy)
    torch.manual_seed(100 + int(os.environ.get("RANK", "0")))  # the chief's values win
    with strategy.scope():
        model = build(kind, tied)
        opt = optimizer(name, model.parameters())
    ids = data()
    loader = torch.utils.data.DataLoader(ids, batch_size=GLOBAL_BATCH)

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = ds.compute_average_loss(_per_example(model, batch), global_batch_size=GLOBAL_BATCH)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    seen: list[str] = []  # the placement of the first decoder layer's output
    first = {"llama": "model.layers.0", "gpt2": "transformer.h.0"}
    model.get_submodule(first.get(kind, "bert.encoder.layer.0")).register_forward_hook(
        lambda module, args, out: seen.append(str(out.placements[0])) if not seen else None
    )
    losses = []
    for batch in strategy.experimental_distribute_dataset(loader):
        losses.append(float(strategy.reduce("sum", strategy.run(step, args=(batch,)), axis=None)))
    with torch.no_grad():
        tokens = _tokens(model, kind)  # outside run, as a user calls it
    return {
        "output_placements": seen,
        "losses": losses,
        "state": {k: _whole(v) for k, v in model.state_dict().items()},
        "tokens": tokens,
    }


# -- load_state_dict of whole tensors, ds.Model paths, keys that match nothing -------------------


def _mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


def _mlp_map(extra: dict[str, tuple[str | None, ...]] | None = None) -> Any:
    layouts = ds.experimental.LayoutMap(ds.experimental.DeviceMesh((1, 2), ("batch", "model")))
    layouts[r"0\.weight"] = ("model", None)  # anchored: the whole path, also inside ds.Model
    layouts[r"0\.bias"] = ("model",)
    layouts[r"2\.weight"] = (None, "model")
    for key, value in (extra or {}).items():
        layouts[key] = value
    return layouts


def _load_whole_values() -> dict[str, Any]:
    """A laid-out MLP (bare, and wrapped in ds.Model in the scope) loads a one-process
    state dict of plain tensors; its outputs are then the one-process model's."""
    torch.manual_seed(5)
    source = _mlp()
    whole = {k: v.clone() for k, v in source.state_dict().items()}
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(6))
    expected = source(x).detach()
    out: dict[str, Any] = {}
    strategy = ds.experimental.ModelParallelStrategy(_mlp_map())
    _KEEP.append(strategy)
    torch.manual_seed(50 + int(os.environ.get("RANK", "0")))
    with strategy.scope():
        bare = _mlp()
        wrapped = ds.Model(_mlp())
    bare.load_state_dict(whole)
    wrapped.load_state_dict({f"module.{k}": v for k, v in whole.items()})
    for name, model, prefix in (("bare", bare, ""), ("wrapped", wrapped, "module.")):
        state = {k[len(prefix) :]: _whole(v) for k, v in model.state_dict().items()}
        out[name] = {
            "equal": all(torch.equal(state[k], v) for k, v in whole.items()),
            "local_rows": tuple(model.get_submodule(f"{prefix}0").weight.to_local().shape),
            "output": strategy.run(lambda m=model: m(x).detach()),
        }
    out["expected"] = expected
    out["whole_unchanged"] = all(torch.equal(whole[k], v) for k, v in source.state_dict().items())
    out["refused"] = _refused_before_anything_changed(bare, whole)
    return out


def _refused_before_anything_changed(model: torch.nn.Module, whole: dict[str, Any]) -> str:
    """A whole value that cannot be laid out (DTensor refusing "0.bias", simulated):
    load_state_dict raises before any variable changed ("0.weight" comes first)."""
    import torch.distributed.tensor as dtensor

    real = dtensor.distribute_tensor

    def refuse_the_bias(value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if value.dim() == 1 and value.shape[0] == 8:
            raise RuntimeError("simulated: DTensor cannot lay this value out")
        return real(value, *args, **kwargs)

    before = {k: _whole(v) for k, v in model.state_dict().items()}
    dtensor.distribute_tensor = refuse_the_bias  # type: ignore[assignment]  # the simulation
    try:
        model.load_state_dict({k: v + 1 for k, v in whole.items()})
    except ds.errors.InvalidArgumentError as exc:
        message = str(exc)
    else:
        message = "<nothing raised>"
    finally:
        dtensor.distribute_tensor = real
    after = {k: _whole(v) for k, v in model.state_dict().items()}
    unchanged = all(torch.equal(after[k], v) for k, v in before.items())
    return f"unchanged={unchanged}: {message}"


def _unmatched_keys_warned() -> list[str]:
    """A key left from the re.search rule and a typo: warned about when the model
    (wrapped in ds.Model in the scope) is laid out, on the chief only."""
    layouts = _mlp_map({r"2\.bi": (None,), r"0\.wieght": ("model", None)})
    strategy = ds.experimental.ModelParallelStrategy(layouts)
    _KEEP.append(strategy)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with strategy.scope():
            ds.Model(_mlp())
    return [str(w.message) for w in record if "LayoutMap key" in str(w.message)]


# -- Conv1D's collectives --------------------------------------------------------------------------


def _collectives_per_step() -> dict[str, tuple[int, int]]:
    """Two column- then row-parallel pairs with a LayerNorm between them, as nn.Linear
    and as transformers' Conv1D (the same layouts, transposed): the collectives of a
    forward and of a backward pass, counted by DTensor's CommDebugMode."""
    from torch.distributed.tensor.debug import CommDebugMode
    from transformers.pytorch_utils import Conv1D

    counts: dict[str, tuple[int, int]] = {}
    for kind in ("linear", "conv1d"):
        layouts = ds.experimental.LayoutMap(ds.experimental.DeviceMesh((1, 2), ("batch", "model")))
        column, row = ((None, "model"), ("model", None))
        if kind == "linear":
            column, row = row, column
        layouts[r"(0|4)\.weight"] = column
        layouts[r"(0|4)\.bias"] = ("model",)
        layouts[r"(2|6)\.weight"] = row
        strategy = ds.experimental.ModelParallelStrategy(layouts)
        _KEEP.append(strategy)
        with strategy.scope():
            if kind == "linear":
                up, down = (lambda: torch.nn.Linear(8, 16)), (lambda: torch.nn.Linear(16, 8))
            else:
                up, down = (lambda: Conv1D(16, 8)), (lambda: Conv1D(8, 16))
            model = torch.nn.Sequential(
                up(), torch.nn.GELU(), down(), torch.nn.LayerNorm(8), up(), torch.nn.GELU(), down()
            )
        x = torch.randn(2, 3, 8)

        def step(model: torch.nn.Module = model, x: torch.Tensor = x) -> tuple[int, int]:
            with CommDebugMode() as forward:
                y = model(x)
            with CommDebugMode() as backward:
                y.sum().backward()
            return forward.get_total_counts(), backward.get_total_counts()

        counts[kind] = strategy.run(step)
    return counts


# -- the launches --------------------------------------------------------------------------------


def _two_workers() -> dict[str, Any]:
    out: dict[str, Any] = {
        "llama_outputs_sgd": parallel((1, 2), False, "sgd", outputs=True),
        "load": _load_whole_values(),
        "unmatched": _unmatched_keys_warned(),
        "collectives": _collectives_per_step(),
        "gpt2_sgd": parallel((1, 2), True, "sgd", kind="gpt2"),
        "bert_sgd": parallel((1, 2), True, "sgd", kind="bert"),
    }
    for tied in (False, True):
        for name in ("sgd", "adamw"):
            out[f"llama_{'tied' if tied else 'untied'}_{name}"] = parallel((1, 2), tied, name)
    return out


def _four_workers() -> dict[str, Any]:
    return {
        "llama_outputs_adamw": parallel((2, 2), False, "adamw", outputs=True),
        "llama_untied_adamw": parallel((2, 2), False, "adamw"),
        "llama_tied_sgd": parallel((2, 2), True, "sgd"),
        "bert_adamw": parallel((2, 2), True, "adamw", kind="bert"),
    }


@pytest.fixture(scope="module")
def two_workers() -> list[dict[str, Any]]:
    return launch.run(_two_workers, 2, timeout=380)


@pytest.fixture(scope="module")
def four_workers() -> list[dict[str, Any]]:
    return launch.run(_four_workers, 4, timeout=380)


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    import transformers

    transformers.logging.set_verbosity_error()
    out = {
        f"llama_{'tied' if tied else 'untied'}_{name}": reference(tied, name)
        for tied in (False, True)
        for name in ("sgd", "adamw")
    }
    out["gpt2_sgd"] = reference(True, "sgd", kind="gpt2")
    out["bert_sgd"] = reference(True, "sgd", kind="bert")
    out["bert_adamw"] = reference(True, "adamw", kind="bert")
    return out


def _assert_matches(result: dict[str, Any], reference: dict[str, Any], atol: float) -> None:
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=atol
    )
    assert result["state"].keys() == reference["state"].keys()
    for name, value in reference["state"].items():
        torch.testing.assert_close(result["state"][name], value, rtol=0, atol=atol, msg=name)
    assert result["tokens"] == reference["tokens"]


# -- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", ["untied", "tied"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_llama_with_its_default_config_trains_and_generates_as_one_process_on_1x2(
    two_workers: list[dict[str, Any]], references: dict[str, Any], tied: str, optimizer: str
) -> None:
    key = f"llama_{tied}_{optimizer}"
    for worker in two_workers:
        _assert_matches(worker[key], references[key], 1e-5 if optimizer == "sgd" else 5e-5)


@pytest.mark.parametrize("key", ["llama_untied_adamw", "llama_tied_sgd"])
def test_llama_untied_and_tied_train_and_generate_as_one_process_on_2x2(
    four_workers: list[dict[str, Any]], references: dict[str, Any], key: str
) -> None:
    for worker in four_workers:
        _assert_matches(worker[key], references[key], 1e-5 if key.endswith("sgd") else 5e-5)


def test_load_state_dict_of_whole_tensors_lays_each_one_out(
    two_workers: list[dict[str, Any]],
) -> None:
    for worker in two_workers:
        load = worker["load"]
        assert load["whole_unchanged"]
        for name in ("bare", "wrapped"):
            assert load[name]["equal"], name
            assert load[name]["local_rows"] == (4, 4), name  # (8, 4) split in two
            torch.testing.assert_close(load[name]["output"], load["expected"], rtol=0, atol=1e-6)


def test_whole_values_that_cannot_be_laid_out_are_refused_before_anything_changed(
    two_workers: list[dict[str, Any]],
) -> None:
    for worker in two_workers:
        refused = worker["load"]["refused"]
        assert refused.startswith("unchanged=True: load_state_dict"), refused
        assert "'0.bias'" in refused and "nothing was loaded" in refused, refused


def test_keys_that_match_no_variable_are_warned_about_on_the_chief_only(
    two_workers: list[dict[str, Any]],
) -> None:
    chief, other = (worker["unmatched"] for worker in two_workers)
    assert other == []
    assert len(chief) == 2, chief
    assert r"'2\\.bi'" in chief[0] and "'2.bias'" in chief[0], chief
    assert r"'0\\.wieght'" in chief[1] and "'0.weight'" in chief[1], chief


def test_gpt2_s_conv1d_takes_the_column_row_path_with_linear_s_collectives(
    two_workers: list[dict[str, Any]],
) -> None:
    for worker in two_workers:
        counts = worker["collectives"]
        assert counts["conv1d"] == counts["linear"], counts
        assert counts["linear"] == (2, 1), counts  # a row output each; one input gradient


def test_gpt2_with_conv1d_and_a_tied_split_vocabulary_trains_as_one_process_on_1x2(
    two_workers: list[dict[str, Any]], references: dict[str, Any]
) -> None:
    for worker in two_workers:
        _assert_matches(worker["gpt2_sgd"], references["gpt2_sgd"], 1e-5)


def test_output_layouts_split_the_activations_and_train_as_one_process(
    two_workers: list[dict[str, Any]],
    four_workers: list[dict[str, Any]],
    references: dict[str, Any],
) -> None:
    """Keras's "<layer path>/output" keys: each decoder layer's output split along the
    sequence (("batch", "model", None)), up_proj's along its features."""
    for worker in two_workers:
        _assert_matches(worker["llama_outputs_sgd"], references["llama_untied_sgd"], 1e-5)
        assert worker["llama_outputs_sgd"]["output_placements"] == ["S(1)"]
        assert worker["llama_untied_sgd"]["output_placements"] == ["R"]
    for worker in four_workers:
        _assert_matches(worker["llama_outputs_adamw"], references["llama_untied_adamw"], 5e-5)


def test_bert_with_its_word_table_split_trains_as_one_process_on_1x2_and_2x2(
    two_workers: list[dict[str, Any]],
    four_workers: list[dict[str, Any]],
    references: dict[str, Any],
) -> None:
    for worker in two_workers:
        _assert_matches(worker["bert_sgd"], references["bert_sgd"], 1e-5)
    for worker in four_workers:
        _assert_matches(worker["bert_adamw"], references["bert_adamw"], 5e-5)
