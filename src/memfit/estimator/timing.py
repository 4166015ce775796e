"""Predict a training step's time on a named GPU from the operations of the fake steps.

Why: plan and fit on a simulated GPU (and ``memfit estimate --gpu``) must rank settings by
the speed of the GPU the user will train on, not by the CPU's. The fake steps of the
estimator (:mod:`memfit.estimator.fake`) already run every ATen operation of a step on
fake tensors; :class:`OpCounter` records, for each operation of one steady-state step, its
floating-point operations (PyTorch's own formulas, ``torch.utils.flop_counter``) and the
bytes it reads and writes. :func:`predict` then times each operation on the GPU of the table
(:mod:`memfit.memory.gpus`) by a roofline and replays the step as the host and the GPU run
it:

- **device time** of a kernel = max(FLOPs / (peak x :data:`COMPUTE_EFFICIENCY`),
  bytes / (bandwidth x :data:`MEMORY_EFFICIENCY`)) + :data:`KERNEL_GAP_SECONDS`. Matrix
  products, convolutions and attention use the tensor-core peak of their dtype: fp16 or
  bf16; fp32 as tf32 where PyTorch allows it (``torch.backends.cuda.matmul.allow_tf32``, set
  by ``torch.set_float32_matmul_precision("high")``, for matmuls; ``torch.backends.cudnn.
  allow_tf32`` for convolutions), else the fp32 peak. Every other kernel is timed by the
  bytes it moves.
- **host time**: every ATen operation costs the host :data:`HOST_SECONDS_PER_OP` (Python,
  the dispatcher, autograd, the kernel launch); views and allocations launch no kernel.
- the host queues kernels ahead of the GPU: a kernel starts when the host has launched it
  and the previous kernel has finished; a read of a value on the host (``loss.item()``,
  GradScaler's found-inf check) waits for the GPU. So a step of large kernels takes its
  device time, and a step of tiny kernels its host time.

The step is ``accumulation`` micro-batches (forward and backward) and one optimizer step;
samples/s = samples per step / seconds per step. Not counted: the data loader and the copy
of the batch to the GPU (a loader's prefetch overlaps them), communication between ranks,
and torch.compile or CUDA graphs (the prediction is for eager PyTorch).

Every constant is stated once, with its source, and none was fitted to a benchmark.

>>> from memfit.memory.gpus import lookup
>>> counter = OpCounter(step=0)
>>> counter.add(Kind.MATMUL, 2 * 4096**3, 3 * 4096 * 4096 * 2, DType.HALF, phase="forward")
>>> time = predict(counter.trace(), lookup("A100 80GB SXM"), samples_per_step=1)
>>> round(time.seconds_per_step * 1e3, 3)  # 137 GFLOP at 0.826 x 312 TFLOP/s, plus launch
0.544
"""

from __future__ import annotations

import array
from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import torch

from memfit.cuda.kernels import Kernel
from memfit.estimator.flops import conv_backward_flops
from memfit.memory.gpus import GPU
from memfit.memory.tracker import current_labels

__all__ = [
    "Kind",
    "DType",
    "OpArrays",
    "OpCounter",
    "OpTrace",
    "StepTime",
    "predict",
    "tf32_settings",
    "COMPUTE_EFFICIENCY",
    "MEMORY_EFFICIENCY",
    "HOST_SECONDS_PER_OP",
    "KERNEL_GAP_SECONDS",
]

#: Fraction of the published dense peak a large matrix product reaches: the median of the
#: NVIDIA rows of Stas Bekman's "Maximum Achievable Matmul FLOPS" table (ml-engineering,
#: compute/accelerator/README.md: A100 SXM 85.9 %, GH200 83.0 %, A100 PCIe 82.2 %, H100 SXM
#: 80.1 %, bf16 matmul, CUDA 12).
COMPUTE_EFFICIENCY = 0.826
#: Fraction of the published memory bandwidth a streaming kernel reaches: 750 GB/s of the
#: V100's 900 GB/s measured by Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via
#: Microbenchmarking" (arXiv:1804.06826, 2018).
MEMORY_EFFICIENCY = 750 / 900
#: Host time of one eager ATen operation (Python, dispatcher, autograd, cudaLaunchKernel):
#: the order of magnitude of PyTorch's per-operator overhead; an assumption, stated once.
HOST_SECONDS_PER_OP = 10e-6
#: GPU time between two back-to-back kernels: NVIDIA's "Getting Started with CUDA Graphs"
#: (2019) measures 3.8 us per kernel for kernels of 2.9 us launched back to back in a stream.
KERNEL_GAP_SECONDS = 0.9e-6


