"""Hand-written CPU kernels for block mode's hot spots, with torch's kernels as the fallback.

`kernels.c` writes cached float16, 8- and 4-bit blocks into the request's float32 buffers in one pass
(dequantized and rotated on the way: plain C the compiler vectorizes, built on every Linux x86-64 CPU), and,
where the CPU has AVX-512F, computes the question's attention over a long cache (grouped heads folded into
rows, scores and outputs held in registers; with AVX512-BF16 the two products in bfloat16 pairs summed into
float32, `KVRAG_KERNELS=fp32` keeps float32). They run only where they apply: float32 compute, head_dim 64,
one sequence; everywhere else, and with `KVRAG_KERNELS=0`, torch runs, and `status()` says which and why.

Built ahead of requests, never during one: `build()` (`kvrag kernels build`, and `./run`'s set-up)
compiles with the system compiler (`$CC`, default `cc`) into this user's own directory,
`$KVRAG_HOME/kernels/user-<uid>/` (created 0700: the home may be shared, a build is not), and
records the library's SHA-256 beside it. A request loads a build only from a directory and file
that are this user's alone and whose bytes match that record; the loader gets a sealed in-memory
copy of exactly those bytes, so nothing done to the file afterwards (a rebuild, an edit in place)
changes the code a process runs. Anything else is never loaded, and torch runs. The library uses torch's own
OpenMP runtime (linked against it by path), so one thread pool and one wait policy serve both.
"""

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from .paths import kvrag_home

SOURCE = Path(__file__).with_name("kernels.c")
COMPILE = ["-O3", "-march=native", "-fopenmp", "-fPIC"]
HEAD_DIM, ROWS_PER_BLOCK = 64, 6
MAX_QUERIES = 64  # the attention kernel computes every key tile for every row, masked or not: made for a question
HINT = "`kvrag kernels build` makes block mode faster"

log = logging.getLogger(__name__)
_unavailable = ""  # why the kernels are not loaded, once tried
_lock = threading.Lock()


class Unverified(Exception):
    """A build that must not be loaded: not this user's alone, or not the bytes recorded at build."""


def use(setting: str) -> None:
    """As `KVRAG_KERNELS` (read at import): 0, off; fp32; bf16, bfloat16 products where the CPU has them."""
    global enabled, bf16
    if setting not in ("0", "fp32", "bf16"):
        raise ValueError(f"KVRAG_KERNELS must be 0, fp32 or bf16, not {setting!r}")
    enabled, bf16 = setting != "0", setting == "bf16"


use(os.environ.get("KVRAG_KERNELS", "bf16"))


def library() -> ctypes.CDLL | None:
    """The verified build, or None where the kernels are switched off, not built or cannot run here."""
    return _loaded() if enabled else None


def status() -> str:
    if not enabled:
        return "off (KVRAG_KERNELS=0)"
    lib = _loaded()
    if lib is None:
        return f"off ({_unavailable})"
    if not lib.has_attend:
        return "on (C block fills; attention in torch: the C attention needs AVX-512F)"
    return f"on (AVX-512 C kernels, {'bfloat16' if bf16 and lib.has_bf16 else 'float32'} attention products)"


def cpuinfo() -> str:
    """/proc/cpuinfo, or nothing where there is none."""
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.exists() else ""


def cpu_supported(flag: str = "avx512f") -> bool:
    """Whether this CPU has `flag` (the C attention needs avx512f; its bfloat16 products avx512_bf16)."""
    return machine_supported() and f" {flag}" in cpuinfo()


def machine_supported() -> bool:
    """Where the kernels are built and loaded at all: Linux (memfd, /proc) on x86-64 (the CPU they are tested on)."""
    return platform.system() == "Linux" and platform.machine() == "x86_64"


def directory() -> Path:
    """This user's builds: per user, so that a shared KVRAG_HOME never hands one user's code to another."""
    return kvrag_home() / "kernels" / f"user-{os.getuid()}"


