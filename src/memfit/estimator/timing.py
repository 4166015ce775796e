"""Predict a training step's time on a named GPU from the operations of the fake steps.

Why: plan and fit on a simulated GPU (and ``memfit estimate --gpu``) must rank settings by
the speed of the GPU the user will train on, not by the CPU's. The fake steps of the
estimator (:mod:`memfit.estimator.fake`) already run every ATen operation of a step on
fake tensors; :class:`OpCounter` records, for each operation of one steady-state step, its
floating-point operations (PyTorch's own formulas, ``torch.utils.flop_counter``) and the
bytes it reads and writes, and its kernel class and shape
(:mod:`memfit.estimator.kernel_classes`). :func:`predict` then times each operation on the
GPU of the table (:mod:`memfit.memory.gpus`) by its class and replays the step as the host
and the GPU run it:

- **device time** of a kernel: by its class (:mod:`memfit.estimator.kernel_rates`, where
  each efficiency and its source are stated): matrix products and attention at the 16-bit
  efficiency of their peak with tile and wave quantization for the card's SM count; tf32
  (fp32 where PyTorch allows it: ``torch.backends.cuda.matmul.allow_tf32``, set by
  ``torch.set_float32_matmul_precision("high")``, for matmuls; ``torch.backends.cudnn.
  allow_tf32`` for convolutions) at its own; convolutions by kind (dense, grouped,
  depthwise), with cuDNN's NCHW transposes on tensor cores; every other kernel by the bytes
  it moves at the achievable streaming bandwidth, or at what its bytes in flight allow
  (:func:`memfit.estimator.kernel_rates.streaming_bandwidth`: 16-bit kernels of older
  PyTorch on cards with many SMs); plus :data:`KERNEL_GAP_SECONDS`.
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

Every constant is stated once, with its source; the calibrated rates of
:mod:`memfit.estimator.kernel_rates` were fitted on the calibration rows of
``bench/speed_rows.py`` only, and checked on the others.

>>> from memfit.memory.gpus import lookup
>>> counter = OpCounter(step=0)
>>> counter.add(Kind.MATMUL, 2 * 4096**3, 3 * 4096 * 4096 * 2, DType.HALF, phase="forward")
>>> time = predict(counter.trace(), lookup("A100 80GB SXM"), samples_per_step=1)
>>> round(time.seconds_per_step * 1e3, 3)  # 137 GFLOP at 0.826 x 312 TFLOP/s, plus launch
0.544
"""

from __future__ import annotations

import array
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

import torch

from memfit.cuda.kernels import Kernel
from memfit.estimator.flops import conv_backward_flops
from memfit.estimator.kernel_classes import Classified, classify
from memfit.estimator.kernel_rates import (
    GEMM_EFFICIENCY,
    RATES,
    STREAM_EFFICIENCY,
    KernelClass,
    Mode,
    Rates,
    elements_per_thread,
    gemm_utilisation,
    kernel_seconds,
    sm_count,
    streaming_bandwidth,
)
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

#: Fraction of the published dense peak a large 16-bit matrix product reaches (the source
#: is stated at :data:`memfit.estimator.kernel_rates.GEMM_EFFICIENCY`)
COMPUTE_EFFICIENCY = GEMM_EFFICIENCY
#: Fraction of the published memory bandwidth a streaming kernel reaches (the source is
#: stated at :data:`memfit.estimator.kernel_rates.STREAM_EFFICIENCY`)
MEMORY_EFFICIENCY = STREAM_EFFICIENCY
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
_NO_SHAPE = Classified(KernelClass.NONE)
#: an operation added without its shape (tests, reported kernels): by its kind
_DEFAULT_SHAPES = {
    Kind.KERNEL: Classified(KernelClass.ELEMENTWISE),
    Kind.MATMUL: Classified(KernelClass.GEMM),
    Kind.CONV: Classified(KernelClass.CONV_DENSE),
    Kind.NO_KERNEL: _NO_SHAPE,
    Kind.SYNC: _NO_SHAPE,
    Kind.IGNORED: _NO_SHAPE,
}


