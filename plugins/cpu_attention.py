"""The `cpu` attention backend: float32 decodes read K/V in place from the paged cache, through a small C kernel.

The `torch` backend gathers each decode's blocks into a dense tensor before calling SDPA, so every step copies the
whole KV context once more than it reads it. kernels/cpu_attention.c reads the blocks where they are (1.7-3x less
time per decode batch on a 2-core CPU; docs/PERF.md). It is compiled at first use with the system C compiler
(``$CC``, else cc, gcc or clang; OpenMP needed) and cached under ``$XDG_CACHE_HOME/infer`` (default
``~/.cache/infer``), keyed by the source, the flags, the compiler and the CPU. Prefills and chunks take the torch
backend's path, and so does everything when the model or the KV cache is not float32.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.config import EngineConfig
from ..core.errors import PluginError
from ..core.interfaces import AttentionMetadata
from .torch_attention import TorchAttention

log = logging.getLogger("infer")
SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "cpu_attention.c"
HINT = "or use --attention torch"


SHORT_QUERY = 8  # queries up to this long (a draft round's first step, a verification) run as one decode per token


@dataclass
class CpuDecodes:
    rows: torch.Tensor  # [S] int64 flat rows of the query tokens, each attended as a decode
    tables: torch.Tensor  # [S, W] int32 block tables (a sequence's, once per query token)
    lens: torch.Tensor  # [S] int32 context lengths (a query token sees the context up to itself: causal)
    max_len: int
    max_block: int  # the largest block id in ``tables`` and the largest row: checked against the tensors of each
    max_row: int  # layer before any pointer reaches C


class CpuAttention(TorchAttention):
    """Decodes through the C kernel when ``use_kernel`` (float32 model and KV cache); the rest as ``torch``."""

    def __init__(self, kernel: Any, use_kernel: bool) -> None:
        super().__init__()
        self.kernel, self.use_kernel = kernel, use_kernel
        self.short_query = SHORT_QUERY if use_kernel else TorchAttention.short_query

    def _plan_decodes(self, meta: AttentionMetadata, decode_idx: list[int], starts: list[int]) -> Any:
        if not self.use_kernel:
            return super()._plan_decodes(meta, decode_idx, starts)
        if not decode_idx:
            return None
        rows, lens, owners = [], [], []
        for i in decode_idx:  # query token j of n sees the context up to its own position
            n, length = meta.query_lens_cpu[i], meta.context_lens_cpu[i]
            rows.extend(range(starts[i], starts[i] + n))
            lens.extend(range(length - n + 1, length + 1))
            owners.extend([i] * n)
        width = -(-max(lens) // meta.block_size)
        tables = meta.block_tables[owners, :width].to(torch.int32).contiguous()
        if tables.shape[1] < width or int(tables.min()) < 0:  # the kernel reads table[len // block_size] blindly
            raise PluginError(f"block tables of width {tables.shape[1]} (min entry {int(tables.min())}) cannot hold "
                              f"contexts of {max(lens)} tokens in blocks of {meta.block_size}")
        return CpuDecodes(torch.tensor(rows, dtype=torch.int64), tables, torch.tensor(lens, dtype=torch.int32),
                          max(lens), int(tables.max()), max(rows))

    def _attend_decodes(self, decodes: Any, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                        scale: float, out: torch.Tensor, window: int | None = None,
                        softcap: float | None = None) -> None:
        if not self.use_kernel:
            return super()._attend_decodes(decodes, q, kv_cache, scale, out, window, softcap)
        if decodes is None:
            return None
        k_cache, v_cache = kv_cache
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        for name, t in (("q", q), ("out", out), ("k cache", k_cache), ("v cache", v_cache)):
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise PluginError(f"the cpu attention kernel needs float32 CPU tensors, got {name} {t.dtype} on "
                                  f"{t.device}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous() and q.stride(2) == 1
                and q.stride(1) == head_dim and q.shape[1] % kv_heads == 0 and decodes.max_block < num_blocks
                and decodes.max_row < q.shape[0] == out.shape[0]):
            raise PluginError("the cpu attention kernel got tensors of an unexpected layout")
        seqs = decodes.rows.numel()
        failed = self.kernel(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), decodes.tables.data_ptr(),
            decodes.tables.stride(0), decodes.lens.data_ptr(), decodes.rows.data_ptr(), seqs, q.shape[1], kv_heads,
            head_dim, block_size, decodes.max_len, scale, out.data_ptr(), out.stride(0),
            min(torch.get_num_threads(), seqs), window or 0, softcap or 0.0)
        if failed:
            raise PluginError(f"the cpu attention kernel could not allocate its scores ({decodes.max_len} per head)")
        return None


def find_compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise PluginError(f"the cpu attention backend compiles a small C kernel and needs a C compiler (cc, gcc or "
                      f"clang, or $CC); none was found: install one {HINT}")


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))}))


def build_kernel(cache_dir: Path | None = None) -> Any:
    """Compile the kernel (once per source, flags, compiler and CPU), load it and return its C function. Every
    failure, the file system's and the loader's included, is a PluginError."""
    cc = find_compiler()
    native = "-march=native" if platform.machine().lower() in ("x86_64", "amd64") else "-mcpu=native"
    # -ffast-math only compiles: linked with it, gcc adds crtfastmath.o, whose constructor turns on flush-to-zero
    # for the whole process when the library loads (torch would then lose every subnormal float).
    compile_flags = ["-O3", native, "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fPIC", "-c"]
    link_flags = ["-shared", "-fopenmp"]
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(compile_flags + link_flags).encode(),
                                         version.encode(), _cpu_identity().encode()])).hexdigest()[:16]
        cache_dir = cache_dir or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "infer"
        library = cache_dir / f"cpu_attention-{key}.so"
        if not library.exists():
            cache_dir.mkdir(parents=True, exist_ok=True)
            log.info("compiling the cpu attention kernel into %s (once)", library)
            with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
                built, obj = Path(tmp) / library.name, Path(tmp) / "cpu_attention.o"
                for command in ([cc, *compile_flags, str(SOURCE), "-o", str(obj)],
                                [cc, *link_flags, str(obj), "-o", str(built), "-lm"]):
                    result = subprocess.run(command, capture_output=True, text=True)
                    if result.returncode != 0:
                        raise PluginError(f"building {SOURCE.name} with {cc} failed; fix the compiler (OpenMP is "
                                          f"needed) {HINT}:\n{result.stderr[-2000:]}")
                os.replace(built, library)  # atomic: a concurrent engine never loads a half-written file
        function = ctypes.CDLL(str(library)).paged_decode_attention_f32
    except OSError as exc:
        raise PluginError(f"the cpu attention kernel could not be built or loaded ({exc}); set XDG_CACHE_HOME to a "
                          f"writable folder {HINT}") from exc
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    function.argtypes = [pointer, i64, pointer, pointer, pointer, i64, pointer, pointer, i32, i32, i32, i32, i32, i32,
                         ctypes.c_float, pointer, i64, i32, i32, ctypes.c_float]
    function.restype = i32
    return function


def create_backend(config: EngineConfig) -> CpuAttention:
    """Factory: the CPU only; compiles the kernel on first use (PluginError when it cannot)."""
    if config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available()):
        raise PluginError(f"the cpu attention backend runs on the CPU, not on {config.device!r} (CUDA available: "
                          f"{torch.cuda.is_available()}); use --device cpu or --attention triton")
    use_kernel = config.dtype in ("auto", "float32") and config.kv_cache_dtype == "auto"
    if not use_kernel:
        log.info("cpu attention: the C kernel reads float32 caches only, so with --dtype %s and --kv-cache-dtype %s "
                 "every step runs the torch path", config.dtype, config.kv_cache_dtype)
    return CpuAttention(build_kernel(), use_kernel)
