"""The published single-GPU training throughputs ``bench/predicted_speed.py`` checks, each
with its source, and the calibration/validation split.

The split (stated once, here): the **calibration** rows are the only ones the calibrated
efficiencies of :mod:`memfit.estimator.kernel_rates` were fitted on (``--calibrate``):
timm's RTX 3090 rows of four CNNs, one per convolution kind and layout (ResNet-50 dense,
ResNeXt-50 grouped, EfficientNet-B0 and MobileNetV2 depthwise; NCHW and NHWC), and
Lambda's two A100 80GB SXM ResNet-50 rows (AMP, and fp32 on tf32). Every other row is a
**validation** row: other models of timm's CSVs (ResNet-18/34/101/152, ResNeXt-101,
ConvNeXt, Swin, ViT, RegNetY), other cards (Lambda's eleven others), other sources
(NVIDIA DeepLearningExamples' ResNeXt-101 and EfficientNet-B0 tables, the Hugging Face
BERT rows, Lambda's BERT SQuAD rows, NeuSight's measured fp32 training steps). No row has
moved between the sets since the split was first stated; 76 validation rows were added later
(2026-12-02: Lambda's V100 16GB, A10 and Quadro RTX 8000 ResNet-50 rows, AMP and fp32;
Lambda's 48 BERT SQuAD rows; NeuSight's 22 training labels), each by a rule fixed before
their predictions were seen, and every one is kept.
Two sources measured whole training runs on ImageNet JPEGs (DeepLearningExamples' ResNeXt-101
through DALI on the CPU, EfficientNet-B0 through PyTorch's loader with AutoAugment): their
figures include an input pipeline that memfit does not predict; they stay validation rows,
with that said in their source.
"""

from __future__ import annotations

from dataclasses import dataclass

import memfit
from memfit.memory.gpus import lookup


@dataclass(frozen=True)
class Source:
    """Where a set of rows comes from, and what it measured."""

    key: str
    citation: str
    setup: str
    #: the PyTorch the source ran (its streaming kernels' elements per thread follow it)
    torch: str


