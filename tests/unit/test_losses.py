"""Loss scaling: compute_average_loss and scale_regularization_loss."""

from __future__ import annotations

import pytest
import torch

import distribute as ds


def test_average_loss_divides_the_sum_by_the_global_batch_size() -> None:
    loss = ds.compute_average_loss(torch.tensor([1.0, 2.0, 3.0]), global_batch_size=12)
    assert float(loss) == pytest.approx(0.5)


def test_average_loss_applies_sample_weights() -> None:
    loss = ds.compute_average_loss(
        torch.tensor([1.0, 2.0]), sample_weight=torch.tensor([2.0, 0.5]), global_batch_size=2
    )
    assert float(loss) == pytest.approx(1.5)


def test_average_loss_of_an_empty_global_batch_is_zero() -> None:
    loss = ds.compute_average_loss(torch.zeros(0), global_batch_size=0)
    assert float(loss) == 0.0


def test_default_global_batch_size_is_local_batch_times_replicas() -> None:
    s = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    out = s.run(lambda: ds.compute_average_loss(torch.tensor([4.0, 4.0])))
    # 8 / (2 local examples * 2 replicas)
    assert [float(v) for v in s.experimental_local_results(out)] == [2.0, 2.0]


def test_average_loss_in_cross_replica_context_needs_a_batch_size() -> None:
    with ds.OneDeviceStrategy("cpu").scope():
        with pytest.raises(RuntimeError, match="global_batch_size"):
            ds.compute_average_loss(torch.ones(2))
        assert float(ds.compute_average_loss(torch.ones(2), global_batch_size=4)) == 0.5


def test_average_loss_rejects_a_scalar() -> None:
    with pytest.raises(ValueError, match="rank >= 1"):
        ds.compute_average_loss(torch.tensor(1.0), global_batch_size=1)


def test_regularization_loss_is_divided_by_replicas() -> None:
    s = ds.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    out = s.run(lambda: ds.scale_regularization_loss([torch.tensor(2.0), torch.tensor(6.0)]))
    assert {float(v) for v in s.experimental_local_results(out)} == {2.0}


def test_regularization_loss_in_cross_replica_context_raises() -> None:
    with ds.OneDeviceStrategy("cpu").scope(), pytest.raises(RuntimeError, match="replica context"):
        ds.scale_regularization_loss(torch.tensor(1.0))
