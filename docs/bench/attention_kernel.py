"""How far hand-written kernels and prepacked weights move full/block on this CPU (#2).

Block mode spends most of its time at 4K-8K context in the question's attention over the cached
keys, where torch's CPU flash kernel runs well below the matrix products of full prefill, and
some in writing the cached blocks into the request's buffers. This builds `attention_kernel.c`
(gcc, x86-64 with AVX-512F), checks it against SDPA and `kvrag.assemble.fill`, and times in one
process, interleaved, median of `--runs`:

- `floor`, `full`, `block` with torch's kernels, and `floor` and `block` with the C kernels
  (`+kernel`: the question's attention, and the blocks' float16 KV converted and rotated in one
  pass); full prefill keeps torch's flash kernel, which is made for it;
- the same with every linear layer of both modes on oneDNN's prepacked weights (`packed`, the
  private op inductor's freezing uses), so that both modes get the fastest products there are.

It changes nothing in kvrag's files; the attention kernel only serves the question's prefill
(mask: cached keys visible, own keys causal), so only the modes timed here may run while it is on.

    .venv/bin/python docs/bench/attention_kernel.py --lengths 4096,8000 --runs 5
"""

import argparse
import ctypes
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

import kvrag.engine
from kvrag import KVEngine, attention
from kvrag.assemble import Piece, fill
from kvrag.bench import QUESTION, make_passages
from kvrag.cache import Workspace
from kvrag.rope import delta_cos_sin
from kvrag.store import KVBlock

SOURCE = Path(__file__).with_name("attention_kernel.c")
ROWS_PER_BLOCK, KEYS_PER_TILE, HEAD_DIM = 6, 128, 64
USE = {"kernel": False, "packed": False}