def _extra_passes(name: str, inputs: list[torch.Tensor]) -> int:
    """Bytes the GPU's kernels move beyond one read of each input and one write of each
    output, where the CUDA implementation is known to make more passes.

    Batch norm in training (PyTorch's CUDA kernels, aten/src/ATen/native/cuda/
    Normalization.cuh): forward reads its input twice (statistics, then normalize);
    backward reads the gradient and the input twice (the reductions, then the element-wise
    pass). (cuDNN's NCHW transposes around a convolution are timed apart:
    :mod:`memfit.estimator.kernel_classes`.)
    """
    if name in ("native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm"):
        return _nbytes(inputs[0]) if inputs else 0
    if name in ("native_batch_norm_backward", "cudnn_batch_norm_backward", "batch_norm_backward"):
        return sum(_nbytes(t) for t in inputs[:2])
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
    #: :class:`~memfit.estimator.kernel_rates.KernelClass` of each operation
    classes: array.array[int]
    #: a matrix product's output rows, columns, reduced dimension and batch (0: unknown)
    m: array.array[float]
    n: array.array[float]
    k: array.array[float]
    batch: array.array[float]
    #: a convolution's NCHW activation bytes (cuDNN transposes them on tensor cores)
    nchw: array.array[float]


def _arrays() -> OpArrays:
    return OpArrays(
        array.array("b"),
        array.array("d"),
        array.array("d"),
        array.array("b"),
        array.array("b"),
        *(array.array("d") for _ in range(5)),
    )


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
        shape = _NO_SHAPE
        if kind not in (Kind.NO_KERNEL, Kind.SYNC):
            inputs: list[torch.Tensor] = []
            _walk(args, inputs)
            _walk(list(kwargs.values()), inputs)
            outputs: list[torch.Tensor] = []
            _walk(out, outputs)
            name = func._overloadpacket.__name__
            if not outputs and name.startswith(("_foreach_", "_fused_")) and args:
                # an in-place foreach or fused kernel returns nothing: it writes its first list
                _walk(args[0], outputs)
            if not outputs:
                return  # a query of metadata (sizes, devices), not an operation of the GPU
            written = sum(_nbytes(t) for t in outputs)
            if name in _GATHER:
                # the gathered rows, and the indices
                read = written + sum(_nbytes(t) for t in inputs[1:])
            else:
                read = sum(_nbytes(t) for t in inputs)
            for tensor in inputs:
                if tensor.is_floating_point():
                    dtype = _DTYPES.get(tensor.dtype, DType.OTHER)
                    break
            nbytes = float(read + written + _extra_passes(name, inputs))
            shape = classify(name, kind == Kind.CONV, args, inputs, outputs)
            if formula is not None:
                try:
                    flops = float(formula(*args, **kwargs, out_val=out))
                except (TypeError, ValueError, AssertionError, IndexError, RuntimeError):
                    # a signature PyTorch's formula does not know: timed by its bytes, and said
                    self.uncounted += 1
        self.add(kind, flops, nbytes, dtype, phase=labels.phase, shape=shape)

    def kernel(self, kernel: Kernel) -> None:
        """Count a CUDA kernel an emulation reports, if it belongs to the recorded step."""
        labels = current_labels()
        if labels.step != self.step:
            return
        dtype = _DTYPES.get(kernel.dtype, DType.OTHER)
        kind = _ENGINES[kernel.engine]
        if kind == Kind.MATMUL:
            cls = KernelClass.ATTENTION if "scaled_dot_product" in kernel.name else KernelClass.GEMM
        else:
            cls = KernelClass.CONV_DENSE if kind == Kind.CONV else KernelClass.ELEMENTWISE
        shape = Classified(cls)
        self.add(kind, float(kernel.flops), float(kernel.nbytes), dtype, phase=labels.phase, shape=shape)

    def add(
        self, kind: Kind, flops: float, nbytes: float, dtype: DType, *, phase: str, shape: Classified | None = None
    ) -> None:
        """Append one operation (``phase`` "optimizer" or anything else for forward/backward).

        Args:
            kind: how the replay treats it (a kernel, a product, no kernel, a sync).
            flops: its floating-point operations.
            nbytes: the bytes it reads and writes.
            dtype: its inputs' dtype.
            phase: "optimizer" for the optimizer's step.
            shape: its kernel class and shape (default: by ``kind``: a dense product or an
                element-wise kernel, shape unknown).
        """
        if shape is None:
            shape = _DEFAULT_SHAPES[kind]
        cls = shape.cls
        if phase == "optimizer" and cls == KernelClass.ELEMENTWISE:
            cls = KernelClass.OPTIMIZER  # the optimizer's per-parameter loops: its kernels
        ops = self._opt if phase == "optimizer" else self._fb
        ops.kinds.append(kind)
        ops.flops.append(flops)
        ops.nbytes.append(nbytes)
        ops.dtypes.append(dtype)
        ops.classes.append(cls)
        ops.m.append(shape.m)
        ops.n.append(shape.n)
        ops.k.append(shape.k)
        ops.batch.append(shape.batch)
        ops.nchw.append(shape.nchw)

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
    #: GPU seconds per step by kernel class (``gemm``, ``conv_depthwise``, ``layout``, ...),
    #: largest first
    by_class: dict[str, float] = field(default_factory=dict)
    #: what bounds the step: the class of kernels with the most GPU time, or ``host`` when
    #: the host's launches take longer than all the GPU's kernels
    bound_by: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Card(NamedTuple):
    """A card as the replay needs it: (mode, peak FLOP/s) by (kind, dtype), bandwidth, SMs,
    rates, and the bytes/s a streaming kernel of each :class:`DType` reaches."""

    modes: dict[tuple[int, int], tuple[Mode, float]]
    bandwidth: float
    sms: int | None
    rates: Rates
    streaming: dict[int, float]
    #: the fp32 peak of the CUDA cores (a tf32 convolution's alternative)
    fp32: float