SOURCES = {
    "hf-v100": Source(
        "hf-v100",
        "Hugging Face transformers docs, 'Efficient Training on a Single GPU' (perf_train_gpu_one, "
        "v4.16-v4.18, January 2022; huggingface/transformers docs/source/en/perf_train_gpu_one.mdx)",
        "bert-large-uncased sequence classification, 512 dummy sequences of 512 tokens, one epoch of "
        "the HF Trainer (AdamW of transformers, weight decay 0, gradient clipping at 1.0, eager "
        "attention); Tesla V100-SXM2-16GB, driver 460.91, CUDA 11.2; `train_samples_per_second`",
        torch="1.x",  # the docs of January 2022 do not say which 1.x; every 1.x loads 4
    ),
    "lambda-resnet50": Source(
        "lambda-resnet50",
        "Lambda GPU benchmarks, lambdal/deeplearning-benchmark: pytorch/pytorch-train-throughput-fp16.csv "
        "and -fp32.csv (throughput), pytorch-train-bs-*.csv and scripts/config_v1 (batch sizes)",
        "NVIDIA DeepLearningExamples ResNet-50 v1.5 (PyTorch/Classification/ConvNets) in the NGC "
        "pytorch:22.09 container, synthetic data, NCHW, `--amp --static-loss-scale 256` (AMP) or fp32 "
        "(cuDNN's default tf32 on Ampere and later); one GPU; images/s. The results logs' PARAMETER lines "
        "(results/*_v1/PyTorch_resnet50_*) say SGD with momentum 0.9 and weight decay 1e-4 (not on batch "
        "norm); the rows run momentum 0.875 without weight decay (the same kernels but one small one a "
        "parameter)",
        torch="1.13",
    ),
    "lambda-bert": Source(
        "lambda-bert",
        "Lambda GPU benchmarks, lambdal/deeplearning-benchmark: the bert_base_squad and bert_large_squad "
        "columns of pytorch/pytorch-train-throughput-fp16.csv and -fp32.csv (throughput), pytorch-train-bs-*.csv "
        "and scripts/config_v1 (batch sizes), scripts/benchmark_pytorch.sh",
        "NVIDIA DeepLearningExamples BERT (PyTorch/LanguageModeling/BERT) `scripts/run_squad.sh` in the NGC "
        "pytorch:22.09 container: SQuAD v1.1 fine-tuning of BERT-base or -large (`run_squad.py`), "
        "sequences of 384 tokens, 100 steps (`max_steps`), one GPU; `training_sequences_per_second` = "
        "batch x 100 / the time of the loop, which runs 101 steps and includes the first (so the figure is "
        "a few per cent below the steady state memfit predicts). fp16: APEX amp O2 with apex's FusedAdam "
        "and dynamic loss scaling; fp32: the script's BertAdam; both clip the gradients to norm 1.0. fp32 on "
        "Ampere and later is taken as tf32 matmuls (NGC's containers turn tf32 on for cuBLAS through "
        "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE, not checked here; the CSVs' fp32 rows on an A100 run at half "
        "their fp16 ones, BERT-large 75 against 152 sequences/s, which fp32 at 19.5 of 312 TFLOP/s could not)",
        torch="1.13",
    ),
    "timm-3090": Source(
        "timm-3090",
        "timm (huggingface/pytorch-image-models) results/benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv "
        "and results/benchmark-train-amp-nhwc-pt112-cu113-rtx3090.csv",
        "timm's benchmark.py train mode: PyTorch 1.12, CUDA 11.3, one RTX 3090, AMP (fp16 autocast), "
        "SGD (timm's: momentum 0.9, Nesterov), cross-entropy, synthetic batch, the CSV's batch size and "
        "image size; NCHW, or channels_last (nhwc file); `train_samples_per_sec`",
        torch="1.12",
    ),
    "dle-resnext101": Source(
        "dle-resnext101",
        "NVIDIA DeepLearningExamples PyTorch/Classification/ConvNets/resnext101-32x4d/README.md, "
        "'Training performance results' (1 GPU rows), and its training scripts "
        "(resnext101-32x4d/training/{AMP,TF32,FP32}/DGXA100_*_90E.sh, DGX1_*_90E.sh)",
        "ResNeXt-101 32x4d, pytorch-20.06 NGC container; the README: 'Our results were obtained by running "
        "the applicable training script', and the scripts run main.py on ImageNet JPEGs with "
        "`--data-backend dali-cpu` (-j16 on DGX A100, -j5 on DGX-1), SGD momentum 0.875; its label "
        "smoothing 0.1 and weight decay 6.1e-5 (a few small kernels) are not reproduced; AMP "
        "(APEX's, `--amp --static-loss-scale 128`) with `--memory-format nhwc` at batch 128 (the DGX A100 "
        "script; the README's benchmark command and configs.yml say nhwc for DGX-1 too), TF32 at 128 "
        "(A100) and FP32 at 64 (V100), NCHW; DGX A100 40GB and DGX-1 V100 16GB/32GB, one GPU; img/s. "
        "Until this was checked the rows were described as synthetic data: the published figure includes "
        "the DALI (CPU) input pipeline, which memfit does not predict",
        torch="1.6",
    ),
    "dle-efficientnet": Source(
        "dle-efficientnet",
        "NVIDIA DeepLearningExamples PyTorch/Classification/ConvNets/efficientnet/README.md, "
        "'Training performance results' (1 GPU rows of efficientnet-b0), with the recipe of "
        "PyTorch/Classification/ConvNets/configs.yml (efficientnet-b0, DGXA100 and DGX1V-16G)",
        "EfficientNet-B0 at 224x224, pytorch-21.03 NGC container, 'obtained by running the applicable "
        "efficientnet/training/<AMP|TF32>/*.sh training script' (launch.py --mode convergence). configs.yml: "
        "batch 256 for AMP and TF32 on DGXA100, 128 for AMP and 64 for FP32 on DGX1V-16G; AMP with "
        "memory_format nhwc, TF32/FP32 NCHW; RMSprop (alpha 0.9, eps 0.01, momentum 0.9, weight decay 1e-5), "
        "label smoothing 0.1, mixup 0.2 (not reproduced: a few element-wise kernels on the batch). Unlike the "
        "other sources, these runs read ImageNet JPEGs through PyTorch's data loader with AutoAugment "
        "(data_backend pytorch, augmentation autoaugment); memfit predicts the GPU step only, so a loader "
        "that did not keep up makes the published figure lower than the step alone; img/s",
        torch="1.9",
    ),
    "neusight": Source(
        "neusight",
        "NeuSight (Lee et al., 'Forecasting GPU Performance for Deep Learning Training and Inference', "
        "ASPLOS 2025), its artifact's measured labels: scripts/asplos/label/<GPU>/<model>-train-<seq>-<batch>.json "
        "(e2e_latency, ms), the models of scripts/asplos/data/DLmodel_configs/, the loop of "
        "neusight/Tracing/trace.py (measure_e2e); the other predictors' latencies from its "
        "scripts/asplos/summary/summary.csv",
        "transformers models built from the artifact's configs (eager attention, dropout on, model.train()): "
        "BERT-large pre-training heads (AutoModelForPreTraining) at 512 tokens, GPT-2 large at 1024, its "
        "'GPT3-XL' (GPT-2 code, 3072 wide, 24 layers) and 'GPT3-2.7B' (2560 wide, 32 layers) at 2048, "
        "OPT-1.3B at 2048; fp32 with tf32 off for matmuls (PyTorch 2.1's default) and convolutions (set by the "
        "script); input_ids all ones; the latency is CUDA events around the forward plus CUDA events around "
        "loss.backward() (the cross-entropy over the logits between them is not timed), the mean of the "
        "fastest 5 of 25 iterations, with no optimizer step and no zero_grad (so each backward adds into the "
        "gradients the last one left); PyTorch 2.1.0, one GPU (A100 80GB PCIe, H100 SXM, L4, V100 PCIe "
        "32GB); samples/s = batch / latency",
        torch="2.1",
    ),
}


