"""Stored KV in 8 or 4 bits: a block's keys quantized per channel, its values per token (KIVI's split:
keys have outlier channels, values do not), each group with a float16 scale and low end, `x ≈ low + code * scale`.

One block is one group along its tokens for the keys (the passage's own range per channel), so a key's scale and
low end are per (layer, kv head, channel); a value's are per (layer, kv head, token). 4-bit codes are packed two
to a byte, channel i in the low half and channel i + head_dim/2 in the high half: the pairs rotary embedding turns
together, unpacked side by side by the C kernel. Quantized once when a block is encoded (files and Redis values keep
4-bit codes deflated: `store.pack`), and dequantized into the request's workspace (kernels.fill_quantized on the CPU,
`dequantize_into` everywhere else).
"""

from dataclasses import dataclass

import torch

FORMATS = {"int8": 8, "int4": 4}
KEYS, VALUES = "channel", "token"  # what one scale covers: a channel over the block's tokens, or a token's head


def bits_of(storage) -> int | None:
    """8 or 4 for a quantized storage format's name, None for a float dtype."""
    return FORMATS.get(storage) if isinstance(storage, str) else None


@dataclass
class Quantized:
    """A [layers, kv_heads, tokens, head_dim] tensor as codes (uint8: one a byte, or two with 4 bits), and
    float16 `scale` and `low`: [layers, kv_heads, 1, head_dim] per channel, [layers, kv_heads, tokens, 1] per token."""

    codes: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor
    bits: int

    @property
    def shape(self) -> torch.Size:
        *lead, width = self.codes.shape
        return torch.Size((*lead, width * 8 // self.bits))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.low

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts())

    def map(self, fn) -> "Quantized":
        """The same codes and scales, each tensor passed through `fn` (a copy to pinned memory, to a device)."""
        return Quantized(*(fn(t) for t in self.parts()), self.bits)


def group_shape(shape, per: str) -> tuple[int, ...]:
    """The shape of a [layers, kv_heads, tokens, head_dim] tensor's scales and low ends."""
    layers, heads, tokens, dim = shape
    return (layers, heads, 1, dim) if per == KEYS else (layers, heads, tokens, 1)


def quantize(x: torch.Tensor, bits: int, per: str) -> Quantized:
    """`x` [layers, kv_heads, tokens, head_dim] in `bits`-bit codes, one scale and low end per channel (KEYS) or per
    token (VALUES). Codes are computed against the float16 scale and low end that are kept, so rounding them adds
    nothing: each element is off by at most half a step (scale / 2; a group narrower than float16's rounding of
    its low end, by that rounding), and a constant group is exact."""
    if bits not in FORMATS.values():
        raise ValueError(f"bits must be one of {sorted(FORMATS.values())}, got {bits}")
    if bits == 4 and x.shape[-1] % 2:
        raise ValueError(f"4-bit codes pack channel pairs: head_dim {x.shape[-1]} is odd")
    dim = 2 if per == KEYS else 3
    x = x.float()
    levels = (1 << bits) - 1
    low = x.amin(dim, keepdim=True).half()  # rounded up, it leaves the least values half a float16 step off at most
    exact = ((x.amax(dim, keepdim=True) - low.float()) / levels).clamp_min(0)  # a range below low's rounding: 0
    scale = exact.half()
    scale = torch.where(scale.float() < exact, (exact * (1 + 2**-10)).half(), scale)  # rounded up: the top in reach
    step = scale.float()
    codes = torch.where(step > 0, (x - low.float()) / step.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    codes = codes.round_().clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        half = codes.shape[-1] // 2
        codes = codes[..., :half] | (codes[..., half:] << 4)
    return Quantized(codes.contiguous(), scale.contiguous(), low.contiguous(), bits)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [layers, kv_heads, tokens, head_dim] tensor `q` holds, in `dtype` on its device."""
    codes = q.codes
    if q.bits == 4:
        codes = torch.cat((codes & 0x0F, codes >> 4), dim=-1)
    return torch.addcmul(q.low.float(), codes.float(), q.scale.float()).to(dtype)


def _halves(q: Quantized) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes of each row's first and second half of channels: the pairs rotary embedding turns together."""
    if q.bits == 4:
        return q.codes & 0x0F, q.codes >> 4
    half = q.codes.shape[-1] // 2
    return q.codes[..., :half], q.codes[..., half:]


def dequantize_into(q: Quantized, out: torch.Tensor, cos: torch.Tensor | None = None,
                    sin: torch.Tensor | None = None) -> None:
    """Write the tensor `q` holds into `out` (a float view of its shape, on any device), rotated by cos/sin
    ([1, head_dim // 2], as rope.shift_keys takes them) where given. The codes are copied into `out` and scaled there
    in place; a key channel's scale and low end are constant over the block, so they fold into the rotation's
    factors, and keys take the passes float16 keys' copy and rotation take."""
    if q.device != out.device:
        q = q.map(lambda t: t.to(out.device, non_blocking=True))
    half = out.shape[-1] // 2
    scale, low = q.scale.to(out.dtype), q.low.to(out.dtype)
    first, second = out[..., :half], out[..., half:]
    for codes, part in zip(_halves(q), (first, second)):
        part.copy_(codes)
    if cos is None:
        out.mul_(scale).add_(low)
        return
    s1, s2, l1, l2 = scale[..., :half], scale[..., half:], low[..., :half], low[..., half:]
    codes1 = first.clone()  # first = k1 cos - k2 sin, second = k2 cos + k1 sin, with k = low + code * scale
    first.mul_(s1 * cos).add_(l1 * cos - l2 * sin).addcmul_(second, s2 * sin, value=-1)
    second.mul_(s2 * cos).add_(l2 * cos + l1 * sin).addcmul_(codes1, s1 * sin)


def as_tensor(kv, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A block's keys or values as a tensor: dequantized if stored in codes (in `dtype`, default float32)."""
    if isinstance(kv, Quantized):
        return dequantize(kv, dtype or torch.float32)
    return kv if dtype is None else kv.to(dtype)


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, storage) -> float:
    """Bytes a token's keys and values take in `storage` (a float dtype or a FORMATS name), less the keys' per-block
    scales (`block_bytes` adds those)."""
    bits = bits_of(storage)
    if bits is None:
        return 2 * layers * kv_heads * head_dim * storage.itemsize
    return layers * kv_heads * (2 * head_dim * bits / 8 + 2 * 2)  # codes; a value's float16 scale and low end


def block_bytes(layers: int, kv_heads: int, head_dim: int, storage, tokens: int) -> int:
    """Bytes of the keys and values of a block of `tokens` tokens in `storage`, scales included."""
    fixed = 0 if bits_of(storage) is None else layers * kv_heads * head_dim * 2 * 2  # a key channel's scale, low end
    return int(tokens * bytes_per_token(layers, kv_heads, head_dim, storage)) + fixed
