"""cuDNN's memory outside the tensors PyTorch's own kernels save: convolution workspaces and
the RNN reserve space.

**Convolution workspace.** cuDNN's convolution algorithms need scratch memory, which
PyTorch allocates through its caching allocator for the duration of the call (inside
``memory_reserved``, freed after it). Its size depends on the algorithm cuDNN picks, and
that choice is made at run time by cuDNN's heuristics (``torch.backends.cudnn.benchmark =
False``, the default) or by timing candidates (``benchmark=True``), which PyTorch limits
only by the memory free at the time (``aten/src/ATen/native/cudnn/Conv_v7.cpp``,
``Conv_v8.cpp``: candidates whose workspace cannot be allocated are skipped). The one
bound a user can set is ``CUDNN_CONV_WSCAP_DBG`` (MiB per allocation; PyTorch's "CUDA
environment variables" page). So memfit counts a convolution workspace only as that cap,
an upper bound, and otherwise reports none (``cudnn workspace: 0``): the error that leaves
is bounded by the largest workspace of one convolution, and bench/gpu_accuracy.py
measures it on a lent GPU.

**RNN reserve space.** For training, ``cudnnRNNForward`` fills a reserve buffer that
backward reads (the gates and states of every step and layer). PyTorch returns it from
``torch._cudnn_rnn`` as a ``uint8`` tensor sized by ``cudnnGetRNNTempSpaceSizes``; its
meta kernel (``torch/_meta_registrations.py``) returns an empty one ("TODO: Query
cudnnGetRNNTrainingReserveSize"), so fake tensors see none. cuDNN's formula is closed;
:func:`rnn_reserve_bytes` is the open one of AMD's MIOpen, which implements the same API
(``src/rnn.cpp: RNNDescriptor::GetReserveSize``). The one published pair of cuDNN figures
(pytorch/pytorch#2895, a P100: LSTM 736,000,000 B, GRU 864,000,000 B for one model) has
GRU:LSTM = 1.17 where MIOpen's gives 8:7 = 1.14, so take it as a close estimate until
bench/gpu_accuracy.py has measured cuDNN's own.

>>> rnn_reserve_bytes("LSTM", hidden_size=256, num_layers=2, seq_len=35, batch=20, dtype_bytes=4)
10035200
>>> conv_workspace_cap("256") // 2**20, conv_workspace_cap(None)
(256, None)
"""

from __future__ import annotations

from typing import Literal

from memfit.errors import MemfitError
from memfit.units import MiB

__all__ = ["RNNMode", "RNN_WORKSPACE_SCALE", "conv_workspace_cap", "rnn_reserve_bytes"]

#: cuDNN's cell types, as ``nn.RNN``'s ``mode`` names them
RNNMode = Literal["RNN_TANH", "RNN_RELU", "LSTM", "GRU"]

#: hidden-sized tensors per step and layer that MIOpen's reserve space scales by
#: (``RNNDescriptor`` constructor: ``workspaceScale``)
RNN_WORKSPACE_SCALE: dict[str, int] = {"RNN_TANH": 1, "RNN_RELU": 1, "LSTM": 6, "GRU": 4}


def conv_workspace_cap(setting: str | None) -> int | None:
    """The per-allocation cap of cuDNN convolution workspaces from ``CUDNN_CONV_WSCAP_DBG`` (MiB).

    Args:
        setting: the variable's value (None when unset).
    """
    if setting is None or not setting.strip():
        return None
    text = setting.strip()
    if not text.isdigit():
        raise MemfitError(f"invalid CUDNN_CONV_WSCAP_DBG={setting!r}: give a size in MiB, such as 256")
    return int(text) * MiB


def rnn_reserve_bytes(
    mode: RNNMode,
    *,
    hidden_size: int,
    num_layers: int,
    seq_len: int,
    batch: int,
    dtype_bytes: int,
    bidirectional: bool = False,
    dropout: float = 0.0,
) -> int:
    """Bytes of the reserve space a training forward of a cuDNN RNN keeps for backward.

    MIOpen's formula (see the module): ``2 * scale * layers * steps * batch * hidden``
    elements, halved and plus one hidden state per step for an LSTM, plus a hidden-sized
    output and its 1-byte dropout mask per step for every layer but the last when
    dropout is on; doubled for two directions.

    Args:
        mode: ``RNN_TANH``, ``RNN_RELU``, ``LSTM`` or ``GRU``.
        hidden_size: the cell's hidden size.
        num_layers: stacked layers.
        seq_len: time steps (a packed sequence: use the sum of its batch sizes as
            ``seq_len * batch``).
        batch: sequences per step.
        dtype_bytes: bytes of one element of the RNN's dtype.
        bidirectional: two directions per layer.
        dropout: the dropout between layers.
    """
    if mode not in RNN_WORKSPACE_SCALE:
        raise MemfitError(f"unknown RNN mode {mode!r}: use one of {', '.join(RNN_WORKSPACE_SCALE)}")
    steps = seq_len * batch
    size = 2 * RNN_WORKSPACE_SCALE[mode] * num_layers * steps * hidden_size * dtype_bytes
    if mode == "LSTM":
        size = size // 2 + num_layers * steps * hidden_size * dtype_bytes
    if dropout > 0:
        size += (num_layers - 1) * steps * hidden_size * (dtype_bytes + 1)
    return 2 * size if bidirectional else size
