"""Models from a library nobody here wrote (Hugging Face transformers), built from tiny
configs and saved to a temporary directory, used the way their users do (issue #22):
`from_pretrained` inside the scope (a meta-device build, then the loaded weights
assigned), `resize_token_embeddings` after it (a `.data` swap to another shape), a
cast to bfloat16, a model with buffers. Each must train like the default strategy.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import distribute as ds

transformers = pytest.importorskip("transformers")  # the README's test extras install it

BATCH = 4
STRATEGIES: dict[str, Callable[[], ds.Strategy]] = {
    "default": ds.get_strategy,
    "mirrored_2": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage": lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=100,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bert")
    transformers.BertForSequenceClassification(config).save_pretrained(path)
    return path


def _per_replica(strategy: ds.Strategy, batch: torch.Tensor) -> Any:
    n = strategy.num_replicas_in_sync
    if n == 1:
        return batch
    return ds.PerReplica([batch[i * BATCH // n : (i + 1) * BATCH // n] for i in range(n)])


def _train_lm(strategy: ds.Strategy, model: Any, vocab: int, steps: int = 3) -> list[float]:
    with strategy.scope():
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.randint(0, vocab, (BATCH, 12), generator=torch.Generator().manual_seed(1))
    losses = []

    def step(x: torch.Tensor) -> torch.Tensor:
        # The model's loss is a mean over this replica's tokens; every replica has as
        # many tokens per example, so scaling by its share of the batch gives the mean.
        loss = model(input_ids=x, labels=x).loss * x.shape[0] / BATCH
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    for _ in range(steps):
        losses.append(
            float(strategy.reduce("sum", strategy.run(step, args=(_per_replica(strategy, ids),))))
        )
    return losses


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _assert_copies_identical(model: torch.nn.Module) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(tensor, ds.DistributedVariable):
            for other in tensor.values[1:]:
                assert other.dtype == tensor.values[0].dtype, name
                assert torch.equal(other, tensor.values[0]), name


def _gpt2(
    strategy: ds.Strategy, path: Path, *, resize: bool = False, bf16: bool = False
) -> tuple[Any, list[float]]:
    with strategy.scope():
        model = transformers.GPT2LMHeadModel.from_pretrained(path)
    if resize:
        torch.manual_seed(5)
        model.resize_token_embeddings(108)
    if bf16:
        model.to(torch.bfloat16)
    losses = _train_lm(strategy, model, 108 if resize else 100)
    return model, losses


@pytest.mark.parametrize("name", ["mirrored_2", "central_storage"])
def test_from_pretrained_in_scope_trains_like_one_device(gpt2_dir: Path, name: str) -> None:
    expected, expected_losses = _gpt2(ds.get_strategy(), gpt2_dir)
    model, losses = _gpt2(STRATEGIES[name](), gpt2_dir)
    assert isinstance(model.transformer.wte.weight, ds.MirroredVariable)
    assert model.lm_head.weight is model.transformer.wte.weight, "tied weights stay tied"
    _assert_copies_identical(model)
    assert losses == pytest.approx(expected_losses, abs=1e-5)
    torch.testing.assert_close(_weights(model), _weights(expected), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["mirrored_2", "central_storage"])
def test_resize_token_embeddings_after_the_scope_trains_like_one_device(
    gpt2_dir: Path, name: str
) -> None:
    expected, _ = _gpt2(ds.get_strategy(), gpt2_dir, resize=True)
    model, _ = _gpt2(STRATEGIES[name](), gpt2_dir, resize=True)
    assert {tuple(t.shape) for t in model.transformer.wte.weight.values} == {(108, 32)}
    _assert_copies_identical(model)
    torch.testing.assert_close(_weights(model), _weights(expected), rtol=0, atol=1e-5)


def test_a_bfloat16_cast_after_the_scope_casts_every_replica(gpt2_dir: Path) -> None:
    # Before, replica 1 trained in float32 next to replica 0's bfloat16 (no error).
    expected, _ = _gpt2(ds.get_strategy(), gpt2_dir, bf16=True)
    model, _ = _gpt2(ds.MirroredStrategy(["cpu:0", "cpu:1"]), gpt2_dir, bf16=True)
    assert {t.dtype for p in model.parameters() for t in p.values} == {torch.bfloat16}
    _assert_copies_identical(model)
    # bfloat16 keeps 8 bits: two replicas' summed gradients round differently.
    torch.testing.assert_close(_weights(model), _weights(expected), rtol=0, atol=2e-2)


def test_a_model_with_buffers_loads_in_scope_and_trains_like_one_device(bert_dir: Path) -> None:
    labels = torch.tensor([0, 1, 2, 1])
    ids = torch.randint(0, 100, (BATCH, 10), generator=torch.Generator().manual_seed(3))

    def run(strategy: ds.Strategy) -> torch.nn.Module:
        with strategy.scope():
            model = transformers.BertForSequenceClassification.from_pretrained(bert_dir)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            loss = model(input_ids=x, labels=y).loss * x.shape[0] / BATCH
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        for _ in range(2):
            strategy.run(step, args=(_per_replica(strategy, ids), _per_replica(strategy, labels)))
        return model

    expected = run(ds.get_strategy())
    model = run(ds.MirroredStrategy(["cpu:0", "cpu:1"]))
    buffers = dict(model.named_buffers())
    assert buffers and all(isinstance(b, ds.MirroredVariable) for b in buffers.values())
    for name, buffer in expected.named_buffers():
        assert torch.equal(buffers[name].values[1], buffer), name
    _assert_copies_identical(model)
    torch.testing.assert_close(_weights(model), _weights(expected), rtol=0, atol=1e-5)
