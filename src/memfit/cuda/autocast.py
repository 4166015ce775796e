"""CUDA autocast's policy applied to CPU tensors: Python kernels on the ``AutocastCPU`` key.

Why this way: ``torch.autocast("cuda")`` is disabled on a CPU-only build, and CPU autocast
has its own lists (it leaves softmax, layer_norm and the losses' inputs in half precision
where CUDA runs them in fp32). The kernels registered here, for the ops of either list,
make CPU autocast behave as CUDA's while a simulated-GPU or estimator run is entered
(:mod:`memfit.cuda.semantics` registers them and takes them away again). They sit where
autocast sits, above autograd, on the dispatcher, so every call is seen: from Python,
from a composite op's decomposition (``cross_entropy`` → ``log_softmax`` + ``nll_loss``),
from C++. Each policy is CUDA's (aten/src/ATen/autocast_mode.h, ``WrapFunction_``):

- ``lower_precision``: eligible tensors (floating point, not fp64) cast to the autocast
  dtype; where CPU autocast's list has the op too, its own kernel is kept (same casts,
  same weight-cast cache);
- ``fp32``: eligible tensors cast to fp32;
- ``fp32_set_opt_dtype``: when the first argument is eligible, ``dtype=`` defaults to fp32;
- ``fp32_append_dtype``: ``norm`` redispatched with ``dtype=float32``;
- ``promote``: eligible tensors cast to the widest floating type among them;
- ``banned``: ``binary_cross_entropy`` raises CUDA's error;
- an op only CPU autocast lists falls through, as on CUDA: it runs uncast, and the ops it
  calls meet autocast themselves.

The weight-cast cache of the lower-precision ops only CUDA lists (addmv, einsum, the RNN
cells, ...) holds its casts weakly, keyed on the weight and its version; CUDA's holds them
until the autocast region ends, which keeps the same memory whenever the op's backward
keeps the cast (all of these ops' do).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from memfit.cuda.autocast_lists import CPU_LOWER_PRECISION, AutocastLists

__all__ = ["register_kernels", "BANNED_MESSAGE", "policy_of"]

#: CUDA's message for the banned op (autocast_mode.cpp: ``binary_cross_entropy_banned``)
BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)

_BELOW_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

_HALF_TYPES = (torch.float16, torch.bfloat16)


def _eligible(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, fn) for item in value)
    return value


class _CastCache:
    """Lower-precision casts of leaf weights, reused while the weight and its version live."""

    def __init__(self) -> None:
        self._casts: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.dtype, weakref.ref[torch.Tensor]]] = {}

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        cacheable = (
            tensor.dtype == torch.float32
            and tensor.requires_grad
            and tensor.is_leaf
            and not tensor._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return tensor.to(dtype)
        key = id(tensor)
        entry = self._casts.get(key)
        if entry is not None:
            source, version, cached_dtype, cast = entry
            cached = cast()
            if source() is tensor and version == tensor._version and cached_dtype == dtype and cached is not None:
                return cached
        result = tensor.to(dtype)
        self._casts[key] = (weakref.ref(tensor), tensor._version, dtype, weakref.ref(result))
        return result


def _cast_all(
    args: tuple[Any, ...], kwargs: dict[str, Any], to: torch.dtype, cache: _CastCache | None
) -> tuple[Any, dict[str, Any]]:
    def cast(tensor: torch.Tensor) -> torch.Tensor:
        if not _eligible(tensor) or tensor.dtype == to:
            return tensor
        return cache.cast(tensor, to) if cache is not None else tensor.to(to)

    return _map_tensors(args, cast), {k: _map_tensors(v, cast) for k, v in kwargs.items()}


def _below(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with torch._C._ExcludeDispatchKeyGuard(_BELOW_AUTOCAST):
        return op(*args, **kwargs)


def _lower(op: Any, cache: _CastCache) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = torch.get_autocast_dtype("cpu")
        args, kwargs = _cast_all(args, kwargs, dtype, cache)
        return _below(op, args, kwargs)

    return kernel


def _fp32(op: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _cast_all(args, kwargs, torch.float32, None)
        return _below(op, args, kwargs)

    return kernel


def _dtype_slot(op: Any) -> tuple[int | None, bool]:
    """Where the op takes ``dtype``: (positional index, keyword-only)."""
    positional = 0
    for argument in op._schema.arguments:
        if argument.name == "dtype":
            return (None, True) if argument.kwarg_only else (positional, False)
        if not argument.kwarg_only:
            positional += 1
    raise LookupError(f"{op} takes no dtype")


def _fp32_set_opt_dtype(op: Any) -> Callable[..., Any]:
    index, keyword = _dtype_slot(op)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if args and _eligible(args[0]):
            if keyword:
                if kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            else:
                assert index is not None
                if len(args) <= index:
                    args = (*args, *[None] * (index - len(args)), torch.float32)
                elif args[index] is None:
                    args = (*args[:index], torch.float32, *args[index + 1 :])
        return _below(op, args, kwargs)

    return kernel


def _fp32_append_dtype(name: str) -> Callable[..., Any]:
    # AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: norm.Scalar -> norm.ScalarOpt_dtype,
    # norm.ScalarOpt_dim -> norm.ScalarOpt_dim_dtype
    plain = torch.ops.aten.norm.Scalar if name == "norm.Scalar" else torch.ops.aten.norm.ScalarOpt_dim
    with_dtype = (
        torch.ops.aten.norm.ScalarOpt_dtype if name == "norm.Scalar" else torch.ops.aten.norm.ScalarOpt_dim_dtype
    )

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if args and _eligible(args[0]):
            return _below(with_dtype, (*args,), {**kwargs, "dtype": torch.float32})
        return _below(plain, args, kwargs)

    return kernel


def _promote(op: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        lower = torch.get_autocast_dtype("cpu")
        widest = lower
        found: list[torch.Tensor] = []

        def collect(tensor: torch.Tensor) -> torch.Tensor:
            found.append(tensor)
            return tensor

        _map_tensors((args, tuple(kwargs.values())), collect)
        for tensor in found:
            if not _eligible(tensor):
                continue
            if widest == torch.float32 or tensor.dtype == torch.float32:
                widest = torch.float32
            elif tensor.dtype != lower:  # at::autocast::prioritize
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
        args, kwargs = _cast_all(args, kwargs, widest, None)
        return _below(op, args, kwargs)

    return kernel


def _banned(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError(BANNED_MESSAGE)


def _overload(name: str) -> Any:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def policy_of(name: str, lists: AutocastLists) -> str:
    """The policy CUDA applies to op ``name`` (``"none"`` when it is not listed)."""
    for policy in ("lower_precision", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned"):
        if name in getattr(lists, policy):
            return policy
    return "none"


def register_kernels(library: torch.library.Library, lists: AutocastLists) -> int:
    """Register CUDA's policy on ``AutocastCPU`` in ``library``; return how many ops got a kernel.

    Args:
        library: an ``IMPL`` library on ``aten`` whose destruction takes the kernels away.
        lists: CUDA's lists for the torch version in use.
    """
    cpu_ops = {n.removeprefix("aten::") for n in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")}
    cache = _CastCache()
    count = 0
    for name in sorted(lists.all_ops() | cpu_ops):
        policy = policy_of(name, lists)
        if policy == "lower_precision" and name in CPU_LOWER_PRECISION:
            continue  # CPU autocast's own kernel casts the same way
        try:
            op = _overload(name)
        except AttributeError:
            continue  # an op this build does not have (cudnn_convolution on some CPU builds)
        kernel: Callable[..., Any]
        if policy == "lower_precision":
            kernel = _lower(op, cache)
        elif policy == "fp32":
            kernel = _fp32(op)
        elif policy == "fp32_set_opt_dtype":
            kernel = _fp32_set_opt_dtype(op)
        elif policy == "fp32_append_dtype":
            kernel = _fp32_append_dtype(name)
        elif policy == "promote":
            kernel = _promote(op)
        elif policy == "banned":
            kernel = _banned
        else:
            # CUDA lists it not: fall through (autocast stays on for the ops it calls, as
            # cross_entropy's log_softmax and nll_loss on CUDA)
            kernel = torch.library.fallthrough_kernel
        library.impl(name, kernel, "AutocastCPU")
        count += 1
    return count
