"""Native CPU kernels for one-row products with quantized matrices (``matvec.cc``).

XLA's CPU code for a decode fused into a matrix-vector product is bound by its
arithmetic: unpacking, converting and scaling each code costs more than reading it
(docs/quantization.md, "Reading codes once"). ``matvec.cc`` does the same work in a
loop of 16-lane vectors on XLA's intra-op threads, registered as XLA FFI handlers
(``jax.ffi``), and `quant.fused` calls it for a one-token product on CPU. Each kernel
multiplies either the float row by the decoded codes (``activations="exact"``), or the
row rounded to 8-bit blocks by the codes as integers (``"int8"``, `place`'s
``activations``; docs/quantization.md, "Integer products").

The file is compiled on first use with the machine's C++ compiler (``$CXX``, else
``c++``, ``g++`` or ``clang++``) for the machine's own instruction set, against the
XLA FFI headers that ship with jaxlib, into ``$JAX_RESIDENCY_KERNEL_DIR`` (default: the
library's cache directory, ``kernels/``), under a name that hashes the source, the
compiler, jaxlib's version and the CPU: a later process loads it (a few seconds once,
then nothing). Only from a private directory: each directory from the cache directory
(or ``$JAX_RESIDENCY_KERNEL_DIR``) down, and the library file, must be this user's and
writable by no one else (`cache_dir.unsafe_to_load_from`). Where one is not, without a
compiler, or where the build fails, the products stay XLA's
(logged once, at warning level, naming the cause and the fix);
``JAX_RESIDENCY_NATIVE_KERNELS=0`` turns the kernels
off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jax_residency._src.cache_dir import library_cache_dir, unsafe_file, unsafe_to_load_from
from jax_residency._src.quant import ggml, ggml_mixed
from jax_residency._src.quant.encoding import GGML_SCHEME

#: ``0`` turns the native kernels off (products are XLA's).
ENV = "JAX_RESIDENCY_NATIVE_KERNELS"
#: Where built kernels are kept (default: ``kernels/`` in the library's cache directory).
KERNEL_DIR_ENV = "JAX_RESIDENCY_KERNEL_DIR"
#: The FFI targets, by scheme (``"ggml"``: a GGUF tensor of `GGML_TYPES`).
TARGETS = {
  "int4": "jax_residency_int4_matvec",
  "int8": "jax_residency_int8_matvec",
  "ggml": "jax_residency_ggml_matvec",
}
#: The handler symbols ``matvec.cc`` exports, by scheme.
_SYMBOLS = {"int4": "JrInt4Matvec", "int8": "JrInt8Matvec", "ggml": "JrGgmlMatvec"}
#: The GGML types ``matvec.cc`` multiplies by (a mixed tensor's, each of its types): every
#: type `quant.ggml` decodes.
GGML_TYPES = tuple(t.name for t in ggml.GGML_TYPES)
#: How a kernel takes its one-row product (`place`'s ``activations``): ``"exact"``
#: multiplies the float row by each decoded code; ``"int8"`` first rounds the row to
#: 8-bit blocks of `ROUNDED_BLOCK` values (a scale each) and multiplies integers, as
#: llama.cpp's CPU products do (docs/quantization.md, "Integer products").
ACTIVATIONS = ("exact", "int8")
#: Values of a rounded block of the row: a rounded product needs rows (int8, GGML) or
#: groups (int4: every group size) that are multiples of it, and is exact elsewhere.
ROUNDED_BLOCK = 32
#: Vector lanes of the kernels' loops: the input dimension (int8) and the group size
#: (int4) must be multiples of it.
LANES = 16
#: The most rows of ``x`` one call multiplies (``kMaxRows`` in ``matvec.cc``): the tokens
#: of a decode step, a speculative round or a tree's depth, a short prompt.
MAX_ROWS = 16
SOURCE = Path(__file__).with_name("matvec.cc")
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")

_log = logging.getLogger("jax_residency")
_lock = threading.Lock()
_state: dict[str, Any] = {}


def enabled() -> bool:
  """Whether the kernels may be used in this process (``$JAX_RESIDENCY_NATIVE_KERNELS``)."""
  return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def available() -> bool:
  """Whether the kernels are built, loaded and registered with XLA (building them on the
  first call). False where they are off, or cannot be built here (the reason is logged)."""
  if not enabled():
    return False
  with _lock:
    if "library" not in _state:
      _state["library"] = _load()
    return _state["library"] is not None


def build_error() -> str | None:
  """Why the kernels are not available, or None (after `available`)."""
  return _state.get("error")


def kernel_dir() -> Path:
  return _kernel_dirs()[1]


def _kernel_dirs() -> tuple[Path, Path]:
  """The directory checked first (``$JAX_RESIDENCY_KERNEL_DIR``, else the library's cache
  directory), and the kernel directory below it (or itself)."""
  explicit = os.environ.get(KERNEL_DIR_ENV)
  if explicit:
    return Path(explicit).expanduser(), Path(explicit).expanduser()
  return Path(library_cache_dir()), Path(library_cache_dir()) / "kernels"


def _compiler() -> str | None:
  for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


@functools.cache
def _cpu() -> str:
  """What ``-march=native`` compiles for: the CPU's model and flags where Linux says."""
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    return platform.processor()
  keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
  return "\n".join(sorted(set(keep)))