def openmp_runtime() -> Path | None:
    """The GNU OpenMP runtime torch loaded into this process, which the build links against; None if torch
    uses another. Other packages (scikit-learn, say) may map libgomp copies of their own: torch's is the one
    under torch's install (torch/lib, or torch.libs in some wheels)."""
    package = Path(torch.__file__).resolve().parent
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)  # address, permissions, offset, device, inode, path
        if len(fields) == 6 and Path(fields[5]).name.startswith("libgomp"):
            path = Path(fields[5])
            if path.parent in (package / "lib", package.parent / "torch.libs"):
                return path
    return None


def build_path() -> Path:
    """Where the build for this source, compiler choice, CPU and OpenMP runtime lives (found without running anything)."""
    flags = next((line for line in cpuinfo().splitlines() if line.startswith("flags")), "")
    parts = [SOURCE.read_text(), os.environ.get("CC", "cc"), *COMPILE, flags, str(openmp_runtime())]
    return directory() / f"kernels-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}.so"


def build(force: bool = False) -> str:
    """Compile the kernels for this machine unless a verified build exists (or `force`), then load
    them; returns `status()`. Run it before requests: a request never compiles."""
    global _unavailable
    _load.cache_clear()
    if not machine_supported():
        return status()
    try:
        path = _compile(force)
    except (OSError, Unverified, subprocess.CalledProcessError) as e:
        detail = e.stderr.strip().splitlines()[-1] if isinstance(e, subprocess.CalledProcessError) and e.stderr else e
        _unavailable = f"the C kernels failed to build: {detail}"
        _load.cache_clear()
        return f"off ({_unavailable})"
    log.info("kvrag: C kernels in %s", path)
    return status()


def _compile(force: bool) -> Path:
    runtime = openmp_runtime()
    if runtime is None:
        raise OSError("torch does not use GNU OpenMP (libgomp), and a second OpenMP runtime is not wanted")
    path = build_path()
    _private_directory(path.parent, create=True)
    if not force:
        try:
            os.close(_open_verified(path))
            return path
        except (OSError, Unverified):  # missing, damaged or replaced: built afresh, the renames replace whatever is there
            pass
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise OSError(f"no C compiler {os.environ.get('CC', 'cc')!r} (set CC to one)")
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        obj, so = Path(tmp) / "kernels.o", Path(tmp) / "kernels.so"
        run = functools.partial(subprocess.run, capture_output=True, text=True, check=True)
        run([cc, *COMPILE, "-c", "-o", str(obj), str(SOURCE)])
        # torch's libgomp by path instead of -fopenmp's system one: the same runtime torch has loaded
        run([cc, "-shared", "-o", str(so), str(obj), str(runtime), f"-Wl,-rpath,{runtime.parent}", "-lm", "-Wl,--no-undefined"])
        digest = Path(tmp) / "kernels.sha256"
        digest.write_text(hashlib.sha256(so.read_bytes()).hexdigest() + "\n")
        os.replace(so, path)  # the library first: a loader between the two renames finds a mismatch, never a wrong match
        os.replace(digest, path.with_suffix(".sha256"))
    return path


