"""GPU paths checked on the CPU (issue #17): device binding, no stray `.cuda()`,
per-replica optimizer tensors, thread state. What needs a real GPU is in tests/gpu/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from distribute.errors import InvalidArgumentError
from distribute.strategies._devices import local_gpu

PACKAGE = Path(__file__).resolve().parents[2] / "distribute"


# -- which GPU a worker process binds to ----------------------------------------------


@pytest.mark.parametrize("local_rank", range(8))
def test_each_local_rank_of_a_full_node_gets_its_own_gpu(local_rank: int) -> None:
    assert local_gpu(local_rank, 8, 8, None) == local_rank


def test_more_processes_than_gpus_is_refused_instead_of_wrapping_onto_gpu_0() -> None:
    with pytest.raises(InvalidArgumentError, match=r"8 worker processes .* only 4 GPU"):
        local_gpu(5, 8, 4, None)


def test_a_process_given_one_gpu_of_its_own_by_the_launcher_uses_it() -> None:
    assert local_gpu(3, 8, 1, "3") == 0


def test_one_visible_gpu_shared_by_several_processes_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="share a GPU"):
        local_gpu(1, 2, 1, None)
    with pytest.raises(InvalidArgumentError, match="share a GPU"):
        local_gpu(1, 2, 1, "0,1")  # two ids visible, yet only one GPU counted


def test_slurm_gpu_ids_win_over_the_local_rank_and_out_of_range_ids_are_ignored() -> None:
    assert local_gpu(1, 2, 8, None, assigned=[4, 5, 6, 7]) == 4
    assert local_gpu(1, 2, 2, None, assigned=[4]) == 1  # ids of another view: local rank


# -- no CUDA call without a device ------------------------------------------------------


def _cuda_calls_without_device(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "cuda"
            and not node.args
            and not node.keywords
        ):
            lines.append(node.lineno)
    return lines


def test_the_library_never_calls_cuda_without_a_device() -> None:
    # `.cuda()` means the *current* device: GPU 0 in every process and replica thread
    # that did not set one, so every rank's tensors would land on one GPU.
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := _cuda_calls_without_device(path.read_text()))
    }
    assert found == {}, f"`.cuda()` without a device at {found}; use .to(device)"


def test_the_static_check_finds_a_bare_cuda_call() -> None:
    assert _cuda_calls_without_device("x = t.cuda()\ny = t.cuda(1)\n") == [1]
