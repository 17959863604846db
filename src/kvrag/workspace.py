"""Workspaces: a transformers cache whose layers write into preallocated buffers.

`DynamicCache` concatenates on every update, copying the whole past once per layer per step;
with thousands of cached passage tokens that copy costs more than the question's own compute.
Here the assembled passages are written once into a buffer sized for the whole request, and the
question and generated tokens are appended in place. Buffers are pooled per engine so repeated
requests reuse memory that is already paged in.
"""

import threading

import torch
from transformers.cache_utils import Cache, DynamicLayer


class BufferLayer(DynamicLayer):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.key_buffer, self.value_buffer = keys, values  # [1, kv_heads, capacity, head_dim]
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.slots: torch.Tensor | None = None  # blend mode: updates overwrite these slots, not append
        self.set_length(0)

    def set_length(self, length: int) -> None:
        self.length = length
        self.keys = self.key_buffer[:, :, :length]
        self.values = self.value_buffer[:, :, :length]

    def update(self, key_states, value_states, *args, **kwargs):
        if self.slots is not None:  # fresh KV for tokens of an already filled cache, at their slots
            self.key_buffer[:, :, self.slots] = key_states
            self.value_buffer[:, :, self.slots] = value_states
            return self.keys, self.values
        end = self.length + key_states.shape[-2]
        if end > self.key_buffer.shape[-2]:
            raise RuntimeError(f"KV buffer of {self.key_buffer.shape[-2]} tokens overflowed ({end} needed)")
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.set_length(end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        self.set_length(self.length - abs(tokens_to_remove))


class Workspace:
    """KV buffers for every layer: keys/values are [layers, 1, kv_heads, capacity, head_dim]."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        shape = (layers, 1, kv_heads, capacity, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def cache(self, length: int = 0) -> Cache:
        """A fresh cache over these buffers whose first `length` slots are already filled."""
        layers = [BufferLayer(k, v) for k, v in zip(self.keys, self.values)]
        for layer in layers:
            layer.set_length(length)
        return Cache(layers=layers)


class WorkspacePool:
    """Hands out workspaces of at least the requested capacity and takes them back for reuse."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, keep: int = 2):
        self.shape = (layers, kv_heads, head_dim)
        self.dtype, self.device, self.keep = dtype, device, keep
        self._free: list[Workspace] = []
        self._lock = threading.Lock()

    def acquire(self, capacity: int) -> Workspace:
        with self._lock:
            for i, ws in enumerate(self._free):
                if ws.capacity >= capacity:
                    return self._free.pop(i)
        rounded = -(-capacity // 1024) * 1024  # whole KiB-token steps, so sizes get reused
        return Workspace(*self.shape, rounded, self.dtype, self.device)

    def release(self, ws: Workspace) -> None:
        with self._lock:
            self._free.append(ws)
            self._free.sort(key=lambda w: w.capacity)
            if len(self._free) > self.keep:
                self._free.pop(0)