@dataclass(frozen=True)
class Row:
    """One published measurement, reproduced."""

    source: str
    label: str
    gpu: str
    workload: str
    settings: memfit.Settings
    published: float  # samples/s
    tf32_matmul: bool = False
    tf32_conv: bool = False
    #: one of the rows the calibrated efficiencies were fitted on (never a validation row)
    calibration: bool = False


def S(micro: int, precision: str = "fp32", accumulation: int = 1, checkpointing: str = "none") -> memfit.Settings:
    return memfit.Settings(
        precision=precision,  # type: ignore[arg-type]
        checkpointing=checkpointing,  # type: ignore[arg-type]
        micro_batch_size=micro,
        accumulation_steps=accumulation,
    )


V100 = "V100 SXM2 16GB"
ROWS: list[Row] = [
    # Hugging Face transformers docs, bert-large on a V100 (each technique of the page)
    Row("hf-v100", "batch 4, fp32", V100, "bert-large adamw", S(4), 8.86),
    Row("hf-v100", "batch 1 x 4 accumulation", V100, "bert-large adamw", S(1, accumulation=4), 7.75),
    Row("hf-v100", "batch 1 x 4, checkpointing", V100, "bert-large adamw", S(1, "fp32", 4, "blocks"), 5.99),
    Row("hf-v100", "batch 4, fp16", V100, "bert-large adamw", S(4, "fp16"), 18.64),
    Row("hf-v100", "batch 1 x 4, checkpointing, fp16", V100, "bert-large adamw", S(1, "fp16", 4, "blocks"), 10.09),
    Row("hf-v100", "batch 4, Adafactor", V100, "bert-large adafactor", S(4), 7.96),
    Row(
        "hf-v100",
        "batch 1 x 4, checkpointing, fp16, Adafactor",
        V100,
        "bert-large adafactor",
        S(1, "fp16", 4, "blocks"),
        9.06,
    ),
]
# Lambda's ResNet-50: (GPU in our table, batch AMP, images/s AMP, batch fp32, images/s fp32).
# The batch sizes are Lambda's per-GPU-memory configs (24 GB, 40 GB, 48 GB, 80 GB); the
# H100 SXM row uses the 80 GB config as the H100 PCIe row does.
_LAMBDA = [
    ("RTX 3090", 448, 905, 224, 513),
    ("RTX 4090", 448, 1301, 224, 721),
    ("RTX A6000", 928, 916, 496, 514),
    ("RTX 6000 Ada", 928, 1146, 496, 647),
    ("A100 40GB", 720, 1396, 360, 882),
    ("A100 80GB PCIe", 1280, 1527, 640, 1014),
    ("A100 80GB SXM", 1280, 1582, 640, 1066),
    ("H100 PCIe", 1280, 1866, 640, 1197),
    ("H100 SXM", 1280, 2616, 640, 1753),
    # Added 2026-12-02, before their predictions were seen, as validation rows: the CSVs' other
    # single-GPU rows. Batches: the bs CSVs (V100 16GB: 256 and 128; Quadro RTX 8000: 928 and
    # 496) and, for the A10, which the bs CSVs lack, its own logs (results/LambdaCloud_A10_v1:
    # batch_size 448 and 224). "LambdaCloud V100 16GB" is taken as the SXM2 card, which the
    # logs do not name (the PCIe card's peaks are 10 % lower): an assumption.
    ("V100 SXM2 16GB", 256, 833, 128, 369),
    ("A10", 448, 638, 224, 349),
    ("Quadro RTX 8000", 928, 651, 496, 274),
]
for _gpu, _b16, _ips16, _b32, _ips32 in _LAMBDA:
    _cal = _gpu == "A100 80GB SXM"
    _fp32 = "fp32 (tf32)" if lookup(_gpu).tf32 else "fp32"
    ROWS.append(Row("lambda-resnet50", f"{_gpu}, AMP, batch {_b16}", _gpu, "resnet50/dle", S(_b16, "fp16"), _ips16,
                    tf32_matmul=True, tf32_conv=True, calibration=_cal))  # fmt: skip
    ROWS.append(Row("lambda-resnet50", f"{_gpu}, {_fp32}, batch {_b32}", _gpu, "resnet50/dle", S(_b32), _ips32,
                    tf32_matmul=True, tf32_conv=True, calibration=_cal))  # fmt: skip

