"""What CUDA would hold: the memory a CUDA GPU spends that the CPU running memfit does not.

The simulated GPU and the estimator run on the CPU; whatever they report for a CUDA
target must be what CUDA would hold. This package holds those facts and rules, each with
its source:

- :mod:`memfit.cuda.context`: the CUDA context and library workspaces by CUDA version;
- :mod:`memfit.cuda.cudnn`: cuDNN's convolution workspace cap and RNN reserve space;
- :mod:`memfit.cuda.target`: which GPU and CUDA / torch versions a run follows;
- :mod:`memfit.cuda.semantics`: enters the kernels below for a run (the simulated GPU and
  the estimator do), :mod:`memfit.cuda.counting` keeps their CPU-only scratch work out of
  the storage tracker;
- :mod:`memfit.cuda.sdpa_choice` and :mod:`memfit.cuda.attention`: the attention kernel
  CUDA picks and what it keeps; :mod:`memfit.cuda.autocast_lists` and
  :mod:`memfit.cuda.autocast`: CUDA autocast's op lists; :mod:`memfit.cuda.dropout`: the
  fused dropout's bool mask; :mod:`memfit.cuda.rnn`: cuDNN's LSTM/GRU/RNN;
- :mod:`memfit.cuda.kernels`: the CUDA kernel each of them stands for (FLOPs, bytes,
  dtype), reported to the estimator's step-time counter in place of the CPU's work.
"""