#: element bytes of each DType, as a streaming kernel loads them (OTHER: fp32's)
_ELEMENT_BYTES = {DType.SINGLE: 4, DType.HALF: 2, DType.BFLOAT: 2, DType.OTHER: 4}


def _card(gpu: GPU, tf32_matmul: bool, tf32_conv: bool, rates: Rates, per_thread: int) -> _Card:
    rates = rates.for_card(gpu.name)
    streaming = {
        int(dtype): streaming_bandwidth(gpu, size, per_thread, rates) for dtype, size in _ELEMENT_BYTES.items()
    }
    return _Card(_modes(gpu, tf32_matmul, tf32_conv), gpu.bandwidth, sm_count(gpu), rates, streaming, gpu.fp32)


def _modes(gpu: GPU, tf32_matmul: bool, tf32_conv: bool) -> dict[tuple[int, int], tuple[Mode, float]]:
    """The arithmetic each product runs in, and its peak: tensor cores where they apply."""
    fp32 = (Mode.FP32, gpu.fp32)
    half = (Mode.HALF, gpu.fp16_tensor) if gpu.fp16_tensor else fp32
    bfloat = (Mode.HALF, gpu.bf16_tensor) if gpu.bf16_tensor else fp32
    tf32 = (Mode.TF32, gpu.tf32) if gpu.tf32 else fp32
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
    #: GPU time by :class:`~memfit.estimator.kernel_rates.KernelClass`
    by_class: list[float]


def _product_seconds(ops: tuple[Any, ...], card: _Card) -> tuple[float, bool, float]:
    """(busy seconds, bound by FLOPs, layout seconds) of one product (a matmul, a convolution)."""
    kind, flops, nbytes, dtype, cls, m, n, k, batch, nchw = ops
    mode, peak = card.modes[(kind, dtype)]
    utilisation = gemm_utilisation(m, n, k, batch, card.sms) if m > 0 else 1.0
    busy, bound = kernel_seconds(
        KernelClass(cls),
        mode,
        flops,
        nbytes,
        peak=peak,
        bandwidth=card.bandwidth,
        rates=card.rates,
        utilisation=utilisation,
    )
    # cuDNN's tensor-core kernels transpose NCHW activations in and out (one read and write
    # each); the guide states it for 16-bit data and it is applied to tf32 too (an assumption:
    # without it the calibrated tf32 rate fits worse, see docs/benchmarks.md). A depthwise
    # convolution runs on no tensor core (a few FLOPs per byte: a memory-bound CUDA-core
    # kernel), so none: in NCHW PyTorch runs its own NCHW kernel (aten/src/ATen/native/cuda/
    # DepthwiseConv2d.cu) unless ``ConvParams::use_cudnn_depthwise`` (aten/src/ATen/native/
    # Convolution.cpp) picks cuDNN's depthwise kernels, which channels_last always does.
    transposed = nchw > 0 and mode != Mode.FP32 and cls != KernelClass.CONV_DEPTHWISE
    if not transposed:
        return busy, bound, 0.0
    # the transposes are streaming kernels too: slowed as the card's streaming kernels of
    # their dtype are where bytes in flight limit them (an assumption: cuDNN's own kernels)
    in_flight = card.streaming[dtype] / (card.bandwidth * card.rates.stream)
    layout = 2 * nchw / (card.bandwidth * card.rates.layout * in_flight)
    if mode == Mode.TF32 and kind == Kind.CONV:
        # fp32 data has two kinds of cuDNN kernel: tf32 tensor-core ones, on NHWC (the
        # transposes), and CUDA-core fp32 ones, which read NCHW as it is; cuDNN's algorithm
        # search (torch.backends.cudnn.benchmark, its heuristics otherwise) takes the faster
        # for each convolution. On a GeForce card, whose tf32 peak is its fp32 one, that is
        # mostly the fp32 kernel.
        alone, alone_bound = kernel_seconds(
            KernelClass(cls), Mode.FP32, flops, nbytes, peak=card.fp32, bandwidth=card.bandwidth, rates=card.rates
        )
        if alone < busy + layout:
            return alone, alone_bound, 0.0
    return busy, bound, layout