# timm's RTX 3090 training CSVs (PyTorch 1.12): (model in timm, our family, batch, NCHW img/s,
# NHWC img/s or None when not taken, a calibration row)
_TIMM = [
    ("resnet18", "resnet18", 512, 2764.22, 3481.78, False),
    ("resnet34", "resnet34", 512, 1622.41, 2036.51, False),
    ("resnet50", "resnet50", 512, 826.06, 1218.01, True),
    ("resnet101", "resnet101", 256, 568.98, 747.89, False),
    ("resnet152", "resnet152", 192, 370.08, None, False),
    ("resnext50_32x4d", "resnext50", 384, 663.39, 1001.03, True),
    ("resnext101_32x4d", "resnext101", 192, 427.18, None, False),
    ("tf_efficientnet_b0", "efficientnet_b0", 384, 1395.32, 1779.02, True),
    ("mobilenetv2_100", "mobilenetv2", 512, 1832.14, 2313.1, True),
    ("convnext_tiny", "convnext_t", 256, 813.16, 819.24, False),
    ("convnext_small", "convnext_s", 192, 489.81, None, False),
    ("swin_tiny_patch4_window7_224", "swin_t", 256, 646.76, None, False),
    ("swin_small_patch4_window7_224", "swin_s", 192, 399.67, None, False),
    ("deit_tiny_patch16_224", "vit_t16", 512, 2290.53, 2290.33, False),
    ("vit_small_patch16_224", "vit_s16", 384, 1052.92, 1057.92, False),
    ("vit_base_patch16_224", "vit_b16", 192, 390.86, None, False),
    ("regnety_040", "regnety_040", 384, 640.15, None, False),
]
# the NHWC mobilenetv2 row is the CSV's batch 512 as the NCHW one; tf_efficientnet_b0 is
# batch 384 in both; the ViT rows have no convolution but the patch embedding
for _name, _family, _batch, _nchw, _nhwc, _cal in _TIMM:
    ROWS.append(Row("timm-3090", f"{_name}, NCHW, batch {_batch}", "RTX 3090", f"{_family}/timm",
                    S(_batch, "fp16"), _nchw, calibration=_cal))  # fmt: skip
    if _nhwc is not None:
        ROWS.append(Row("timm-3090", f"{_name}, NHWC, batch {_batch}", "RTX 3090", f"{_family}/nhwc/timm",
                        S(_batch, "fp16"), _nhwc, calibration=_cal))  # fmt: skip

# DeepLearningExamples ResNeXt-101 32x4d: (GPU, AMP img/s, TF32-or-FP32 img/s, batch of the latter)
_DLE_RESNEXT = [("A100 40GB", 908.40, 300.42, 128), (V100, 534.91, 150.05, 64), ("V100 SXM2 32GB", 516.07, 139.80, 64)]
for _gpu, _amp, _full, _b in _DLE_RESNEXT:
    _tf32 = _gpu.startswith("A100")
    ROWS.append(Row("dle-resnext101", f"{_gpu}, AMP NHWC, batch 128", _gpu, "resnext101/nhwc/dle", S(128, "fp16"),
                    _amp, tf32_matmul=_tf32, tf32_conv=_tf32))  # fmt: skip
    ROWS.append(Row("dle-resnext101", f"{_gpu}, {'TF32' if _tf32 else 'FP32'}, batch {_b}", _gpu, "resnext101/dle",
                    S(_b), _full, tf32_matmul=_tf32, tf32_conv=_tf32))  # fmt: skip