def build() -> ctypes.CDLL:
    if "avx512f" not in Path("/proc/cpuinfo").read_text():
        raise SystemExit("the kernel needs an x86-64 CPU with AVX-512F")
    lib_path = Path(tempfile.mkdtemp()) / "attention_kernel.so"
    cmd = ["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(lib_path), str(SOURCE)]
    try:
        subprocess.run(cmd, check=True)
    except FileNotFoundError:
        raise SystemExit("the kernel is built with gcc, which is not installed") from None
    lib = ctypes.CDLL(str(lib_path))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.attend.argtypes = [p, p, p, p, i, i, i, i, ctypes.c_long, ctypes.c_float, p, i]
    lib.fill_block.argtypes = [p, p, p, p, i, i, ctypes.c_long, p, p]
    return lib


def _scratch(size: int, kept=[torch.empty(0)]) -> torch.Tensor:
    """The kernel's transposed keys: one buffer kept across calls, as fresh megabytes fault in slowly."""
    if kept[0].numel() < size:
        kept[0] = torch.empty(size)
    return kept[0]


def kernel_attention(lib, query, key, value, scale):
    """query [1, heads, n, 64] after key/value [1, kv_heads, past + n, 64] whose last n are its own."""
    _, heads, n, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if dim != HEAD_DIM or query.dtype != torch.float32 or key.stride(-2) != dim or key.stride() != value.stride():
        raise ValueError("the kernel takes float32, head_dim 64, keys and values of one layout")
    rows = heads // kv_heads * n
    padded = -(-rows // ROWS_PER_BLOCK) * ROWS_PER_BLOCK
    q = query.new_zeros(kv_heads, padded, dim)
    q[:, :rows] = query.reshape(kv_heads, rows, dim)
    out = torch.empty_like(q)
    scratch = _scratch(kv_heads * -(-length // KEYS_PER_TILE) * dim * KEYS_PER_TILE)
    lib.attend(q.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), kv_heads, padded, n, length - n,
               key.stride(1), scale or dim**-0.5, scratch.data_ptr(), 2)
    return out[:, :rows].reshape(1, heads, n, dim)


def kernel_fill(lib, workspace, pieces, inv_freq) -> int:
    """`kvrag.assemble.fill` in one pass per block: float16 storage only."""
    slot = 0
    for piece in pieces:
        block, n = piece.block, len(piece.block)
        if block.keys.dtype != torch.float16 or not block.keys.is_contiguous() or not block.values.is_contiguous():
            raise ValueError("the kernel's fill takes contiguous float16 blocks")
        delta = torch.tensor([piece.position - block.start])
        cos, sin = (x.contiguous() for x in delta_cos_sin(delta, inv_freq, torch.float32))
        keys, values = workspace.keys[:, 0, :, slot : slot + n], workspace.values[:, 0, :, slot : slot + n]
        groups = keys.shape[0] * keys.shape[1]
        lib.fill_block(block.keys.data_ptr(), block.values.data_ptr(), keys.data_ptr(), values.data_ptr(), groups, n,
                       keys.stride(1), cos.data_ptr(), sin.data_ptr())
        slot += n
    return slot


def check(lib):
    """Largest difference from SDPA with kvrag's mask, on random tensors in the model's layout."""
    for past in (34, 4119, 8044):
        query = torch.randn(1, 55, 9, 64).transpose(1, 2)
        buffers = torch.randn(2, 1, 3, past + 1000, 64)  # a workspace larger than the request
        key, value = buffers[0][:, :, : past + 55], buffers[1][:, :, : past + 55]
        mask = attention.causal_mask(55, past, torch.float32)
        expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
        diff = (kernel_attention(lib, query, key, value, None) - expected).abs().max().item()
        print(f"kernel vs SDPA, 55 queries after {past} keys: max |difference| {diff:.1e}")
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)
    pieces = [Piece(KVBlock(torch.zeros(n), *torch.randn(2, 30, 3, n, 64).half(), 0), position)
              for n, position in ((34, 0), (300, 34), (250, 334))]
    expected, got = (Workspace(30, 3, 64, 1024, torch.float32, "cpu") for _ in range(2))
    fill(expected, pieces, inv_freq), kernel_fill(lib, got, pieces, inv_freq)
    filled = slice(0, sum(len(piece.block) for piece in pieces))
    diff = max((got.keys - expected.keys)[..., filled, :].abs().max(),
               (got.values - expected.values)[..., filled, :].abs().max())
    print(f"kernel's fill vs kvrag's, three blocks moved: max |difference| {diff.item():.1e}")


def install(lib, models):
    """As USE says: the question's attention and the blocks' fill in C, the linear layers on packed weights."""
    sdpa = attention.grouped_sdpa_attention

    def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        if USE["kernel"] and attention_mask is not None and 1 < query.shape[2] <= 64:
            return kernel_attention(lib, query, key, value, scaling).transpose(1, 2).contiguous(), None
        return sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)

    AttentionInterface.register(attention.NAME, attend)
    kvrag.engine.fill = lambda *args: kernel_fill(lib, *args) if USE["kernel"] else fill(*args)
    for model in models:
        for name, layer in model.named_modules():
            if isinstance(layer, torch.nn.Linear) and not name.endswith("lm_head"):
                packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)

                def forward(x, layer=layer, packed=packed):
                    if USE["packed"]:
                        return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
                    return F.linear(x, layer.weight, layer.bias)

                layer.forward = forward


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="4096,8000", help="context tokens before the question")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    lib = build()
    check(lib)
    engine = KVEngine.from_pretrained()
    install(lib, {id(m): m for m in (engine.model, engine.causal_model)}.values())
    configs = {  # name: (mode, with passages, kernel)
        "floor": ("block", False, False), "floor+kernel": ("block", False, True),
        "full": ("full", True, False), "block": ("block", True, False), "block+kernel": ("block", True, True),
    }
    rows = []
    for length in map(int, args.lengths.split(",")):
        passages = make_passages(engine, length - len(engine.layout.prefix_ids))
        engine.index(passages, progress=False)

        def run(name, packed, max_new_tokens=1):
            mode, with_passages, kernel = configs[name]
            USE.update(kernel=kernel, packed=packed)
            context = passages if with_passages else []
            return engine.generate(QUESTION, context, mode=mode, max_new_tokens=max_new_tokens)

        answers = {(name, packed): run(name, packed, 24).text
                   for name in ("block", "block+kernel") for packed in (False, True)}
        print(f"{length}: greedy 24-token answers of block mode identical in all four settings:",
              len(set(answers.values())) == 1, repr(answers["block", False]))
        times = {}
        for _ in range(args.runs):
            for packed in (False, True):
                for name in configs:
                    times.setdefault((packed, name), []).append(run(name, packed).ttft)
        for packed in (False, True):
            med = {name: statistics.median(times[packed, name]) for name in configs}
            rows.append((length, "packed" if packed else "plain", med))
    print("\n| context | linear layers | floor ms | floor+kernel ms | full ms | block ms | block+kernel ms "
          "| full/block | full/(block+kernel) | (block+kernel)/(floor+kernel) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for length, linear, m in rows:
        print(f"| {length} | {linear} | {m['floor'] * 1e3:.0f} | {m['floor+kernel'] * 1e3:.0f} | {m['full'] * 1e3:.0f} "
              f"| {m['block'] * 1e3:.0f} | {m['block+kernel'] * 1e3:.0f} | {m['full'] / m['block']:.1f}x "
              f"| {m['full'] / m['block+kernel']:.1f}x | {m['block+kernel'] / m['floor+kernel']:.2f}x |")


if __name__ == "__main__":
    main()
