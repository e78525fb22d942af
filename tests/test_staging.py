"""The per-step upload: packed host arrays come back as the same values, typed and aligned."""
from __future__ import annotations

import array
import random

import pytest
import torch

from infer.core.staging import Uploader

CODES = {torch.int64: "q", torch.int32: "i"}


def random_arrays(rng: random.Random) -> list[tuple[array.array, torch.dtype]]:
    dtypes = [rng.choice([torch.int64, torch.int32]) for _ in range(rng.randint(1, 7))]
    return [(array.array(CODES[d], [rng.randint(-2**31, 2**31 - 1) for _ in range(rng.randint(0, 9))]), d)
            for d in dtypes]


def check(uploader: Uploader, arrays: list[tuple[array.array, torch.dtype]]) -> list[torch.Tensor]:
    tensors = uploader.upload(arrays)
    assert len(tensors) == len(arrays)
    for tensor, (values, dtype) in zip(tensors, arrays):
        assert tensor.dtype == dtype and tensor.device.type == uploader.device.type
        assert tensor.cpu().tolist() == values.tolist()
        assert tensor.data_ptr() % dtype.itemsize == 0
    return tensors


def test_upload_round_trips_mixed_arrays_on_the_cpu():
    rng = random.Random(0)
    uploader = Uploader(torch.device("cpu"))
    for _ in range(50):
        check(uploader, random_arrays(rng))
    assert check(uploader, []) == []
    with pytest.raises(ValueError, match="cannot be viewed as torch.int64"):
        uploader.upload([(array.array("i", [1]), torch.int64)])


@pytest.mark.gpu
def test_upload_through_pinned_buffers_keeps_earlier_batches_valid():
    rng = random.Random(1)
    uploader = Uploader(torch.device("cuda"))
    kept = [(check(uploader, arrays), arrays) for arrays in (random_arrays(rng) for _ in range(6))]
    torch.cuda.synchronize()
    for tensors, arrays in kept:  # later uploads reused the two host buffers, not the device ones
        assert [t.cpu().tolist() for t in tensors] == [values.tolist() for values, _ in arrays]