def _load() -> ctypes.CDLL | None:
  if platform.system() not in ("Linux", "Darwin"):
    _unavailable(f"no native kernels on {platform.system()}")
    return None
  root, directory = _kernel_dirs()
  unsafe = unsafe_to_load_from(str(directory), root=str(root))
  if unsafe is not None:
    _unavailable(
      f"the kernel directory is not private: {unsafe}; make it yours and writable by you "
      f"alone (chown, chmod 700), or set ${KERNEL_DIR_ENV} to a directory that is"
    )
    return None
  cxx = _compiler()
  if cxx is None:
    _unavailable("no C++ compiler found ($CXX, c++, g++, clang++)")
    return None
  try:
    path = library_path(cxx)
    if not path.exists():
      _build(cxx, path)
    if (unsafe := unsafe_file(str(path))) is not None:
      _unavailable(
        f"the kernel library is not private: {unsafe}; remove it (it is built again), "
        f"or set ${KERNEL_DIR_ENV} to a directory of your own"
      )
      return None
    try:
      lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError:  # a damaged file in the kernel directory: built again, once
      path.unlink(missing_ok=True)
      _build(cxx, path)
      lib = ctypes.cdll.LoadLibrary(str(path))
    for scheme, target in TARGETS.items():
      capsule = jax.ffi.pycapsule(getattr(lib, _SYMBOLS[scheme]))
      jax.ffi.register_ffi_target(target, capsule, platform="cpu")
  except (OSError, subprocess.SubprocessError, AttributeError, jax.errors.JaxRuntimeError) as e:
    _unavailable(str(e))
    return None
  return lib


def library_path(cxx: str) -> Path:
  """Where the build for compiler ``cxx`` is kept: its name hashes the source, the
  compiler, jaxlib's version, the CPU and the flags."""
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
  parts = (SOURCE.read_text(), cxx, version.stdout, jaxlib.__version__, _cpu(), *_FLAGS)
  key = hashlib.sha256(b"\0".join(p.encode() for p in parts)).hexdigest()[:16]
  return kernel_dir() / f"matvec-{key}.so"


