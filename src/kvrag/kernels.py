"""Hand-written CPU kernels for block mode's two hot spots, with torch's kernels as the fallback.

With 4K-8K cached tokens, block mode spends most of its time in the question's attention over the
cache, where `kernels.c` (the grouped heads folded into rows, scores and outputs held in
registers) runs 55 queries over 4K-8K keys at ~160 GFLOP/s and torch's CPU flash kernel at ~95,
and some in writing the cached float16 blocks into the request's float32 buffers, which
`kernels.c` does in one pass. Where the CPU has AVX512-BF16 the attention's two products run in
bfloat16 pairs summed into float32, at twice the float32 rate: block mode's logits move by a few
hundredths and its answers barely (README: CPU kernels); `KVRAG_KERNELS=fp32` keeps float32,
which matches torch to rounding. Like inductor's CPU kernels, the C is built with the system
compiler (`$CC`, default `cc`), once per machine into KVRAG_HOME, and checked against torch when
loaded. It runs only where it applies: Linux on x86-64 with AVX-512F, float32 compute, head_dim
64, one sequence. Everywhere else, and with `KVRAG_KERNELS=0`, torch runs; `status()` says which
and why.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from .model import kvrag_home

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
HEAD_DIM, ROWS_PER_BLOCK = 64, 6
MAX_QUERIES = 64  # the attention kernel computes every key tile for every row, masked or not: made for a question

log = logging.getLogger(__name__)
_unavailable = ""  # why the kernels could not be loaded, once tried


def use(setting: str) -> None:
    """As `KVRAG_KERNELS` (read at import): 0, off; fp32; bf16, bfloat16 products where the CPU has them."""
    global enabled, bf16
    if setting not in ("0", "fp32", "bf16"):
        raise ValueError(f"KVRAG_KERNELS must be 0, fp32 or bf16, not {setting!r}")
    enabled, bf16 = setting != "0", setting == "bf16"


use(os.environ.get("KVRAG_KERNELS", "bf16"))


def library() -> ctypes.CDLL | None:
    """The built kernels, or None where they are switched off or cannot run here."""
    return _load() if enabled else None


def status() -> str:
    if not enabled:
        return "off (KVRAG_KERNELS=0)"
    lib = _load()
    if lib is None:
        return f"off ({_unavailable})"
    return f"on (AVX-512 C kernels, {'bfloat16' if bf16 and lib.has_bf16 else 'float32'} attention products)"


def cpuinfo() -> str:
    """/proc/cpuinfo, or nothing where there is none."""
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.exists() else ""


def cpu_supported(flag: str = "avx512f") -> bool:
    return platform.machine() == "x86_64" and f" {flag}" in cpuinfo()


@functools.cache
def _load() -> ctypes.CDLL | None:
    global _unavailable
    if not cpu_supported():
        _unavailable = "they need Linux on an x86-64 CPU with AVX-512F"
        log.info("kvrag: %s; torch's kernels run", _unavailable)
        return None
    try:
        lib = _bind(ctypes.CDLL(str(_build())))
        _check(lib)
        return lib
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = e.stderr.strip().splitlines()[-1] if isinstance(e, subprocess.CalledProcessError) and e.stderr else e
        _unavailable = f"the C kernels failed to build or load: {detail}"
        log.warning("kvrag: %s; torch's kernels run, slower with long cached contexts", _unavailable)
        return None


def _build() -> Path:
    """Compile kernels.c once per source, compiler and CPU; concurrent builders each rename a whole file."""
    cc = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        raise OSError(f"no C compiler {cc!r} (set CC to one)") from None
    flags = next((line for line in cpuinfo().splitlines() if line.startswith("flags")), "")
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, *FLAGS, flags]).encode()).hexdigest()[:16]
    path = kvrag_home() / "kernels" / f"kernels-{digest}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            subprocess.run([cc, *FLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True, check=True)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.attend.argtypes = [p, p, p, p, i, i, i, i, ctypes.c_long, ctypes.c_float, i]
    lib.fill_block.argtypes = [p, p, p, p, i, i, ctypes.c_long, p, p, i]
    lib.has_bf16 = hasattr(lib, "attend_bf16")  # built where the compiler targets AVX512-BF16
    if lib.has_bf16:
        lib.attend_bf16.argtypes = lib.attend.argtypes
    return lib


def _check(lib) -> None:
    """Refuse a build that disagrees with SDPA (a miscompiled or foreign library)."""
    from .attention import causal_mask

    generator = torch.Generator().manual_seed(0)  # leaves the caller's random state alone
    query = torch.randn(1, 4, 7, HEAD_DIM, generator=generator)
    key, value = torch.randn(2, 1, 2, 300 + 7, HEAD_DIM, generator=generator)
    mask = causal_mask(7, 300, torch.float32)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    if not torch.allclose(attend(lib, query, key, value, HEAD_DIM**-0.5, in_bf16=False), expected, atol=1e-5):
        raise RuntimeError("its attention differs from SDPA")
    if lib.has_bf16 and not torch.allclose(attend(lib, query, key, value, HEAD_DIM**-0.5, in_bf16=True), expected, atol=2e-2):
        raise RuntimeError("its bfloat16 attention differs from SDPA by more than bfloat16 rounding")


def attention_applies(query, key, value) -> bool:
    """Whether `attend` takes these tensors as they are (the caller vouches for the mask); it has no backward."""
    n, dim = query.shape[2], query.shape[3]
    return (
        not (query.requires_grad or key.requires_grad or value.requires_grad)
        and query.device.type == "cpu" and query.dtype == key.dtype == value.dtype == torch.float32
        and query.shape[0] == 1 and 1 < n <= MAX_QUERIES and dim == HEAD_DIM
        and query.shape[1] % key.shape[1] == 0 and key.shape[2] >= n
        and key.stride(-1) == 1 and key.stride(-2) == dim and key.stride() == value.stride()
    )


def attend(lib, query, key, value, scale: float, in_bf16: bool | None = None) -> torch.Tensor:
    """Attention of query [1, heads, n, 64] over key/value [1, kv_heads, past + n, 64] whose last n
    are the query's own: cached keys all visible, own keys causal. Returns [1, heads, n, 64].
    `in_bf16` (default: the module's `bf16` setting) asks for bfloat16 products where the build has them."""
    _, heads, n, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    rows = heads // kv_heads * n
    padded = -(-rows // ROWS_PER_BLOCK) * ROWS_PER_BLOCK
    q = query.new_zeros(kv_heads, padded, dim)
    q[:, :rows] = query.reshape(kv_heads, rows, dim)
    out = torch.empty_like(q)
    in_bf16 = bf16 if in_bf16 is None else in_bf16
    kernel = lib.attend_bf16 if in_bf16 and lib.has_bf16 else lib.attend
    kernel(q.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), kv_heads, padded, n, length - n,
           key.stride(1), scale, torch.get_num_threads())
    return out[:, :rows].reshape(1, heads, n, dim)


def fill_applies(block_keys, block_values, out_keys, out_values) -> bool:
    """Whether `fill_block` takes these: float16 blocks, float32 views with (layer, head) groups evenly spaced."""
    return (
        block_keys.dtype == block_values.dtype == torch.float16 and out_keys.dtype == torch.float32
        and block_keys.device.type == out_keys.device.type == "cpu" and block_keys.shape[-1] == HEAD_DIM
        and block_keys.is_contiguous() and block_values.is_contiguous() and out_keys.stride() == out_values.stride()
        and out_keys.stride(-1) == 1 and out_keys.stride(-2) == HEAD_DIM
        and out_keys.stride(0) == out_keys.shape[1] * out_keys.stride(1)
    )


def fill_block(lib, block_keys, block_values, out_keys, out_values, cos, sin) -> None:
    """Convert a float16 block [layers, kv_heads, n, 64] into float32 workspace views of the same shape,
    rotating its keys by (cos, sin); the same numbers as `rope.shift_keys` and a copy."""
    layers, kv_heads, n, _ = block_keys.shape
    cos, sin = cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous()
    lib.fill_block(block_keys.data_ptr(), block_values.data_ptr(), out_keys.data_ptr(), out_values.data_ptr(),
                   layers * kv_heads, n, out_keys.stride(1), cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
