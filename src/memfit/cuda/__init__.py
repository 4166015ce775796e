"""What CUDA would hold: the memory a CUDA GPU spends that the CPU running memfit does not.

The simulated GPU and the estimator run on the CPU; whatever they report for a CUDA
target must be what CUDA would hold. This package holds those facts and rules, each with
its source: the CUDA context and library workspaces by version (:mod:`memfit.cuda.context`),
cuDNN's workspaces and RNN reserve space (:mod:`memfit.cuda.cudnn`).
"""