def _build(cxx: str, path: Path) -> None:
  """Compiles ``matvec.cc`` to ``path``, through a temporary file renamed into place (a
  concurrent build in another process writes its own)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
  os.close(fd)
  try:
    cmd = [cxx, *_FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
      raise OSError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def _unavailable(why: str) -> None:
  _state["error"] = why
  _log.warning(
    "jax_residency: native quantized kernels unavailable (%s); one-token products of "
    "quantized weights use XLA's code (slower on CPU). Set %s=0 to silence this.",
    why,
    ENV,
  )


def supports(scheme: str, parts: list[Any], x: Any) -> bool:
  """Whether a kernel computes ``x @ rows.T`` for these parts: float32 ``x`` of the
  rows' length, one row ``(n,)`` or up to `MAX_ROWS` ``(m, n)``, two-dimensional parts
  (no stack of units), widths the loops take. ``scheme``: ``"int8"``, ``"int4"``, or
  ``"ggml:"`` and a GGUF tensor's types."""
  if len(x.shape) not in (1, 2) or x.dtype != jnp.float32:
    return False
  if len(x.shape) == 2 and not 1 <= x.shape[0] <= MAX_ROWS:
    return False
  if scheme.startswith(GGML_SCHEME):
    return _supports_ggml(_ggml_types(scheme), parts, x.shape[-1])
  if scheme not in TARGETS:
    return False
  codes, scale = parts[0], parts[1]
  if codes.ndim != 2 or scale.ndim != 2 or codes.shape[-1] != x.shape[-1]:
    return False
  if any(p.dtype != jnp.float32 for p in parts[1:]):
    return False
  if scheme == "int8":
    return codes.shape[-1] % LANES == 0
  group, rem = divmod(codes.shape[-1], scale.shape[-1])
  return rem == 0 and group % LANES == 0


def _ggml_types(scheme: str) -> list[str]:
  """The GGML types a ``"ggml:Q4_K+Q6_K"`` scheme names."""
  return scheme.removeprefix(GGML_SCHEME).split("+")


def _supports_ggml(types: list[str], parts: list[Any], n: int) -> bool:
  """Whether the GGML kernel takes rows of ``types`` (`GGML_TYPES`, at most 8) of ``n``
  values each (a multiple of `LANES`), as ``parts`` (one 2-D uint8 array) hold them."""
  blocks = parts[0]
  if len(parts) != 1 or blocks.ndim != 2 or blocks.dtype != jnp.uint8 or len(types) > 8:
    return False
  if n % LANES or any(t not in GGML_TYPES or n % ggml.ggml_type(t).block_size for t in types):
    return False  # the float types' loops take a vector of values at a time
  if len(types) == 1:
    return blocks.shape[1] == ggml.row_bytes(types[0], n)
  return blocks.shape[1] == ggml_mixed.mixed_row_bytes(types, n)


def rounds(scheme: str, parts: list[Any], x: Any) -> bool:
  """Whether the ``"int8"`` product rounds ``x`` for these parts (`supports` holds):
  rows of a multiple of `ROUNDED_BLOCK` values (int8, GGML), groups of one (int4)."""
  if scheme.startswith(GGML_SCHEME) or scheme == "int8":
    return x.shape[-1] % ROUNDED_BLOCK == 0
  return (x.shape[-1] // parts[1].shape[-1]) % ROUNDED_BLOCK == 0


def matvec(scheme: str, x: Any, parts: list[Any], activations: str = "exact") -> jax.Array:
  """``y[r] = sum_i x[i] * w[r, i]`` for the matrix ``w`` the parts decode to (rows
  along the input axis, `quant.schemes`), by the native kernel; for ``x`` of
  ``(m, n)`` (``m <= MAX_ROWS``), ``y`` ``(m, rows)``, each row as alone. ``activations``
  (`ACTIVATIONS`): ``"int8"`` rounds ``x`` to 8-bit blocks first where `rounds` says
  so (elsewhere, and for float GGML types, the product stays exact).

  Raises:
    RuntimeError: the kernels are not available here (`build_error` says why).
  """
  if not available():
    raise RuntimeError(f"the native kernels are not available: {build_error() or 'off'}")
  if activations not in ACTIVATIONS:
    raise ValueError(f"activations={activations!r}: one of {ACTIVATIONS}")
  rounded = np.int32(activations == "int8" and rounds(scheme, parts, x))
  if scheme.startswith(GGML_SCHEME):
    ids = [ggml.ggml_type(t).type_id for t in _ggml_types(scheme)]
    out = jax.ShapeDtypeStruct((*x.shape[:-1], parts[0].shape[0]), jnp.float32)
    call = jax.ffi.ffi_call(TARGETS["ggml"], out)
    return call(x, *parts, types=np.array(ids, np.int32), activations=rounded)
  rows = parts[1].shape[0]
  out = jax.ShapeDtypeStruct((*x.shape[:-1], rows), jnp.float32)
  return jax.ffi.ffi_call(TARGETS[scheme], out)(x, *parts, activations=rounded)
