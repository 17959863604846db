"""Block fill speed: the C kernel (`kernels.fill_block` / `fill_quantized`) against torch's path, taking turns in
one process, for one 1,024-token block of the default model's shape (30 layers, 3 KV heads, head_dim 64) in each
storage format. Run after `kvrag kernels build`:  python docs/bench/fill_speed.py [rounds]"""
import statistics
import sys
import time

import torch

from kvrag import kernels, quant
from kvrag.assemble import Piece, fill
from kvrag.store import KVBlock
from kvrag.workspace import Workspace

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
assert kernels.library() is not None, kernels.status()
inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)
n, layers, heads = 1024, 30, 3
x = torch.randn(2, layers, heads, n, 64, generator=torch.Generator().manual_seed(0))
blocks = {"float16": KVBlock(torch.zeros(n), x[0].half(), x[1].half(), 0)}
for bits in (8, 4):
    blocks[f"int{bits}"] = KVBlock(torch.zeros(n), quant.quantize(x[0], bits, quant.KEYS),
                                   quant.quantize(x[1], bits, quant.VALUES), 0)
workspace = Workspace(layers, heads, 64, 4096, torch.float32, "cpu")
print(f"kernels: {kernels.status()}; {torch.get_num_threads()} threads; ms per block, median of {rounds}, turns")
print(f"{'format':>8} {'C ms':>7} {'torch ms':>9} {'torch/C':>8}")
for name, block in blocks.items():
    times = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            kernels.enabled = on
            start = time.perf_counter()
            fill(workspace, [Piece(block, 1000)], inv_freq)
            times[on].append(time.perf_counter() - start)
    c, t = (statistics.median(times[on]) * 1e3 for on in (True, False))
    print(f"{name:>8} {c:7.2f} {t:9.2f} {t / c:8.2f}")