class Kind(IntEnum):
    """What an operation is, as the replay times it (stored in an ``array("b")``)."""

    #: a kernel timed by the bytes it moves
    KERNEL = 0
    #: a matrix product (cuBLAS), timed by its FLOPs or its bytes
    MATMUL = 1
    #: a convolution (cuDNN), timed by its FLOPs or its bytes
    CONV = 2
    #: a view or an allocation: host time only
    NO_KERNEL = 3
    #: a read of a value on the host: waits for the GPU
    SYNC = 4
    #: not an ATen call (an attribute read): not counted at all
    IGNORED = 5


class DType(IntEnum):
    """The dtype of an operation's inputs, as far as the peaks tell them apart."""

    SINGLE = 0
    HALF = 1
    BFLOAT = 2
    OTHER = 3


_DTYPES = {torch.float32: DType.SINGLE, torch.float16: DType.HALF, torch.bfloat16: DType.BFLOAT}
#: what a reported CUDA kernel's FLOPs run on (memfit.cuda.kernels.Engine), as a kind here
_ENGINES = {"matmul": Kind.MATMUL, "cudnn": Kind.CONV, "none": Kind.KERNEL}

#: operations that launch no kernel (beyond views, which ``OpOverload.is_view`` tells)
_NO_KERNEL = frozenset(
    {
        "empty",
        "empty_strided",
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "detach",
        "alias",
        "lift_fresh",
        "lift_fresh_copy",
        "_reshape_alias",
        "_unsafe_view",
        "resize_",
        "set_",
        "record_stream",
        "is_same_size",
        "_has_compatible_shallow_copy_type",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "result_type",
    }
)
#: operations that make the host wait for the GPU
_SYNC = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal"})
#: operations that read only the rows they gather, not their whole first input
_GATHER = frozenset({"embedding", "index_select", "gather", "index", "take"})
#: cuDNN's operations (tf32 there follows torch.backends.cudnn.allow_tf32)
_CONV = frozenset({"convolution", "_convolution", "cudnn_convolution", "convolution_backward"})


