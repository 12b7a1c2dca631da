"""``grace.ops.Ops`` over torch tensors, on the tensor's own device (CPU or CUDA)."""

from __future__ import annotations

import math

import numpy as np
import torch

from grace import kernels, native
from grace.ops import THIN_COLUMNS, HostAccess, Ops, index_dtype, unpack_table
from grace.rng import UNIFORM_SCALE, counter_uniform_bits

_HALVES = (torch.float16, torch.bfloat16)
"""The 16-bit floats whose sums ``scale_into`` widens into float32 with grace/native's loop."""


def _numpy_float(x: torch.Tensor) -> bool:
    """Whether numpy's sort and selection can take ``x`` in place of torch's (a float32 or float64
    CPU tensor): 4 to 15 times faster on the CPU here, with NaN last in both."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)


def _order_statistics(x: torch.Tensor, ranks) -> torch.Tensor:
    """The elements of 1-d ``x`` at 0-based ``ranks`` of its ascending order, by selection: numpy's
    introselect (one call for all the ranks) on the CPU, else a ``kthvalue`` per rank."""
    if _numpy_float(x):
        at = np.asarray([int(r) for r in ranks], np.int64)
        return torch.from_numpy(np.partition(x.detach().numpy(), at)[at])
    return torch.stack([torch.kthvalue(x, int(r) + 1).values for r in ranks])


def _ascending(positions: torch.Tensor, n: int) -> torch.Tensor:
    """Distinct ``positions`` in ``[0, n)`` in ascending order: on the CPU by a mask (linear, where
    a sort is not); on a GPU by a sort, since reading the mask back (``nonzero``) makes the host
    wait for the GPU."""
    if positions.device.type != "cpu":
        return torch.sort(positions).values
    mask = torch.zeros(n, dtype=torch.bool, device=positions.device)
    mask[positions] = True
    return torch.nonzero(mask).reshape(-1)


_CONSTANTS: dict = {}
CACHED_CONSTANT = 4096
"""Constants of up to this many elements are kept per device (``TorchOps.constant``)."""

WIDE_CHUNK = 1 << 20
"""Float64 sums of larger tensors run chunk by chunk: a float64 copy of a whole large gradient would
cost more than the sum (its pages are new memory)."""

_TABLES: dict = {}


def _unpack_table(bits: int, device) -> torch.Tensor:
    """``grace.ops.unpack_table`` on ``device``."""
    key = (bits, str(device))
    if key not in _TABLES:
        _TABLES[key] = torch.from_numpy(unpack_table(bits)).to(device)
    return _TABLES[key]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _scalar(value: float, dtype: torch.dtype) -> torch.Tensor:
    """A float64 result rounded once to ``dtype``, as a 1-element tensor."""
    if dtype in (torch.float32, torch.float64):  # the same single rounding, without the float64 step
        return torch.tensor([value], dtype=dtype)
    return torch.tensor([value], dtype=torch.float64).to(dtype)


class TorchOps(Ops):
    name = "torch"

    def shape(self, x):
        return tuple(x.shape)

    def dtype(self, x):
        return _name(x)

    def numel(self, x):
        return x.numel()

    def itemsize(self, dtype):
        return _dtype(dtype).itemsize

    def nbytes(self, x):
        return x.numel() * x.element_size()

    def zeros(self, n, dtype, like):
        return torch.zeros(n, dtype=_dtype(dtype), device=like.device)

    def flatten(self, x):
        return x.reshape(-1)

    def reshape(self, x, shape):
        return x.reshape(tuple(shape))

    def cast(self, x, dtype):
        target = _dtype(dtype)
        return x if x.dtype == target else x.to(target)

    def copy(self, x):
        return x.clone()

    def concat(self, xs):
        return torch.cat([x.reshape(-1) for x in xs])

    def adjacent(self, xs):
        first = xs[0]
        if first.layout != torch.strided:
            return None
        storage, offset, dtype = first.untyped_storage().data_ptr(), first.storage_offset(), first.dtype
        for x in xs:
            if (x.layout != torch.strided or x.dtype != dtype or not x.is_contiguous()
                    or x.untyped_storage().data_ptr() != storage or x.storage_offset() != offset):
                return None
            offset += x.numel()
        return first.as_strided((offset - first.storage_offset(),), (1,))

    def split(self, x, sizes):
        sizes = sizes.tolist() if isinstance(sizes, torch.Tensor) else [int(n) for n in sizes]
        return list(torch.split(x, sizes))

    def slice(self, x, start, length):
        start = int(start)
        return x[start:start + int(length)]

    def strided(self, x, stride):
        return x[::stride]

    def to_bytes(self, x):
        if x.numel() == 0:  # an empty tensor may have any strides, which view refuses
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        return x.reshape(-1).contiguous().view(torch.uint8)

    def from_bytes(self, b, dtype):
        target = _dtype(dtype)
        if b.storage_offset() % target.itemsize:  # a view of another dtype must start aligned
            b = b.clone()
        return b.view(target)

    def add(self, a, b):
        return a + b

    def add_into(self, a, b):
        if (self.writable(a) and a.dtype == b.dtype and a.shape == b.shape
                and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()):
            return a.add_(b)  # the same kernel as ``a + b``: the same bits
        return a + b

    def writable(self, x):
        # Not a tensor autograd tracks, and one that is all of its memory: a view into a larger
        # buffer (a flat gradient buffer, an expanded or strided view) is another tensor's too.
        return (not x.requires_grad and not x.is_sparse and x.is_contiguous()
                and x.storage_offset() == 0
                and x.untyped_storage().nbytes() == x.numel() * x.element_size())

    def sub(self, a, b):
        return a - b

    def scale(self, x, factor):
        return x * factor

    def scale_into(self, x, factor, out):
        if (out.requires_grad or out.layout != torch.strided or not out.is_contiguous()
                or x.numel() != out.numel() or not x.is_contiguous()
                or ((x.data_ptr() != out.data_ptr() or x.dtype != out.dtype)
                    and x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr())):
            # x in out's memory, elsewhere or of another width: a new tensor (a cast into it
            # would overwrite what it reads)
            return super().scale_into(x, factor, out)
        flat, x = out.view(-1), x.reshape(-1)
        if (x.dtype in _HALVES and out.dtype == torch.float32
                and kernels.applies(self, [x, out], dtypes=[])):
            # The cast and the product in one pass over the float32 tensor instead of two (fp16's
            # and bf16's sums decoded into a DDP bucket or a gradient): the same bits.
            native.widen_scaled_into(x.view(torch.int16).numpy(), x.dtype == torch.bfloat16,
                                     factor, flat.numpy())
            return out
        if x.dtype != out.dtype:  # a cast, then the product in out's dtype: scale's bits
            flat.copy_(x)
            x = flat
        if factor != 1.0:
            torch.mul(x, factor, out=flat)  # the kernel of ``x * factor``
        elif x.data_ptr() != flat.data_ptr():
            flat.copy_(x)
        return out

    def abs(self, x):
        return x.abs()

    def topk_indices(self, x, k):
        if x.device.type != "cpu":
            # On a GPU the framework's top-k is fast, and the sampled threshold's candidates would
            # have to be counted on the host (a wait for the GPU per tensor).
            return self.full_topk_indices(x, k)
        return super().topk_indices(x, k)

    def full_topk_indices(self, x, k):
        n = x.numel()
        return _ascending(torch.topk(x.abs(), k, sorted=False).indices, n).to(_dtype(index_dtype(n)))

    def gather(self, x, indices):
        return torch.index_select(x, 0, indices)

    def scatter_add(self, n, indices, values):
        if kernels.applies(self, [values], numel=n):
            # Zeros from fresh pages (no pass to clear them), then one loop over the values.
            return torch.from_numpy(native.scatter_add(n, indices.numpy(), values.detach().numpy()))
        out = torch.zeros(n, dtype=values.dtype, device=values.device)
        return out.index_add_(0, indices, values)

    def unique(self, x):
        values, inverse = torch.unique(x, sorted=True, return_inverse=True)
        return values, inverse.reshape(-1).to(torch.int64)

    def divmod(self, x, divisor):
        return torch.div(x, divisor, rounding_mode="floor"), torch.remainder(x, divisor)

    def add_rows(self, count, positions, rows):
        out = torch.zeros((int(count), rows.shape[1]), dtype=rows.dtype, device=rows.device)
        return out.index_add_(0, positions.to(torch.int64), rows)

    def zero_at(self, x, indices, overwrite=False, after=()):
        return (x if overwrite else x.clone()).index_fill_(0, indices.long(), 0)

    def full(self, n, value, dtype, like):
        return torch.full((n,), value, dtype=_dtype(dtype), device=like.device)

    def arange(self, n, dtype, like):
        return torch.arange(n, dtype=_dtype(dtype), device=like.device)

    def constant(self, values, dtype, like):
        if like.device.type == "cpu":
            return torch.as_tensor(values, dtype=_dtype(dtype)).reshape(-1)
        # A copy from the host to a GPU waits for the GPU: each small constant is made once per
        # device (they are read, never written).
        values = np.asarray(values).reshape(-1)
        key = (values.tobytes(), str(values.dtype), dtype, str(like.device))
        if values.size > CACHED_CONSTANT or key not in _CONSTANTS:
            made = torch.as_tensor(values, dtype=_dtype(dtype), device=like.device)
            if values.size > CACHED_CONSTANT:
                return made
            _CONSTANTS[key] = made
        return _CONSTANTS[key]

    def mul(self, a, b):
        return a * b

    def div(self, a, b):
        return a / b

    def sign(self, x):
        return torch.sign(x)

    def where(self, cond, a, b):
        return torch.where(cond, a, b)

    def greater_equal(self, a, b):
        return a >= b

    def less(self, a, b):
        return a < b

    def equal(self, a, b):
        return a == b

    def floor(self, x):
        return torch.floor(x)

    def round(self, x):
        return torch.round(x)

    def exponent_bits(self, x):
        return (x.to(torch.float32).view(torch.int32) >> 23) & 0xFF

    def power_of_two(self, exponent):
        return (exponent.to(torch.int32) << 23).view(torch.float32)

    def bucketize(self, x, boundaries):
        return torch.bucketize(x, boundaries, right=True, out_int32=True)

    def sqrt(self, x):
        return torch.sqrt(x)

    def maximum(self, a, b):
        return torch.clamp(a, min=b) if not isinstance(b, torch.Tensor) else torch.maximum(a, b)

    def minimum(self, a, b):
        return torch.clamp(a, max=b) if not isinstance(b, torch.Tensor) else torch.minimum(a, b)

    def sum(self, x):
        if kernels.applies(self, [x]):
            return _scalar(native.sums(x.detach().numpy())[0], x.dtype)
        if x.is_floating_point():
            if x.numel() > WIDE_CHUNK:
                total = sum(part.sum(dtype=torch.float64) for part in x.reshape(-1).split(WIDE_CHUNK))
                return total.to(x.dtype).reshape(1)
            return x.sum(dtype=torch.float64).to(x.dtype).reshape(1)
        return x.sum().reshape(1)

    def row_sums(self, x):
        if x.device.type == "cpu":
            return super().row_sums(x)
        return x.sum(1, dtype=torch.float64).to(x.dtype)

    def norm(self, x):
        if kernels.applies(self, [x]):
            return _scalar(math.sqrt(native.sums(x.detach().numpy())[1]), x.dtype)
        if x.numel() <= WIDE_CHUNK:
            return super().norm(x)
        total = 0.0
        for part in x.reshape(-1).split(WIDE_CHUNK):
            wide = part.to(torch.float64)
            total = total + torch.dot(wide, wide)
        return torch.sqrt(total).to(x.dtype).reshape(1)

    def max(self, x):
        return x.max().reshape(1) if x.numel() else torch.zeros(1, dtype=x.dtype, device=x.device)

    def nonfinite_flag(self, x):
        if x.numel() == 0 or not x.is_floating_point():
            return torch.zeros(1, dtype=torch.float32, device=x.device)
        # The extremes are not finite exactly when some element is not (NaN propagates through
        # min and max): one reduction, no tensor of booleans.
        low, high = torch.aminmax(x)
        return (~(torch.isfinite(low) & torch.isfinite(high))).to(torch.float32).reshape(1)

    def nonzero(self, mask):
        return torch.nonzero(mask).reshape(-1).to(_dtype(index_dtype(mask.numel())))

    def sort(self, x):
        if _numpy_float(x):
            return torch.from_numpy(np.sort(x.detach().numpy()))
        return torch.sort(x).values

    def cond(self, pred, true_fn, false_fn):
        return true_fn() if bool(pred) else false_fn()

    def pack_bits(self, codes, bits):
        if 8 % bits == 0:
            # Codes per byte: whole codes never straddle a byte, so each byte is a few shifted ORs
            # of one column of codes (byte-sized work, no bit planes).
            per = 8 // bits
            c = codes.to(torch.uint8)
            c = torch.nn.functional.pad(c, (0, (-c.numel()) % per)).reshape(-1, per)
            out = c[:, 0].clone()
            for j in range(1, per):
                out |= c[:, j] << (bits * j)
            return out
        shifts = torch.arange(bits, dtype=torch.int32, device=codes.device)
        planes = ((codes.to(torch.int32).reshape(-1, 1) >> shifts) & 1).reshape(-1)
        planes = torch.nn.functional.pad(planes, (0, (-planes.numel()) % 8))
        weights = 1 << torch.arange(8, dtype=torch.int32, device=codes.device)
        return (planes.reshape(-1, 8) * weights).sum(1).to(torch.uint8)

    def unpack_bits(self, packed, bits, n):
        if 8 % bits == 0:
            # A table from each byte value to its codes: one gather of rows.
            table = _unpack_table(bits, packed.device)
            return table[packed.to(torch.int64)].reshape(-1)[:n]
        shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
        planes = ((packed.to(torch.int32).reshape(-1, 1) >> shifts) & 1).reshape(-1)[: n * bits]
        weights = 1 << torch.arange(bits, dtype=torch.int32, device=packed.device)
        return (planes.reshape(n, bits) * weights).sum(1, dtype=torch.int32)

    def unpack_values(self, packed, bits, n, values):
        if 8 % bits != 0:
            return super().unpack_values(packed, bits, n, values)
        # A table from each byte value to the values of its codes: the output is written once.
        table = values[_unpack_table(bits, packed.device).to(torch.int64)]
        return table[packed.to(torch.int64)].reshape(-1)[:n]

    def max_abs(self, x):
        if x.numel() == 0:
            return torch.zeros(1, dtype=x.dtype, device=x.device)
        if kernels.applies(self, [x]):
            return _scalar(native.sums(x.detach().numpy())[2], x.dtype)
        # The infinity norm is the largest magnitude, without a tensor of magnitudes.
        return torch.linalg.vector_norm(x, float("inf")).reshape(1)

    def order_statistics(self, x, ranks):
        if len(ranks) > 4 and not _numpy_float(x):
            return super().order_statistics(x, ranks)
        # Selection (linear time) instead of a sort.
        return _order_statistics(x, ranks)

    def count_at_least(self, x, threshold):
        if kernels.applies(self, [x]):
            return native.count_at_least(x.detach().numpy(), float(threshold))
        return int(torch.count_nonzero(x.abs() >= threshold))

    def indices_at_least(self, x, threshold):
        if not kernels.applies(self, [x]):
            return super().indices_at_least(x, threshold)
        dtype = index_dtype(x.numel())
        return torch.from_numpy(native.indices_at_least(x.detach().numpy(), float(threshold), dtype))

    def host_access(self, tensors):
        return HostAccess(on_host=all(t.device.type == "cpu" for t in tensors),
                          contiguous=all(t.is_contiguous() for t in tensors), crossing=False)

    def random_uniform(self, n, seed_of, step, like):
        seed = seed_of(int(step))
        if kernels.applies(self, [like], numel=n, dtypes=[]):
            return torch.from_numpy(native.uniform(n, seed))
        if like.device.type != "cpu":
            # The same counter-based draws, computed where the tensor lives (no host transfer).
            index = torch.arange(n, dtype=torch.int64, device=like.device)
            return counter_uniform_bits(index, seed).to(torch.float32) * UNIFORM_SCALE
        return super().random_uniform(n, seed_of, step, like)

    def matmul(self, a, b, transpose_a=False, transpose_b=False, subtract_from=None):
        if (subtract_from is None and not transpose_b and a.dim() == b.dim() == 2
                and b.shape[1] <= THIN_COLUMNS and a.device.type == "cpu"):
            # A large matrix times a thin one (PowerSGD's M Q and Mᵀ P): CPU BLAS multiplies a
            # row-major thin operand 5-10 times slower than one pass over the matrix takes, so Mᵀ P
            # is computed as (Pᵀ M)ᵀ, reading M as it lies, and M Q with Q column-major
            # (docs/performance.md, "PowerSGD's products").
            if transpose_a:
                return (b.T @ a).T
            return a @ b.T.contiguous().T
        a, b = a.T if transpose_a else a, b.T if transpose_b else b
        return torch.matmul(a, b) if subtract_from is None else torch.addmm(subtract_from, a, b, alpha=-1)

    def orthogonalize(self, x):
        return torch.linalg.qr(x).Q

    def from_numpy(self, array, like):
        return torch.from_numpy(array).to(like.device)

    def to_numpy(self, x):
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