def _replay(ops: OpArrays, card: _Card) -> Replay:
    """The operations' time, the host running ahead of the GPU until it must wait for a value."""
    host = device = compute = memory = 0.0
    kernels = 0
    by_class = [0.0] * len(KernelClass)
    for op in zip(*ops):
        kind, _, nbytes, dtype, cls = op[:5]
        host += HOST_SECONDS_PER_OP
        if kind == Kind.NO_KERNEL:
            continue
        if kind == Kind.SYNC:
            host = max(host, device)
            continue
        layout = 0.0
        if kind == Kind.KERNEL:
            busy, bound = kernel_seconds(
                KernelClass(cls),
                Mode.FP32,
                0.0,
                nbytes,
                peak=0.0,
                bandwidth=card.bandwidth,
                rates=card.rates,
                streaming=card.streaming[dtype],
            )
        else:
            busy, bound, layout = _product_seconds(op, card)
        if bound:
            compute += busy
        else:
            memory += busy
        memory += layout
        by_class[cls] += busy
        by_class[KernelClass.LAYOUT] += layout
        device = max(host, device) + busy + layout + KERNEL_GAP_SECONDS
        kernels += 1
    return Replay(max(host, device), compute, memory, len(ops.kinds) * HOST_SECONDS_PER_OP, kernels, by_class)


def _by_class(fb: Replay, opt: Replay, scale: float) -> dict[str, float]:
    times = {
        KernelClass(i).name.lower(): scale * a + b for i, (a, b) in enumerate(zip(fb.by_class, opt.by_class)) if a or b
    }
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def predict(
    trace: OpTrace,
    gpu: GPU,
    samples_per_step: int,
    *,
    accumulation: int | None = None,
    tf32_matmul: bool | None = None,
    tf32_conv: bool | None = None,
    rates: Rates = RATES,
    per_thread: int | None = None,
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
        rates: the efficiency of each kernel class (default: the sourced and calibrated
            :data:`memfit.estimator.kernel_rates.RATES`).
        per_thread: elements each thread of PyTorch's streaming kernels loads (default:
            the installed torch's, :func:`~memfit.estimator.kernel_rates.elements_per_thread`;
            a published figure of older PyTorch is reproduced with its own).
    """
    default_matmul, default_conv = tf32_settings()
    tf32_matmul = default_matmul if tf32_matmul is None else tf32_matmul
    tf32_conv = default_conv if tf32_conv is None else tf32_conv
    per_thread = elements_per_thread() if per_thread is None else per_thread
    card = _card(gpu, tf32_matmul, tf32_conv, rates, per_thread)
    scale = (accumulation or trace.micro_batches) / trace.micro_batches
    fb = _replay(trace.forward_backward, card)
    opt = _replay(trace.optimizer, card)
    seconds = scale * fb.seconds + opt.seconds
    by_class = _by_class(fb, opt, scale)
    host = scale * fb.host + opt.host
    busy = sum(by_class.values())
    return StepTime(
        gpu=gpu.name,
        seconds_per_step=seconds,
        samples_per_second=samples_per_step / seconds if seconds > 0 else 0.0,
        compute_seconds=scale * fb.compute + opt.compute,
        memory_seconds=scale * fb.memory + opt.memory,
        host_seconds=host,
        kernels=round(scale * fb.kernels) + opt.kernels,
        tf32_matmul=tf32_matmul and gpu.tf32 is not None,
        tf32_conv=tf32_conv and gpu.tf32 is not None,
        uncounted_operations=trace.uncounted,
        by_class=by_class,
        bound_by="host" if host > busy or not by_class else next(iter(by_class)),
    )