def _activation_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the NCHW activations among ``tensors`` (4-D, contiguous, more than one channel)."""
    return sum(
        _nbytes(t)
        for t in tensors
        if t.dim() == 4
        and t.shape[1] > 1
        and t.is_contiguous()
        and not t.is_contiguous(memory_format=torch.channels_last)
    )


def _extra_passes(name: str, kind: Kind, dtype: DType, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    """Bytes the GPU's kernels move beyond one read of each input and one write of each
    output, where the CUDA implementation is known to make more passes.

    - Batch norm in training (PyTorch's CUDA kernels, aten/src/ATen/native/cuda/
      Normalization.cuh): forward reads its input twice (statistics, then normalize);
      backward reads the gradient and the input twice (the reductions, then the
      element-wise pass).
    - Tensor-core convolutions on 16-bit NCHW tensors: cuDNN's tensor-core kernels work on
      NHWC, so each NCHW activation is transposed in or out (one more read and write):
      NVIDIA, "Convolutional Layers User's Guide", section "Tensor Layouts In Memory: NCHW
      vs NHWC" (channels_last tensors need no transpose).
    """
    if name in ("native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm"):
        return _nbytes(inputs[0]) if inputs else 0
    if name in ("native_batch_norm_backward", "cudnn_batch_norm_backward", "batch_norm_backward"):
        return sum(_nbytes(t) for t in inputs[:2])
    if kind == Kind.CONV and dtype in (DType.HALF, DType.BFLOAT):
        weightless = [t for t in inputs if t.dim() == 4 and t.shape[1] > 1]
        return 2 * _activation_bytes([*weightless, *[t for t in outputs if t.dim() == 4]])
    return 0


def _flop_formulas() -> dict[Any, Any]:
    from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

    formulas = dict(flop_registry)
    # PyTorch's convolution backward ignores groups in the weight gradient (memfit.estimator.flops)
    formulas[torch.ops.aten.convolution_backward] = conv_backward_flops
    # The CPU's fused attention (what fake steps on the CPU take without dropout) does the
    # same products as CUDA's flash attention; PyTorch's registry lacks it.
    aten = torch.ops.aten
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", sdpa_flop),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", sdpa_backward_flop),
    ):
        if hasattr(aten, name):
            formulas[getattr(aten, name)] = formula
    return formulas


_FORMULAS = _flop_formulas()


def _walk(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _walk(item, found)


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes a kernel moves for ``tensor``: its elements, but a broadcast view (a zero
    stride) only its storage, which it reads once."""
    size = tensor.numel() * tensor.element_size()
    if 0 in tensor.stride():
        try:
            return min(size, tensor.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            return size
    return size


class OpArrays(NamedTuple):
    """Operations in order, one entry per operation in each array (compact: a 7B model's
    step is about 58,000 operations)."""

    #: :class:`Kind` of each operation
    kinds: array.array[int]
    flops: array.array[float]
    #: bytes read and written
    nbytes: array.array[float]
    #: :class:`DType` of each operation
    dtypes: array.array[int]


def _arrays() -> OpArrays:
    return OpArrays(array.array("b"), array.array("d"), array.array("d"), array.array("b"))


@dataclass
class OpTrace:
    """The operations of one step: the forward and backward passes, and the optimizer.

    ``micro_batches``: the forward/backward passes recorded in ``forward_backward``.
    """

    forward_backward: OpArrays
    optimizer: OpArrays
    micro_batches: int = 1
    #: products whose FLOPs could not be counted (timed by their bytes: the step is faster)
    uncounted: int = 0

    @property
    def operations(self) -> int:
        return len(self.forward_backward.kinds) + len(self.optimizer.kinds)

    @property
    def flops(self) -> float:
        return sum(self.forward_backward.flops) + sum(self.optimizer.flops)


class OpCounter:
    """Records the cost of each ATen operation of one step (the dispatch mode calls
    :meth:`record` after each operation), and of each CUDA kernel an emulation of
    :mod:`memfit.cuda` stands for (:meth:`kernel`, registered with
    :func:`memfit.cuda.kernels.observing`).

    Why only one step: the first step allocates the optimizer's state; the second is the
    steady state a long run repeats. Why both: an emulated kernel (fused attention, fused
    dropout, a cuDNN RNN) computes its values with CPU operations CUDA does not run, which
    the dispatch mode does not pass on (they run inside ``memfit.cuda.counting.not_counted``);
    the emulation reports the CUDA kernel instead.
    """

    def __init__(self, step: int, micro_batches: int = 1) -> None:
        self.step = step
        self.micro_batches = micro_batches
        self._fb = _arrays()
        self._opt = _arrays()
        self._kinds: dict[Any, tuple[Kind, Any]] = {}
        #: products whose FLOPs PyTorch's formulas could not count (timed by their bytes)
        self.uncounted = 0

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Count ``func(*args, **kwargs) -> out`` if it belongs to the recorded step."""
        labels = current_labels()
        if labels.step != self.step:
            return
        kind, formula = self._kind(func)
        if kind == Kind.IGNORED:
            return
        flops = nbytes = 0.0
        dtype = DType.OTHER
        if kind not in (Kind.NO_KERNEL, Kind.SYNC):
            inputs: list[torch.Tensor] = []
            _walk(args, inputs)
            _walk(list(kwargs.values()), inputs)
            outputs: list[torch.Tensor] = []
            _walk(out, outputs)
            if not outputs:
                return  # a query of metadata (sizes, devices), not an operation of the GPU
            written = sum(_nbytes(t) for t in outputs)
            name = func._overloadpacket.__name__
            if name in _GATHER:
                # the gathered rows, and the indices
                read = written + sum(_nbytes(t) for t in inputs[1:])
            else:
                read = sum(_nbytes(t) for t in inputs)
            for tensor in inputs:
                if tensor.is_floating_point():
                    dtype = _DTYPES.get(tensor.dtype, DType.OTHER)
                    break
            nbytes = float(read + written + _extra_passes(name, kind, dtype, inputs, outputs))
            if formula is not None:
                try:
                    flops = float(formula(*args, **kwargs, out_val=out))
                except (TypeError, ValueError, AssertionError, IndexError, RuntimeError):
                    # a signature PyTorch's formula does not know: timed by its bytes, and said
                    self.uncounted += 1
        self.add(kind, flops, nbytes, dtype, phase=labels.phase)

    def kernel(self, kernel: Kernel) -> None:
        """Count a CUDA kernel an emulation reports, if it belongs to the recorded step."""
        labels = current_labels()
        if labels.step != self.step:
            return
        dtype = _DTYPES.get(kernel.dtype, DType.OTHER)
        self.add(_ENGINES[kernel.engine], float(kernel.flops), float(kernel.nbytes), dtype, phase=labels.phase)

    def add(self, kind: Kind, flops: float, nbytes: float, dtype: DType, *, phase: str) -> None:
        """Append one operation (``phase`` "optimizer" or anything else for forward/backward)."""
        ops = self._opt if phase == "optimizer" else self._fb
        ops.kinds.append(kind)
        ops.flops.append(flops)
        ops.nbytes.append(nbytes)
        ops.dtypes.append(dtype)

    def trace(self) -> OpTrace:
        return OpTrace(self._fb, self._opt, self.micro_batches, self.uncounted)

    def _kind(self, func: Any) -> tuple[Kind, Any]:
        known = self._kinds.get(func)
        if known is None:
            packet = getattr(func, "_overloadpacket", None)
            name = getattr(packet, "__name__", str(func))
            formula = _FORMULAS.get(packet)
            if getattr(packet, "_qualified_op_name", "").startswith("prim::"):
                known = (Kind.IGNORED, None)  # tensor.device and such: attribute reads, no ATen call
            elif name in _SYNC:
                known = (Kind.SYNC, None)
            elif getattr(func, "is_view", False) or name in _NO_KERNEL:
                known = (Kind.NO_KERNEL, None)
            elif formula is not None:
                known = (Kind.CONV if name in _CONV else Kind.MATMUL, formula)
            else:
                known = (Kind.KERNEL, None)
            self._kinds[func] = known
        return known


def tf32_settings() -> tuple[bool, bool]:
    """(matmuls, convolutions) may use tf32, as this process's PyTorch settings say."""
    return bool(torch.backends.cuda.matmul.allow_tf32), bool(torch.backends.cudnn.allow_tf32)


@dataclass
class StepTime:
    """A predicted step on one GPU. Seconds are floats."""

    gpu: str
    seconds_per_step: float
    samples_per_second: float
    #: where the time goes: the GPU's kernels (compute- and memory-bound) and the host
    compute_seconds: float
    memory_seconds: float
    host_seconds: float
    kernels: int
    #: fp32 matmuls and convolutions on tf32 tensor cores
    tf32_matmul: bool
    tf32_conv: bool
    #: products whose FLOPs PyTorch's formulas could not count (0: the prediction is whole)
    uncounted_operations: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _peaks(gpu: GPU, tf32_matmul: bool, tf32_conv: bool) -> dict[tuple[int, int], float]:
    """Peak FLOP/s by (kind, dtype) for the products (tensor cores where they apply)."""
    fp32 = gpu.fp32
    half = gpu.fp16_tensor or fp32
    bfloat = gpu.bf16_tensor or fp32
    tf32 = gpu.tf32 or fp32
    return {
        (Kind.MATMUL, DType.SINGLE): tf32 if tf32_matmul else fp32,
        (Kind.CONV, DType.SINGLE): tf32 if tf32_conv else fp32,
        (Kind.MATMUL, DType.HALF): half,
        (Kind.CONV, DType.HALF): half,
        (Kind.MATMUL, DType.BFLOAT): bfloat,
        (Kind.CONV, DType.BFLOAT): bfloat,
        (Kind.MATMUL, DType.OTHER): fp32,
        (Kind.CONV, DType.OTHER): fp32,
    }


class Replay(NamedTuple):
    """The time of a run of operations (:func:`_replay`)."""

    seconds: float
    #: GPU time of the kernels bound by their FLOPs, and by their bytes
    compute: float
    memory: float
    host: float
    kernels: int


def _replay(ops: OpArrays, peaks: dict[tuple[int, int], float], bandwidth: float) -> Replay:
    """The operations' time, the host running ahead of the GPU until it must wait for a value."""
    host = device = compute = memory = 0.0
    kernels = 0
    for kind, flops, nbytes, dtype in zip(*ops):
        host += HOST_SECONDS_PER_OP
        if kind == Kind.NO_KERNEL:
            continue
        if kind == Kind.SYNC:
            host = max(host, device)
            continue
        moving = nbytes / bandwidth
        if kind == Kind.KERNEL:
            busy = moving
            memory += moving
        else:
            computing = flops / (peaks[(kind, dtype)] * COMPUTE_EFFICIENCY)
            busy = max(computing, moving)
            if computing >= moving:
                compute += busy
            else:
                memory += busy
        device = max(host, device) + busy + KERNEL_GAP_SECONDS
        kernels += 1
    return Replay(max(host, device), compute, memory, len(ops.kinds) * HOST_SECONDS_PER_OP, kernels)


def predict(
    trace: OpTrace,
    gpu: GPU,
    samples_per_step: int,
    *,
    accumulation: int | None = None,
    tf32_matmul: bool | None = None,
    tf32_conv: bool | None = None,
) -> StepTime:
    """The predicted step of ``trace`` on ``gpu`` (see the module for the model).

    Args:
        trace: the operations of one recorded step (:class:`OpCounter`).
        gpu: the card, with its published peaks and bandwidth.
        samples_per_step: samples one optimizer step sees (micro-batch x accumulation).
        accumulation: micro-batches per optimizer step (default: as recorded); the
            recorded forward/backward passes are scaled to it.
        tf32_matmul: matmuls in fp32 use tf32 (default: ``torch.backends.cuda.matmul.
            allow_tf32`` in this process).
        tf32_conv: convolutions in fp32 use tf32 (default: ``torch.backends.cudnn.
            allow_tf32``).
    """
    default_matmul, default_conv = tf32_settings()
    tf32_matmul = default_matmul if tf32_matmul is None else tf32_matmul
    tf32_conv = default_conv if tf32_conv is None else tf32_conv
    peaks = _peaks(gpu, tf32_matmul, tf32_conv)
    bandwidth = gpu.bandwidth * MEMORY_EFFICIENCY
    scale = (accumulation or trace.micro_batches) / trace.micro_batches
    fb = _replay(trace.forward_backward, peaks, bandwidth)
    opt = _replay(trace.optimizer, peaks, bandwidth)
    seconds = scale * fb.seconds + opt.seconds
    return StepTime(
        gpu=gpu.name,
        seconds_per_step=seconds,
        samples_per_second=samples_per_step / seconds if seconds > 0 else 0.0,
        compute_seconds=scale * fb.compute + opt.compute,
        memory_seconds=scale * fb.memory + opt.memory,
        host_seconds=scale * fb.host + opt.host,
        kernels=round(scale * fb.kernels) + opt.kernels,
        tf32_matmul=tf32_matmul and gpu.tf32 is not None,
        tf32_conv=tf32_conv and gpu.tf32 is not None,
        uncounted_operations=trace.uncounted,
    )