# DeepLearningExamples EfficientNet-B0: (GPU, AMP batch, AMP img/s, TF32-or-FP32 batch, img/s). The
# batches are configs.yml's for the README's platforms (DGXA100: 256 and 256; DGX1V-16G: 128
# and 64). Until this was checked the rows assumed 256 everywhere and SGD (a data bug).
for _gpu, _b16, _amp, _b32, _full in (("A100 80GB SXM", 256, 2489.0, 256, 1078.0), (V100, 128, 1301.0, 64, 655.0)):
    _tf32 = _gpu.startswith("A100")
    ROWS.append(Row("dle-efficientnet", f"{_gpu}, AMP NHWC, batch {_b16}", _gpu, "efficientnet_b0/nhwc/dle-rmsprop",
                    S(_b16, "fp16"), _amp, tf32_matmul=_tf32, tf32_conv=_tf32))  # fmt: skip
    ROWS.append(Row("dle-efficientnet", f"{_gpu}, {'TF32' if _tf32 else 'FP32'}, batch {_b32}", _gpu,
                    "efficientnet_b0/dle-rmsprop", S(_b32), _full, tf32_matmul=_tf32, tf32_conv=_tf32))  # fmt: skip

# Lambda's BERT SQuAD rows (added 2026-12-02, before their predictions were seen, as validation
# rows; every single-GPU card of the CSVs but the duplicate LambdaCloud H100 PCIe and the three
# vendors' H100 SXM systems): (GPU, fp16 base batch, seq/s, fp16 large batch, seq/s, fp32 base
# batch, seq/s, fp32 large batch, seq/s). Batches from the bs CSVs; the A10 (not in them) with
# the 24 GB config, which its ResNet-50 logs show it ran; the H100 SXM (not in them) with the
# 80 GB config, as its ResNet-50 rows.
_LAMBDA_BERT = [
    ("Quadro RTX 8000", 192, 146, 64, 50, 96, 41, 32, 12),
    (V100, 48, 189, 16, 57, 24, 42, 8, 12),
    ("RTX 3090", 96, 172, 28, 52, 48, 85, 16, 24),
    ("A10", 96, 135, 28, 42, 48, 70, 16, 19),
    ("A100 40GB", 160, 368, 48, 117, 80, 179, 28, 53),
    ("A100 80GB PCIe", 320, 415, 112, 140, 172, 224, 64, 70),
    ("A100 80GB SXM", 320, 443, 112, 152, 172, 239, 64, 75),
    ("RTX 6000 Ada", 192, 255, 64, 79, 96, 136, 32, 44),
    ("RTX A6000", 192, 198, 64, 68, 96, 101, 32, 33),
    ("RTX 4090", 96, 297, 28, 93, 48, 137, 16, 44),
    ("H100 PCIe", 320, 567, 112, 203, 172, 292, 64, 97),
    ("H100 SXM", 320, 812, 112, 301, 172, 408, 64, 141),
]
for _gpu, *_figures in _LAMBDA_BERT:
    _runs = zip(("fp16", "fp16", "fp32", "fp32"), ("base", "large", "base", "large"), _figures[0::2], _figures[1::2])
    for _precision, _size, _batch, _seqs in _runs:
        _how = "fp16 (APEX O2)" if _precision == "fp16" else ("fp32 (tf32)" if lookup(_gpu).tf32 else "fp32")
        # S(...) in fp32: APEX O2 makes the model fp16 itself, without autocast
        ROWS.append(Row("lambda-bert", f"{_gpu}, BERT-{_size}, {_how}, batch {_batch}", _gpu,
                        f"bert-squad {_size} {_precision}", S(_batch), _seqs, tf32_matmul=True))  # fmt: skip