def _private_directory(path: Path, create: bool = False) -> None:
    """Refuse a directory that is not this user's, or that group or others may write (or a link to one)."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise Unverified(f"{path} is not a directory that only this user can write")


def _private_file(fd: int, path: Path) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise Unverified(f"{path} is not a file that only this user can write")


def _open_verified(path: Path) -> int:
    """A sealed memfd holding `path`'s bytes, once the directory and file are this user's alone and
    those bytes match the SHA-256 recorded at build. FileNotFoundError where nothing was built."""
    _private_directory(path.parent)
    record = path.with_suffix(".sha256")
    fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        _private_file(file.fileno(), record)
        expected = file.read(200).decode(errors="replace").strip()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        _private_file(file.fileno(), path)
        data = file.read()
    if hashlib.sha256(data).hexdigest() != expected:
        raise Unverified(f"{path} does not match the SHA-256 recorded when it was built")
    # the loader maps what it opens: a copy nobody can write keeps the verified code, whatever the file becomes
    memfd = os.memfd_create("kvrag-kernels", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(memfd, view):]
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return memfd
    except BaseException:
        os.close(memfd)
        raise


def _loaded() -> ctypes.CDLL | None:
    with _lock:  # one load (and one warning) however many threads ask first
        return _load()


@functools.cache
def _load() -> ctypes.CDLL | None:
    """The verified build, never compiled here; a missing build is normal (info), a refused one warns once."""
    global _unavailable
    if not machine_supported():
        _unavailable = "they need Linux on an x86-64 CPU"
        log.info("kvrag: C kernels %s; torch's kernels run", _unavailable)
        return None
    path = build_path()
    try:
        fd = _open_verified(path)
    except FileNotFoundError:
        _unavailable = f"not built; {HINT}"
        log.info("kvrag: C kernels not built, torch's kernels run (%s)", HINT)
        return None
    except (OSError, Unverified) as e:
        _unavailable = f"not loaded: {e}"
        log.warning("kvrag: C kernels not loaded, torch's kernels run: %s (`kvrag kernels build` rebuilds them)", e)
        return None
    loaded = False
    try:
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
        # Once loaded, the descriptor stays open for the process's life: the loader knows a library by the
        # name it was opened under, and a later load under a reused /proc/self/fd/N would get this one back.
        loaded = True
        _check(_bind(lib))
        return lib
    except (OSError, AttributeError, RuntimeError) as e:
        if not loaded:
            os.close(fd)
        _unavailable = f"the C kernels failed to load: {e}"
        log.warning("kvrag: %s; torch's kernels run", _unavailable)
        return None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.fill_block.argtypes = [p, p, p, p, i, i, ctypes.c_long, p, p, i, ctypes.c_long]
    lib.fill_block.restype = i
    lib.fill_quantized.argtypes = [p, p, p, p, p, p, p, p, i, i, i, ctypes.c_long, p, p, i, ctypes.c_long]
    lib.fill_quantized.restype = i
    lib.has_attend = hasattr(lib, "attend")  # built where the compiler targets AVX-512F
    lib.has_bf16 = hasattr(lib, "attend_bf16")  # and AVX512-BF16
    for name in ("attend", "attend_bf16"):
        if hasattr(lib, name):
            getattr(lib, name).argtypes = [p, p, p, p, i, i, i, i, ctypes.c_long, ctypes.c_float, i]
    return lib


def _check(lib) -> None:
    """Refuse a build that disagrees with torch (a miscompiled library): a block fill, and attention against SDPA."""
    generator = torch.Generator().manual_seed(0)  # leaves the caller's random state alone
    block = torch.randn(2, 1, 2, 5, HEAD_DIM, generator=generator).half()
    block[1, 0, 0, 0, :4] = torch.tensor([6e-8, -3e-5, 65504.0, float("-inf")])  # subnormals and extremes convert exactly
    angle = torch.rand(HEAD_DIM // 2, generator=generator) * 6
    out = torch.empty(block.shape)
    fill_block(lib, block[0], block[1], out[0], out[1], angle.cos(), angle.sin())
    first, second = block[0].float().chunk(2, dim=-1)
    rotated = torch.cat([first * angle.cos() - second * angle.sin(), second * angle.cos() + first * angle.sin()], dim=-1)
    if not (torch.allclose(out[0], rotated, atol=1e-5) and torch.equal(out[1], block[1].float())):
        raise RuntimeError("its block fill differs from torch's")
    if not lib.has_attend:
        return
    query = torch.randn(1, 4, 7, HEAD_DIM, generator=generator)
    key, value = torch.randn(2, 1, 2, 300 + 7, HEAD_DIM, generator=generator)
    visible = torch.ones(7, 307, dtype=torch.bool).tril(300)  # the cache, then the question's own keys causally
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, enable_gqa=True)
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
    """Whether `fill_block` takes these: float16 blocks, float32 views with (layer, head) groups evenly spaced.
    (Blocks whose shape differs from the views' are refused before: `assemble.fill`.)"""
    return (
        block_keys.dtype == block_values.dtype == torch.float16 and out_keys.dtype == torch.float32
        and block_keys.device.type == out_keys.device.type == "cpu" and block_keys.shape[-1] == HEAD_DIM
        and block_keys.is_contiguous() and block_values.is_contiguous() and out_keys.stride() == out_values.stride()
        and out_keys.stride(-1) == 1 and out_keys.stride(-2) == HEAD_DIM
        and out_keys.stride(0) == out_keys.shape[1] * out_keys.stride(1)
    )


def _room(view: torch.Tensor) -> int:
    """Elements from the view's first to the end of the buffer it lies in."""
    return view.untyped_storage().nbytes() // view.element_size() - view.storage_offset()


def fill_block(lib, block_keys, block_values, out_keys, out_values, cos, sin) -> None:
    """Convert a float16 block [layers, kv_heads, n, 64] into float32 workspace views of the same shape,
    rotating its keys by (cos, sin); the same numbers as `rope.shift_keys` and a copy. A block of another
    shape than the views is a ValueError, checked here and again by the kernel against the buffers' ends."""
    if not block_keys.shape == block_values.shape == out_keys.shape == out_values.shape:
        raise ValueError(f"block {tuple(block_keys.shape)}/{tuple(block_values.shape)} does not fit the workspace's "
                         f"{tuple(out_keys.shape)}")
    layers, kv_heads, n, _ = block_keys.shape
    cos, sin = cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous()
    if lib.fill_block(block_keys.data_ptr(), block_values.data_ptr(), out_keys.data_ptr(), out_values.data_ptr(),
                      layers * kv_heads, n, out_keys.stride(1), cos.data_ptr(), sin.data_ptr(),
                      torch.get_num_threads(), min(_room(out_keys), _room(out_values))):
        raise ValueError(f"block {tuple(block_keys.shape)} refused by the kernel: it would write past the workspace")


def fill_quantized_applies(block_keys, block_values, out_keys, out_values) -> bool:
    """Whether `fill_quantized` takes these: an 8- or 4-bit block (`quant.Quantized`, codes and scales as `quant`
    makes them, on the CPU) for float32 views as `fill_applies` wants them."""
    from .quant import Quantized, group_shape, KEYS, VALUES

    if not (isinstance(block_keys, Quantized) and isinstance(block_values, Quantized)):
        return False
    shape = tuple(block_keys.shape)
    return (
        block_keys.bits == block_values.bits and tuple(block_values.shape) == shape and shape[-1] == HEAD_DIM
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (*block_keys.parts(), *block_values.parts()))
        and block_keys.codes.dtype == block_values.codes.dtype == torch.uint8
        and all(t.dtype == torch.float16 for t in (block_keys.scale, block_keys.low, block_values.scale, block_values.low))
        and tuple(block_keys.scale.shape) == tuple(block_keys.low.shape) == group_shape(shape, KEYS)
        and tuple(block_values.scale.shape) == tuple(block_values.low.shape) == group_shape(shape, VALUES)
        and out_keys.dtype == torch.float32 and out_keys.device.type == "cpu"
        and out_keys.stride() == out_values.stride() and out_keys.stride(-1) == 1 and out_keys.stride(-2) == HEAD_DIM
        and out_keys.stride(0) == out_keys.shape[1] * out_keys.stride(1)
    )


def fill_quantized(lib, block_keys, block_values, out_keys, out_values, cos, sin) -> None:
    """`fill_block` for an 8- or 4-bit block: the same numbers as `quant.dequantize`, then `rope.shift_keys` and a copy."""
    if not block_keys.shape == block_values.shape == out_keys.shape == out_values.shape:
        raise ValueError(f"block {tuple(block_keys.shape)}/{tuple(block_values.shape)} does not fit the workspace's "
                         f"{tuple(out_keys.shape)}")
    layers, kv_heads, n, _ = block_keys.shape
    cos, sin = cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous()
    pointers = [t.data_ptr() for t in (*block_keys.parts(), *block_values.parts())]
    if lib.fill_quantized(*pointers, out_keys.data_ptr(), out_values.data_ptr(), layers * kv_heads, n, block_keys.bits,
                          out_keys.stride(1), cos.data_ptr(), sin.data_ptr(), torch.get_num_threads(),
                          min(_room(out_keys), _room(out_values))):
        raise ValueError(f"block {tuple(block_keys.shape)} refused by the kernel: it would write past the workspace")
