"""Activation checkpointing: which modules recompute in backward, found by running the model.

A policy is a string (``Settings.checkpointing``):

- ``none``: nothing is recomputed;
- ``blocks``: every repeated block that runs in forward;
- ``every:K``: every K-th of those blocks (the first, the (K+1)-th, ...);
- ``first:N``: the first N blocks in the order forward runs them (the members of a
  plan's ``budget`` axis: recompute as few blocks as the device needs);
- ``modules:NAME[+NAME...]``: the modules of these classes (``Block``, or a qualified
  name) or at these paths (``layer3.1``) that run in forward, the outermost ones;
- ``selective``: every block, with op-level selective checkpointing
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of
  matrix multiplications, convolutions and fused attention are kept; pointwise operations,
  normalizations and the math attention's score matrices are recomputed.

Why by running: a model's blocks sit in containers that say nothing about what forward
does (a ResNet's four stages, a UNet's down/up ``ModuleList`` whose own ``forward`` is
never called). The model's first forward with gradients enabled is run once more without
gradients, with hooks recording which module called which; the *blocks* are the outermost
modules that compute something of their own (they call submodules, or are user code with
parameters) and whose kind runs at least twice. Containers (``ModuleList``,
``ModuleDict``, a ``Sequential`` of such blocks) are looked through. That look-ahead run
leaves the model as it was: buffers (BatchNorm's running statistics) and every random
generator are put back, and the storage tracker does not count it (it is not part of the
step memfit predicts).

Exact, not approximately: a checkpointed block recomputes its forward in backward with
the random state of the first run (``preserve_rng_state``), and a block whose forward
changed its own buffers (BatchNorm's running statistics, ``num_batches_tracked``) has
them put back after the recompute, so the buffers end as the unchanged run leaves them,
not updated twice. Python attributes a forward changes are not put back: a block that
keeps state outside its buffers must not be checkpointed. A transformers model's key/value
cache is turned off while memfit's own checkpointing is applied (``config.use_cache``, put
back by the undo): a recompute would append its keys and values to the cache a second
time; transformers' own gradient checkpointing turns it off in training for the same reason.

Refused before anything runs: a model whose transformers gradient checkpointing is already
on (two checkpointing mechanisms around the same layers: keep one); and by
:func:`check_model`, for a caller that can refuse before training starts (the transformers
Trainer), also ``modules:NAME`` naming no module of the model at all (:func:`enable`
itself refuses it at the first forward, naming the blocks that ran).

>>> parse("every:2").every
2
>>> recomputes_no_more("first:2", "blocks"), recomputes_no_more("blocks", "every:2")
(True, False)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from memfit.errors import MemfitError

if TYPE_CHECKING:
    from torch import nn

# torch is imported inside the functions that touch a model: a policy is plain data, and
# reading a memfit.lock should not cost torch's import.

__all__ = [
    "Policy",
    "parse",
    "check",
    "recomputes_no_more",
    "recompute_order",
    "Checkpointed",
    "enable",
    "check_model",
    "saves_nothing",
    "POLICY_HELP",
    "BUDGET",
]

#: a plan's axis, not one run's: the fewest blocks (``first:N``) that fit
BUDGET = "budget"
#: the grammar in one line, for errors and --help
POLICY_HELP = "none, blocks, every:K, first:N, modules:NAME[+NAME...], selective"

_KINDS = ("none", "blocks", "every", "first", "modules", "selective")


@dataclass(frozen=True)
class Policy:
    """A parsed checkpointing policy (see the module)."""

    kind: str
    #: every:K (1 for blocks)
    every: int = 1
    #: first:N (None: no limit)
    first: int | None = None
    #: modules:NAME+NAME
    names: tuple[str, ...] = ()

    @property
    def on_blocks(self) -> bool:
        """True for the policies that choose among the repeated blocks."""
        return self.kind in ("blocks", "every", "first", "selective")


def parse(text: str) -> Policy:
    """The policy a string names; a one-line :class:`MemfitError` for anything else.

    Args:
        text: ``none``, ``blocks``, ``every:K``, ``first:N``, ``modules:A+B`` or ``selective``.
    """
    if not isinstance(text, str):
        raise MemfitError(f"unknown checkpointing {text!r}: use one of {POLICY_HELP}")
    kind, _, arg = text.partition(":")
    if kind in ("none", "blocks", "selective") and not arg:
        return Policy(kind)
    if kind in ("every", "first") and arg:
        if not arg.isdigit() or int(arg) < 1:
            raise MemfitError(f"invalid checkpointing {text!r}: {kind}: takes a whole number of blocks, at least 1")
        n = int(arg)
        return Policy("every", every=n) if kind == "every" else Policy("first", first=n)
    if kind == "modules" and arg:
        names = tuple(name.strip() for name in arg.split("+"))
        if any(not name for name in names):
            raise MemfitError(f"invalid checkpointing {text!r}: modules: takes class names or paths joined by +")
        return Policy("modules", names=names)
    if kind == "budget":
        raise MemfitError(
            "checkpointing budget is a plan axis (memfit plan --checkpointing budget): for one run, "
            "give the blocks to recompute, first:N"
        )
    raise MemfitError(f"unknown checkpointing {text!r}: use one of {POLICY_HELP}")


def check(text: str) -> None:
    """Refuse a policy string in one line (:func:`parse` without the result)."""
    parse(text)


def recomputes_no_more(a: str, b: str) -> bool:
    """True when policy ``a`` recomputes no more than ``b`` by construction (the same
    model): a subset of its blocks, or the same blocks with fewer operations.

    Why a partial order: ``selective`` and ``every:2`` recompute different things, and
    which is cheaper depends on the model; the plan measures both instead of guessing.
    """
    pa, pb = parse(a), parse(b)
    if pa == pb or pa.kind == "none":
        return True
    if pb.kind in ("blocks", "selective") and pa.kind in ("every", "first"):
        return pb.kind == "blocks"
    if pa.kind == "selective":
        return pb.kind == "blocks"
    if pa.kind == "first" and pb.kind == "first":
        assert pa.first is not None and pb.first is not None
        return pa.first <= pb.first
    if pa.kind == "every" and pb.kind == "every":
        return pb.every < pa.every and pa.every % pb.every == 0
    return False


def recompute_order(text: str) -> tuple[int, int]:
    """A sort key, least recomputation first: none, first:N (by N), every:K (by fewer
    blocks), selective, modules, blocks."""
    p = parse(text)
    rank = {"none": 0, "first": 1, "every": 2, "selective": 3, "modules": 4, "blocks": 5}[p.kind]
    return rank, (p.first or 0) if p.kind == "first" else -p.every


@dataclass
class Checkpointed:
    """What :func:`enable` did to a model: the modules that recompute (known after the
    model's first forward with gradients), and the undo."""

    policy: str
    #: (dotted path, class name) of each checkpointed module, in the order forward runs them
    modules: list[tuple[str, str]] = field(default_factory=list)
    #: True once the modules are chosen
    found: bool = False
    #: checkpointed calls so far that keep something for backward (a parameter or an input
    #: requiring gradients): 0 after a training step means the policy recomputes nothing
    recomputing: int = 0
    #: True when transformers' own gradient checkpointing recomputes (its calls are not counted)
    transformers: bool = False
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def describe(self) -> str:
        """``8 x BasicBlock`` (counts by class, in order of first appearance)."""
        counts: dict[str, int] = {}
        for _, name in self.modules:
            counts[name] = counts.get(name, 0) + 1
        return ", ".join(f"{n} x {name}" for name, n in counts.items()) or "nothing"

    def undo(self) -> None:
        """Put every forward back (and stop waiting for the first forward)."""
        while self._undo:
            self._undo.pop()()


def enable(model: nn.Module, policy: str) -> Checkpointed:
    """Make the modules ``policy`` names recompute their activations in backward.

    The modules are chosen at the model's first forward with gradients enabled (see the
    module); a transformers model asked for ``blocks`` uses its own
    ``gradient_checkpointing_enable`` (it knows its layers' keyword arguments).

    Args:
        model: the model, on its device.
        policy: a policy string (:func:`parse`), not ``none``.
    """
    p = parse(policy)
    done = Checkpointed(policy)
    if p.kind == "none":
        done.found = True
        return done
    _refuse_double_checkpointing(model, policy)
    # before transformers' own enable, which turns the cache off for good: the undo puts it back
    done._undo.append(_without_kv_cache(model))
    if p.kind == "blocks" and _is_transformers(model):
        disable = _transformers_enable(model)
        # the layers that recompute (the model itself carries the flag too)
        done.modules = [
            (n, type(m).__name__)
            for n, m in model.named_modules()
            if getattr(m, "gradient_checkpointing", False) is True and not _is_transformers(m)
        ]
        done.found = done.transformers = True
        done._undo.append(disable)
        return done

    paths = {id(m): name for name, m in model.named_modules()}
    waiting: dict[int, Any] = {}

    def first_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        import torch

        if not torch.is_grad_enabled() or id(module) not in waiting:
            return  # a no-grad forward recomputes nothing: wait for a training one
        for m in module.modules():  # this call covers its whole subtree
            handle = waiting.pop(id(m), None)
            if handle is not None:
                handle.remove()
        from memfit.run.forward_calls import record_calls

        tree = record_calls(module, args, kwargs)
        try:
            chosen = _choose(tree, p)
        except MemfitError:
            # Refused where the whole model ran, or when no part called on its own had
            # any; one part may have none (a loss module after the network, under a
            # LightningModule's training_step).
            if module is model or (not waiting and not done.modules):
                raise
            chosen = []
        for _, block in chosen:
            done._undo.append(_wrap(block, p.kind == "selective", done))
        prefix = paths.get(id(module), "")
        done.modules += [(_join(prefix, path), class_name(block)) for path, block in chosen]
        done.found = True

    # Why a hook on every module: the model may never be called itself (a LightningModule
    # whose training_step calls self.model); the outermost module called first is looked at.
    for m in model.modules():
        waiting[id(m)] = m.register_forward_pre_hook(first_forward, with_kwargs=True)

    def stop_waiting() -> None:
        for handle in waiting.values():
            handle.remove()
        waiting.clear()

    done._undo.append(stop_waiting)
    return done


def check_model(model: nn.Module, policy: str) -> None:
    """Refuse, in one line, a policy that cannot apply to ``model`` whatever forward runs.

    ``modules:NAME`` where no module of the model has that class or path (relative to the
    model or to a part of it a forward may call on its own); and any policy on a model whose
    transformers gradient checkpointing is already on (``gradient_checkpointing_enable``):
    memfit's checkpointing and transformers' would both wrap the same layers.

    Args:
        model: the model the policy is for.
        policy: a policy string (:func:`parse`).
    """
    p = parse(policy)
    if p.kind == "none":
        return
    _refuse_double_checkpointing(model, policy)
    if p.kind != "modules":
        return
    paths = [name for name, _ in model.named_modules()]
    classes = set().union(*(_class_names(m) for m in model.modules()))
    missing = [
        name
        for name in p.names
        if name not in classes and not any(path == name or path.endswith(f".{name}") for path in paths)
    ]
    if missing:
        raise MemfitError(
            f"checkpointing {policy}: {type(model).__name__} has no module of class or path {missing[0]!r}: "
            "name a class or a path (model.named_modules()) of the model"
        )


def _refuse_double_checkpointing(model: nn.Module, policy: str) -> None:
    """Refuse a policy on a model whose transformers gradient checkpointing is already on
    (:func:`enable` checks it too: the modules are otherwise chosen at the first forward)."""
    on = [name or type(m).__name__ for name, m in model.named_modules() if _transformers_checkpointing(m)]
    if on:
        raise MemfitError(
            f"checkpointing {policy}: {on[0]} already uses transformers' gradient checkpointing "
            "(gradient_checkpointing_enable, or TrainingArguments(gradient_checkpointing=True)): keep one of the two "
            "(memfit's blocks is transformers' own for a transformers model)"
        )


def saves_nothing(done: Checkpointed) -> str | None:
    """Why what :func:`enable` chose saves no activation memory (None: it saves some, or is
    not chosen yet): it checkpoints nothing; after a training step, none of its calls kept
    anything for backward (a frozen part); or the module forward was called on as a whole
    (backward then recomputes all of it at once, holding every activation again at its peak).

    Args:
        done: what :func:`enable` returned, after the model's first forward with gradients.
    """
    if not done.found or parse(done.policy).kind == "none":
        return None
    if not done.modules:
        return f"checkpointing {done.policy} recomputes nothing in this model: it saves no memory"
    if done.recomputing == 0 and not done.transformers:
        return (
            f"checkpointing {done.policy} recomputes nothing: {done.describe()} ran, but neither their inputs nor "
            "their parameters require gradients (a frozen part keeps nothing for backward), so it saves no memory"
        )
    whole = [name for path, name in done.modules if path == ""]
    if whole:
        return (
            f"checkpointing {done.policy} recomputes the whole {whole[0]} in backward at once: every activation is "
            "held again at the peak, so it saves no memory (name its repeated blocks instead)"
        )
    return None


def _without_kv_cache(model: nn.Module) -> Callable[[], None]:
    """Turn off the key/value cache of every transformers model in ``model``; return the undo.

    Why: a checkpointed layer's recompute would append its keys and values to the cache
    forward filled, and attend over both (transformers' own checkpointing turns the cache
    off in training for the same reason). The loss does not use the cache.
    """
    changed: dict[int, Any] = {}
    for m in model.modules():
        config: Any = getattr(m, "config", None)
        if _is_transformers(m) and getattr(config, "use_cache", False) is True and id(config) not in changed:
            changed[id(config)] = config
            config.use_cache = False

    def undo() -> None:
        for kept in changed.values():
            kept.use_cache = True

    return undo


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def _transformers_enable(model: nn.Module) -> Callable[[], None]:
    """Turn on a transformers model's own checkpointing (non-reentrant); return what turns it off.

    transformers 5 names it ``activation_checkpointing_enable`` and warns on the older
    ``gradient_checkpointing_enable``; the older name serves the versions before it.
    """
    hf: Any = model
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return cast("Callable[[], None]", hf.activation_checkpointing_disable)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return cast("Callable[[], None]", hf.gradient_checkpointing_disable)


def _transformers_checkpointing(module: nn.Module) -> bool:
    """Whether transformers' own checkpointing is on for ``module`` (read by the name its version has)."""
    name = (
        "is_activation_checkpointing"
        if hasattr(type(module), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    return bool(getattr(module, name, False))


def _is_transformers(model: nn.Module) -> bool:
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and hasattr(
        model, "gradient_checkpointing_enable"
    )


def _choose(tree: Any, p: Policy) -> list[tuple[str, nn.Module]]:
    """The modules of ``tree`` (:class:`memfit.run.forward_calls.CallTree`) the policy names."""
    if p.kind == "modules":
        chosen = tree.outermost(lambda path, m: path in p.names or _class_names(m) & set(p.names))
        if not chosen:
            raise MemfitError(
                f"checkpointing modules:{'+'.join(p.names)}: no module of that class or path runs in forward "
                f"(blocks that run: {tree.describe_blocks() or 'none'})"
            )
        return chosen
    blocks = tree.blocks()
    if not blocks:
        raise MemfitError(
            f"checkpointing {_policy_text(p)}: found no repeated blocks that run in forward of "
            f"{type(tree.root).__name__} (modules of one kind called at least twice); "
            "name the modules with modules:NAME"
        )
    if p.kind == "every":
        return blocks[:: p.every]
    if p.kind == "first":
        return blocks[: p.first]
    return blocks


def _policy_text(p: Policy) -> str:
    return {"every": f"every:{p.every}", "first": f"first:{p.first}"}.get(p.kind, p.kind)


def _class_names(module: nn.Module) -> set[str]:
    """The names ``modules:NAME`` matches: the module's classes and their bases, as
    isinstance would (FSDP2's ``FSDPBlock`` is a ``Block``), short and qualified."""
    from torch import nn

    names: set[str] = set()
    for cls in type(module).__mro__:
        if cls in (nn.Module, object) or cls.__module__.startswith("torch.distributed"):
            continue
        names |= {cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"}
    return names


def class_name(module: nn.Module) -> str:
    """The module's class name as its code names it (FSDP2's ``FSDPBlock`` is ``Block``)."""
    cls = type(module)
    for base in cls.__mro__[1:]:
        if cls.__name__ == f"FSDP{base.__name__}":
            return base.__name__
    return cls.__name__


def _wrap(block: nn.Module, selective: bool, done: Checkpointed) -> Callable[[], None]:
    """Wrap ``block.forward`` in non-reentrant ``torch.utils.checkpoint``; return the undo.

    A call where neither an input nor a parameter of the block requires gradients runs as
    it is: autograd keeps nothing of it, so there is nothing to recompute (a frozen part).
    """
    import torch
    from torch.utils._pytree import tree_leaves
    from torch.utils.checkpoint import checkpoint

    original = block.forward
    trainable = [p for p in block.parameters() if p.requires_grad]

    @functools.wraps(original)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if not any(p.requires_grad for p in trainable) and not any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves((args, kwargs))
        ):
            return original(*args, **kwargs)
        done.recomputing += 1
        keeper = _BufferKeeper(block, selective)
        return checkpoint(original, *args, use_reentrant=False, context_fn=keeper.contexts, **kwargs)

    block.forward = checkpointed

    def undo() -> None:
        block.__dict__.pop("forward", None)

    return undo


class _BufferKeeper:
    """One checkpointed call of a block: the contexts of its forward and of its recompute.

    The forward's context notes which of the block's buffers the forward changed: those
    whose version counter moved (an in-place update in Python) and the running statistics
    of its batch and instance norms in training (the kernel updates them without moving
    the counter). The recompute's context puts those back afterwards, so they are updated
    once, as without checkpointing. Why contexts and not a wrapper of the function:
    selective checkpointing's recompute must see exactly the operations the forward ran;
    these copies sit outside its contexts.
    """

    def __init__(self, block: nn.Module, selective: bool) -> None:
        self.block = block
        self.selective = selective
        self.changed: list[Any] = []

    def contexts(self) -> tuple[Any, Any]:
        forward, recompute = self._forward(), self._recompute()
        if not self.selective:
            return forward, recompute
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        sac_forward, sac_recompute = create_selective_checkpoint_contexts(_save_matmuls)
        return _Both(forward, sac_forward), _Both(recompute, sac_recompute)

    @contextlib.contextmanager
    def _forward(self) -> Iterator[None]:
        from torch.nn.modules.batchnorm import _NormBase

        buffers = list(self.block.buffers())
        before = [b._version for b in buffers]
        running = {
            id(b)
            for m in self.block.modules()
            if isinstance(m, _NormBase) and m.training and m.track_running_stats
            for b in m.buffers(recurse=False)
        }
        yield
        self.changed = [b for b, v in zip(buffers, before, strict=True) if b._version != v or id(b) in running]

    @contextlib.contextmanager
    def _recompute(self) -> Iterator[None]:
        import torch

        with torch.no_grad():
            kept = [b.clone() for b in self.changed]
        try:
            yield
        finally:
            with torch.no_grad():
                for b, value in zip(self.changed, kept, strict=True):
                    b.copy_(value)


class _Both:
    """Two context managers, ``outer`` entered first and left last."""

    def __init__(self, outer: Any, inner: Any) -> None:
        self.stack = contextlib.ExitStack()
        self.outer, self.inner = outer, inner

    def __enter__(self) -> None:
        self.stack.enter_context(self.outer)
        self.stack.enter_context(self.inner)

    def __exit__(self, *exc: Any) -> Any:
        return self.stack.__exit__(*exc)


def _saved_ops() -> frozenset[Any]:
    """The operations whose outputs selective checkpointing keeps: matrix multiplications
    (a Linear's mm/addmm), convolutions and the fused attention kernels. What is left
    (pointwise, normalization, softmax, dropout, the math attention's bmm) is cheap to
    recompute per byte it would keep, which is Megatron's selective recompute."""
    import torch

    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


def _save_matmuls(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVED() else CheckpointPolicy.PREFER_RECOMPUTE


_SAVED = functools.cache(_saved_ops)


def describe_modules(modules: Sequence[tuple[str, str]]) -> str:
    """``8 x BasicBlock`` for a list of (path, class name)."""
    return Checkpointed("", list(modules)).describe()