# NeuSight's measured training labels (added 2026-12-02, before their predictions were seen,
# as validation rows). The rule: every single-GPU NVIDIA training label of the artifact
# (scripts/asplos/label/*/<model>-train-<seq>-<batch>.json, no -dp/-tp/-pp/-fusion), but the
# Switch Transformer's, whose trace.py replaces transformers' expert forward with one of its
# own (set_moe) that memfit would have to copy. (GPU, model, sequence, batch, measured ms,
# and the latencies the paper's predictors gave the same row in summary.csv: NeuSight,
# Habitat, roofline.) The artifact's device names: NVIDIA_A100_80GB_PCIe,
# NVIDIA_H100_80GB_HBM3 (the SXM card), NVIDIA_L4, Tesla_V100-PCIE-32GB.
NEUSIGHT_MODELS = {"bert_large": "BERT-large", "gpt2_large": "GPT-2 large", "gpt3_xl": "GPT3-XL",
                   "gpt3_27": "GPT3-2.7B", "opt_13": "OPT-1.3B"}  # fmt: skip
_NEUSIGHT = [
    ("A100 80GB PCIe", "bert_large", 512, 2, 213.1804, 213.4335, 160.8699, 125.0084),
    ("A100 80GB PCIe", "bert_large", 512, 8, 716.2194, 719.1108, 168.9611, 494.0697),
    ("A100 80GB PCIe", "gpt2_large", 1024, 1, 524.0467, 496.5555, 406.3582, 331.7726),
    ("A100 80GB PCIe", "gpt2_large", 1024, 4, 1635.7427, 1797.518, 732.7012, 1298.930),
    ("A100 80GB PCIe", "gpt3_27", 2048, 1, 3012.9248, 2946.719, 1897.111, 2151.624),
    ("A100 80GB PCIe", "gpt3_xl", 2048, 1, 2502.1854, 3200.329, 1656.650, 2195.736),
    ("A100 80GB PCIe", "opt_13", 2048, 1, 1369.5107, 1499.198, 1204.448, 1064.362),
    ("A100 80GB PCIe", "opt_13", 2048, 2, 3188.8204, 3062.623, 1791.767, 2120.991),
    ("H100 SXM", "bert_large", 512, 2, 74.7511, 85.19366, 3995.433, 39.61134),
    ("H100 SXM", "bert_large", 512, 8, 235.9829, 277.5590, 4050.611, 155.0809),
    ("H100 SXM", "gpt2_large", 1024, 1, 183.9771, 214.0655, 3855.063, 112.6542),
    ("H100 SXM", "gpt2_large", 1024, 4, 638.8086, 649.5551, 4013.779, 434.7311),
    ("H100 SXM", "gpt3_27", 2048, 1, 998.7345, 1014.591, 3973.887, 701.1650),
    ("H100 SXM", "gpt3_xl", 2048, 1, 933.4368, 944.7892, 2917.934, 692.7705),
    ("H100 SXM", "opt_13", 2048, 1, 513.2800, 520.8065, 4339.885, 340.3650),
    ("H100 SXM", "opt_13", 2048, 2, 1015.9247, 1014.534, 4557.317, 676.3676),
    ("L4", "bert_large", 512, 2, 316.2993, 326.7947, 2324.982, 159.7940),
    ("L4", "bert_large", 512, 8, 1275.4411, 1076.546, 2303.819, 600.7094),
    ("L4", "gpt2_large", 1024, 1, 967.4424, 940.2271, 2445.746, 592.9695),
    ("V100 PCIe 32GB", "bert_large", 512, 2, 234.2580, 266.1347, 226.4637, 182.5901),
    ("V100 PCIe 32GB", "bert_large", 512, 8, 841.1236, 867.0548, 812.5796, 717.5384),
    ("V100 PCIe 32GB", "gpt2_large", 1024, 1, 576.9212, 634.8012, 631.9315, 505.5759),
]
#: (row label) -> {predictor: its predicted ms} for the rows above; the measured ms beside
OTHER_PREDICTORS: dict[str, dict[str, float]] = {}
MEASURED_MS: dict[str, float] = {}
for _gpu, _model, _seq, _batch, _ms, _neusight, _habitat, _roofline in _NEUSIGHT:
    _label = f"{_gpu}, {NEUSIGHT_MODELS[_model]}, seq {_seq}, batch {_batch}, fp32"
    ROWS.append(Row("neusight", _label, _gpu, f"neusight {_model} {_seq}", S(_batch), _batch / (_ms / 1000)))
    MEASURED_MS[_label] = _ms
    OTHER_PREDICTORS[_label] = {"NeuSight": _neusight, "Habitat": _habitat, "roofline": _roofline}
