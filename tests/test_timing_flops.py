"""FLOPs of convolutions, against hand counts: PyTorch's backward formula ignores groups in
the weight gradient (16.5x for 32 groups, 48.5x depthwise); memfit's counts them."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import conv_backward_flop

import memfit
from memfit.estimator.flops import conv_backward_flops
from memfit.estimator.speed import record_step
from memfit.workload import Workload

N, C, HW = 8, 256, 14


def conv_workload(groups: int, channels: int = C, kernel: int = 3) -> Workload:
    """One convolution whose input needs a gradient (a parameter scales it first)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(channels, 1, 1))
            self.conv = nn.Conv2d(channels, channels, kernel, padding=kernel // 2, groups=groups, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x * self.scale)

    return Workload(
        model=Net,
        make_batch=lambda n: torch.randn(n, channels, HW, HW),
        loss=lambda model, x: model(x).sum(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        name=f"conv groups={groups}",
    )


def hand_count(groups: int, channels: int = C, kernel: int = 3) -> int:
    """2 FLOPs per multiply-add: each output element sums (C / g) x k x k products."""
    return 2 * N * HW * HW * channels * (channels // groups) * kernel * kernel


@pytest.mark.parametrize("groups", [1, 32, C])
def test_a_convolutions_forward_and_backward_flops_are_the_hand_counts(groups: int) -> None:
    trace = record_step(conv_workload(groups), memfit.Settings(micro_batch_size=N))
    products = sorted(f for f in trace.forward_backward.flops if f > 0)
    forward = hand_count(groups)
    # forward, then the backward's input and weight gradients: one forward each
    assert products == [forward, 2 * forward]
    assert trace.uncounted == 0


@pytest.mark.parametrize(("groups", "ratio"), [(32, 16.5), (C, (1 + C) / 2), (1, 1.0)])
def test_pytorchs_backward_formula_counts_groups_times_the_weight_gradient(groups: int, ratio: float) -> None:
    # the error memfit's formula corrects (issue 22): PyTorch's count over the hand count
    args = ([N, C, HW, HW], [N, C, HW, HW], [C, C // groups, 3, 3], None, [1, 1], [1, 1], [1, 1], False, [0, 0])
    grads = ([N, C, HW, HW], [C, C // groups, 3, 3], None)  # input, weight, bias gradients
    theirs = conv_backward_flop(*args, groups, [True, True, False], out_val=grads)
    ours = conv_backward_flops(*args, groups, [True, True, False])
    assert ours == 2 * hand_count(groups)
    assert theirs / ours == pytest.approx(ratio)


def test_only_the_gradients_asked_for_are_counted_and_transposed_convolutions_too() -> None:
    # the first layer's input needs no gradient: the weight's alone
    args = ([N, 64, 28, 28], [N, 3, 56, 56], [64, 3, 7, 7], None, [2, 2], [3, 3], [1, 1], False, [0, 0], 1)
    assert conv_backward_flops(*args, [False, True, False]) == 2 * N * 28 * 28 * 64 * 3 * 49
    # a transposed convolution of 4 groups: weight [C_in, C_out / g, k, k], products per input element
    x, w = torch.empty(N, 64, 7, 7), torch.empty(64, 8, 4, 4)
    grad = torch.empty(N, 32, 14, 14)
    counted = conv_backward_flops(grad, x, w, None, [2, 2], [1, 1], [1, 1], True, [0, 0], 4, [True, True, False])
    assert counted == 2 * (2 * N * 7 * 7 * 64 * 8 * 16)
