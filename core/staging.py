"""One host-to-device transfer per step: a batch's index arrays packed into one byte buffer."""
from __future__ import annotations

import array

import torch

ALIGN = 16  # every array starts at a multiple of 16 bytes: aligned for any integer view, and Triton specializes
# kernels on 16-byte pointer alignment (a pointer that is sometimes aligned would compile two variants)


class Uploader:
    """Packs host integer arrays into one byte buffer, moves it to the device in one non-blocking copy, and
    returns a typed view per array. On CUDA the bytes go through one of two pinned host buffers used in turn; a
    CUDA event per buffer keeps it from being rewritten before its copy has run. Each upload gets a fresh device
    buffer from the caching allocator, so tensors of an earlier batch stay valid."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.host = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def upload(self, arrays: list[tuple[array.array, torch.dtype]]) -> list[torch.Tensor]:
        """``arrays``: (values, dtype) pairs, the array's item size equal to the dtype's. Device tensors, in order."""
        offsets, total = [], 0
        for values, dtype in arrays:
            if values.itemsize != dtype.itemsize:
                raise ValueError(f"array of {values.itemsize}-byte items cannot be viewed as {dtype}")
            offsets.append(total)
            total += -(-len(values) * values.itemsize // ALIGN) * ALIGN
        packed = bytearray(total)
        for (values, _), start in zip(arrays, offsets):
            packed[start : start + len(values) * values.itemsize] = memoryview(values).cast("B")
        if not total:
            buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        elif self.pinned:
            buffer = self._to_device(packed)
        else:
            buffer = torch.frombuffer(packed, dtype=torch.uint8)
        return [buffer[start : start + len(values) * dtype.itemsize].view(dtype)
                for (values, dtype), start in zip(arrays, offsets)]

    def _to_device(self, packed: bytearray) -> torch.Tensor:
        turn, self.turn = self.turn, 1 - self.turn
        if (event := self.copied[turn]) is not None:
            event.synchronize()  # the copy from this buffer two uploads ago (normally long done)
        if self.host[turn].numel() < len(packed):
            self.host[turn] = torch.empty(max(len(packed), 2 * self.host[turn].numel()), dtype=torch.uint8,
                                          pin_memory=True)
        host = self.host[turn][: len(packed)]
        host.copy_(torch.frombuffer(packed, dtype=torch.uint8))
        buffer = host.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # the copy's stream, on cuda:N too
        self.copied[turn] = event
        return buffer
