"""memfit doctor's checks: each finding's severity and fix line, from recorded NVML and torch answers.

NVML and GPUs are what this machine cannot have, so their answers are recorded facts
(:class:`memfit.environment.system.RecordedProbe`); the live run on this machine is tested too.
"""

from __future__ import annotations

import json

import pytest
import torch

from memfit.environment.doctor import (
    EnvironmentFinding,
    TrainingHints,
    check_allocator,
    check_arch,
    check_cuda_driver,
    check_cudnn,
    check_cudnn_benchmark,
    check_gpu_memory,
    check_host,
    check_nvml,
    check_python,
    check_torch_build,
    check_torch_sees_gpus,
    check_visible_devices,
    diagnose,
    parse_alloc_conf,
)
from memfit.environment.system import (
    GpuInfo,
    GpuProcess,
    HostFacts,
    LiveProbe,
    NvidiaFacts,
    PythonFacts,
    RecordedProbe,
    TorchFacts,
)
from memfit.environment.versions import (
    arch_supported,
    base_version,
    cuda_tag_version,
    format_cudnn_version,
    min_driver_for,
    pick_cuda_build,
    version_tuple,
)

GiB = 2**30
MiB = 2**20
INDEX = "https://download.pytorch.org/whl"
A100 = "NVIDIA A100-SXM4-80GB"
ARCHS_CU124 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")


def gpu(
    index: int = 0,
    name: str = A100,
    cap: tuple[int, int] = (8, 0),
    total: int = 80 * GiB,
    used: int = GiB,
    processes: tuple[GpuProcess, ...] = (),
) -> GpuInfo:
    return GpuInfo(
        index,
        name,
        f"GPU-{index}f3a9c2e-1111-2222-3333-444455556666",
        f"00000000:{7 + index:02X}:00.0",
        total,
        used,
        total - used,
        cap,
        processes,
    )


def nvidia(*gpus: GpuInfo, cuda: tuple[int, int] = (12, 4), driver: str = "550.54.14") -> NvidiaFacts:
    return NvidiaFacts("nvml", driver, cuda, gpus)


def cuda_torch(
    version: str = "2.5.1+cu124",
    cuda: str = "12.4",
    arch_list: tuple[str, ...] = ARCHS_CU124,
    available: bool = True,
    cudnn: int | None = 90100,
) -> TorchFacts:
    return TorchFacts(
        version=version,
        cuda=cuda,
        cudnn=cudnn,
        arch_list=arch_list,
        cuda_available=available,
        device_count=1 if available else 0,
    )


def only(findings: list[EnvironmentFinding], severity: str | None = None) -> EnvironmentFinding:
    """The one finding of a check (and of ``severity`` when given)."""
    chosen = [f for f in findings if severity is None or f.severity == severity]
    assert len(chosen) == 1, findings
    return chosen[0]


# -- pure helpers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2.5.1+cu124", (2, 5, 1)),
        ("2.13.0", (2, 13, 0)),
        ("550.54.14", (550, 54, 14)),
        ("2.6.0.dev20241112", (2, 6, 0)),
        (None, ()),
        ("", ()),
    ],
)
def test_version_tuple(text, expected):
    assert version_tuple(text) == expected


@pytest.mark.parametrize("tag, expected", [("cu118", (11, 8)), ("cu124", (12, 4)), ("cu130", (13, 0))])
def test_cuda_tag_version(tag, expected):
    assert cuda_tag_version(tag) == expected


@pytest.mark.parametrize(
    "version, driver, expected",
    [
        ("2.5.1", (12, 4), "cu124"),
        ("2.5.1", (12, 2), "cu121"),
        ("2.5.1", (11, 8), "cu118"),
        ("2.5.1", (11, 4), None),
        ("2.7.0", (12, 8), "cu128"),
        ("2.7.0", (12, 6), "cu126"),
        ("2.3.1", (13, 0), "cu121"),
        ("2.11.0", (12, 8), "cu128"),
        ("2.5.1", None, "cu124"),
    ],
)
def test_pick_cuda_build_takes_the_newest_the_driver_runs(version, driver, expected):
    assert pick_cuda_build(version, driver) == expected


@pytest.mark.parametrize(
    "cuda, expected", [((12, 4), "550.54.14"), ((12, 7), "570.26"), ((11, 8), "520.61.05"), ((14, 0), None)]
)
def test_min_driver_for(cuda, expected):
    assert min_driver_for(cuda) == expected


@pytest.mark.parametrize("value, expected", [(90100, "9.1.0"), (90501, "9.5.1"), (8902, "8.9.2"), (8700, "8.7.0")])
def test_format_cudnn_version(value, expected):
    assert format_cudnn_version(value) == expected


@pytest.mark.parametrize(
    "capability, arch_list, expected",
    [
        ((8, 6), ("sm_80",), True),  # same major, newer minor: the sm_80 cubin runs
        ((8, 0), ("sm_86",), False),  # older minor cannot run sm_86 code
        ((9, 0), ("sm_80",), False),  # another major needs its own cubin or PTX
        ((9, 0), ("sm_80", "compute_80"), True),  # PTX is compiled at load time
        ((9, 0), ("sm_90a",), True),
        ((10, 0), ("sm_90a",), False),  # arch-specific code runs only on 9.0
        ((12, 0), ARCHS_CU124, False),
        ((6, 1), ("sm_75", "sm_80", "sm_90", "sm_100", "sm_120"), False),
    ],
)
def test_arch_supported(capability, arch_list, expected):
    assert arch_supported(capability, arch_list) is expected


@pytest.mark.parametrize(
    "text, pairs, malformed",
    [
        ("expandable_segments:True", [("expandable_segments", "True")], []),
        (
            " max_split_size_mb:128 , garbage_collection_threshold:0.6",
            [("max_split_size_mb", "128"), ("garbage_collection_threshold", "0.6")],
            [],
        ),
        (
            "roundup_power2_divisions:[256:1,512:2,>:8],expandable_segments:False",
            [("roundup_power2_divisions", "[256:1,512:2,>:8]"), ("expandable_segments", "False")],
            [],
        ),
        ("expandable_segments,backend:", [], ["expandable_segments", "backend:"]),
        ("", [], []),
    ],
)
def test_parse_alloc_conf(text, pairs, malformed):
    assert parse_alloc_conf(text) == (pairs, malformed)


def test_base_version():
    assert base_version("2.5.1+cu124") == "2.5.1" and base_version("2.5.1") == "2.5.1"


# -- torch's build -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "version, driver_cuda, tag",
    [
        ("2.5.1+cpu", (12, 4), "cu124"),
        ("2.5.1+cpu", (12, 2), "cu121"),
        ("2.7.0+cpu", (12, 8), "cu128"),
        ("2.3.0", (11, 8), "cu118"),  # PyPI's CPU wheel on macOS/Windows has no +cpu tag
    ],
)
def test_cpu_wheel_with_a_gpu_is_an_error_with_the_matching_cuda_build(version, driver_cuda, tag):
    finding = only(check_torch_build(TorchFacts(version=version), nvidia(gpu(), cuda=driver_cuda)))
    assert finding.severity == "error"
    assert "CPU-only build" in finding.message and A100 in finding.message
    assert finding.fix == f"pip install --force-reinstall torch=={base_version(version)} --index-url {INDEX}/{tag}"


def test_cpu_wheel_with_a_driver_too_old_for_any_build_says_upgrade_the_driver():
    finding = only(check_torch_build(TorchFacts(version="2.5.1+cpu"), nvidia(gpu(), cuda=(11, 4), driver="470.82.01")))
    assert finding.severity == "error"
    assert finding.fix == (
        "upgrade the NVIDIA driver (it runs CUDA up to 11.4), then: "
        f"pip install --force-reinstall torch==2.5.1 --index-url {INDEX}/cu124"
    )


def test_cpu_wheel_without_a_gpu_is_information_not_a_broken_install():
    no_gpu = NvidiaFacts(error="NVML: NVML Shared Library Not Found")
    finding = only(check_torch_build(TorchFacts(version="2.13.0+cpu"), no_gpu))
    assert finding.severity == "info" and finding.fix is None
    assert finding.message.startswith("no GPU visible (NVML: NVML Shared Library Not Found)")


def test_cuda_wheel_without_a_gpu_is_a_warning():
    finding = only(check_torch_build(cuda_torch(available=False), NvidiaFacts(error="NVML: Driver Not Loaded")))
    assert finding.severity == "warning"
    assert finding.fix == "check the driver with nvidia-smi; in a container, start it with --gpus all"


@pytest.mark.parametrize("gpus, tag", [((), "cpu"), ((gpu(),), "cu130")])
def test_missing_torch_is_an_error(gpus, tag):
    facts = TorchFacts(error="torch is not importable: No module named 'torch'")
    finding = only(check_torch_build(facts, nvidia(*gpus, cuda=(13, 0))))
    assert finding.severity == "error" and finding.message == facts.error
    assert finding.fix == f"pip install torch --index-url {INDEX}/{tag}"


def test_rocm_build_skips_nvidia_checks():
    finding = only(check_torch_build(TorchFacts(version="2.5.1+rocm6.2", hip="6.2.41133"), nvidia(gpu())))
    assert finding.severity == "info" and "ROCm" in finding.message


def test_cuda_wheel_with_gpus_reports_what_torch_sees():
    finding = only(check_torch_build(cuda_torch(), nvidia(gpu(), gpu(1))))
    assert finding.severity == "info" and finding.message.endswith("torch sees 1 of 2 GPU(s)")


# -- CUDA against the driver -------------------------------------------------------------


def test_driver_too_old_for_torch_cuda_is_an_error():
    finding = only(
        check_cuda_driver(cuda_torch("2.3.1+cu121", "12.1"), nvidia(gpu(), cuda=(11, 4), driver="470.82.01"))
    )
    assert finding.severity == "error"
    assert "runs CUDA only up to 11.4" in finding.message and "470.82.01" in finding.message
    assert finding.fix == "upgrade the NVIDIA driver to 530.30.02 or newer"


def test_driver_too_old_with_an_older_build_available_offers_both_fixes():
    finding = only(check_cuda_driver(cuda_torch(), nvidia(gpu(), cuda=(11, 8), driver="520.61.05")))
    assert finding.severity == "error"
    assert finding.fix == (
        f"pip install --force-reinstall torch==2.5.1 --index-url {INDEX}/cu118  "
        "(or upgrade the NVIDIA driver to 550.54.14 or newer)"
    )


def test_newer_minor_cuda_than_the_driver_is_a_warning():
    finding = only(check_cuda_driver(cuda_torch(), nvidia(gpu(), cuda=(12, 2), driver="535.104.05")))
    assert finding.severity == "warning" and "minor-version compatibility" in finding.message
    assert finding.fix.startswith(f"pip install --force-reinstall torch==2.5.1 --index-url {INDEX}/cu121")


def test_driver_new_enough_is_information():
    finding = only(check_cuda_driver(cuda_torch(), nvidia(gpu(), cuda=(12, 8), driver="570.86.15")))
    assert finding.severity == "info" and finding.fix is None


def test_nvml_failing_with_the_library_present_is_a_driver_error():
    finding = only(check_nvml(NvidiaFacts(error="NVML: Driver/library version mismatch")))
    assert finding.severity == "error" and "version mismatch" in finding.message
    assert finding.fix.startswith("reboot (or reload the nvidia kernel modules)")


@pytest.mark.parametrize("error", ["NVML: NVML Shared Library Not Found", "NVML: Driver Not Loaded", None])
def test_no_nvml_library_is_not_a_driver_error(error):
    assert check_nvml(NvidiaFacts(error=error)) == []


def test_cuda_build_that_cannot_use_a_visible_gpu_is_an_error():
    facts = TorchFacts(
        version="2.5.1+cu124",
        cuda="12.4",
        arch_list=ARCHS_CU124,
        cuda_available=False,
        warnings=("CUDA initialization: Unexpected error from cudaGetDeviceCount()",),
    )
    finding = only(check_torch_sees_gpus(facts, nvidia(gpu()), {}))
    assert finding.severity == "error" and "cudaGetDeviceCount" in finding.message
    # an old driver or CUDA_VISIBLE_DEVICES="" explains it: their own checks speak
    assert check_torch_sees_gpus(facts, nvidia(gpu(), cuda=(11, 4)), {}) == []
    assert check_torch_sees_gpus(facts, nvidia(gpu()), {"CUDA_VISIBLE_DEVICES": ""}) == []


# -- architectures and cuDNN -------------------------------------------------------------


def test_gpu_newer_than_the_wheel_is_an_error_with_a_build_that_has_its_kernels():
    rtx5090 = gpu(name="NVIDIA GeForce RTX 5090", cap=(12, 0), total=32 * GiB)
    finding = only(check_arch(cuda_torch(), nvidia(rtx5090, cuda=(12, 8), driver="570.124.04")))
    assert finding.severity == "error"
    assert "sm_120" in finding.message and "no kernel image" in finding.message
    assert finding.fix == (
        f'pip install --force-reinstall "torch==2.10.*" --index-url {INDEX}/cu128  '
        "(torch 2.5.1 has no build for sm_120)"
    )
    old_driver = only(check_arch(cuda_torch(), nvidia(rtx5090, cuda=(12, 4))))
    assert (
        old_driver.fix
        == f"upgrade the NVIDIA driver to 570.26, then: pip install --upgrade torch --index-url {INDEX}/cu132"
    )


def test_gpu_newer_than_the_wheel_with_a_build_of_the_same_release():
    b200 = gpu(name="NVIDIA B200", cap=(10, 0), total=180 * GiB)
    torch_facts = cuda_torch("2.7.0+cu118", "11.8", ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"))
    finding = only(check_arch(torch_facts, nvidia(b200, cuda=(12, 8))))
    assert finding.severity == "error"
    assert finding.fix == f"pip install --force-reinstall torch==2.7.0 --index-url {INDEX}/cu128"


def test_gpu_older_than_the_wheel_gets_the_oldest_build():
    gtx1080 = gpu(name="NVIDIA GeForce GTX 1080", cap=(6, 1), total=8 * GiB)
    torch_facts = cuda_torch("2.7.0+cu128", "12.8", ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"))
    finding = only(check_arch(torch_facts, nvidia(gtx1080, cuda=(12, 8))))
    assert finding.severity == "error" and "older CUDA build" in finding.message
    assert finding.fix == f"pip install --force-reinstall torch==2.7.0 --index-url {INDEX}/cu118"


def test_supported_gpus_give_no_arch_finding():
    assert check_arch(cuda_torch(), nvidia(gpu(), gpu(1, "NVIDIA RTX A6000", (8, 6)))) == []


def test_cudnn_version_is_reported_and_a_missing_one_warned():
    assert only(check_cudnn(cuda_torch())).message == "cuDNN 9.1.0 (as torch loads it)"
    finding = only(check_cudnn(cuda_torch(cudnn=None)))
    assert finding.severity == "warning" and finding.fix == "pip install --force-reinstall nvidia-cudnn-cu12"
    assert check_cudnn(TorchFacts(version="2.13.0+cpu")) == []


# -- GPU memory and other processes ------------------------------------------------------


def test_foreign_process_holding_70_percent_of_the_card_is_a_warning():
    notebook = GpuProcess(4242, "/usr/bin/python3", 56 * GiB)  # 56 of 80 GiB = 70 %
    busy, spare = gpu(0, used=57 * GiB, processes=(notebook,)), gpu(1)
    findings = check_gpu_memory(nvidia(busy, spare), own_pid=999)
    finding = only(findings, "warning")
    assert finding.message == ("other processes hold 56.00 GiB (70 %) of GPU 0: pid 4242 /usr/bin/python3 (56.00 GiB)")
    assert finding.fix == (
        "stop them (kill 4242; a forgotten notebook kernel is the usual one), "
        f"or use another GPU: CUDA_VISIBLE_DEVICES={spare.uuid}"
    )
    info = [f for f in findings if f.severity == "info"]
    assert info[0].message == f"GPU 0 {A100}: 80.00 GiB total, 57.00 GiB used, 23.00 GiB free"


def test_own_process_and_small_foreign_use_are_not_warned():
    mine = GpuProcess(999, "python", 60 * GiB)
    small = GpuProcess(7, "Xorg", 2 * GiB)
    findings = check_gpu_memory(nvidia(gpu(used=63 * GiB, processes=(mine, small))), own_pid=999)
    assert [f.severity for f in findings] == ["info"]


def test_process_with_unknown_memory_is_listed_with_a_question_mark():
    known, unknown = GpuProcess(11, "train", 20 * GiB), GpuProcess(12, "?", None)
    finding = only(check_gpu_memory(nvidia(gpu(used=21 * GiB, processes=(known, unknown))), own_pid=1), "warning")
    assert finding.message.endswith("pid 11 train (20.00 GiB), pid 12 ? (?)")
    assert finding.fix == "stop them (kill 11 12; a forgotten notebook kernel is the usual one)"


def test_used_memory_with_no_process_listed_is_a_warning():
    findings = check_gpu_memory(nvidia(gpu(used=30 * GiB)), own_pid=1)
    finding = only(findings, "warning")
    assert finding.message == (
        "GPU 0 has 30.00 GiB in use (38 %) but NVML lists no process: processes in other "
        "containers or PID namespaces hold 30.00 GiB"
    )
    assert finding.fix == "run nvidia-smi on the host (outside the container) to find them"


def test_used_memory_beyond_the_listed_processes_is_a_warning():
    listed = GpuProcess(5, "python", 2 * GiB)
    finding = only(check_gpu_memory(nvidia(gpu(used=30 * GiB, processes=(listed,))), own_pid=5), "warning")
    assert "NVML's processes account for only 2.00 GiB" in finding.message and "28.00 GiB" in finding.message


def test_idle_card_with_driver_reserved_memory_is_information_only():
    assert [f.severity for f in check_gpu_memory(nvidia(gpu(used=500 * MiB)), own_pid=1)] == ["info"]


# -- CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER ------------------------------------------

TWO = nvidia(gpu(0), gpu(1, "NVIDIA RTX A6000", (8, 6), 48 * GiB))
ORDERED = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@pytest.mark.parametrize(
    "value, severity, text, fix",
    [
        (
            "",
            "warning",
            "CUDA_VISIBLE_DEVICES='' hides every GPU from torch",
            "unset CUDA_VISIBLE_DEVICES  (or name a GPU: CUDA_VISIBLE_DEVICES=0)",
        ),
        ("-1", "warning", "hides every GPU", "unset CUDA_VISIBLE_DEVICES  (or name a GPU: CUDA_VISIBLE_DEVICES=0)"),
        ("0,4,1", "warning", "names '4', which is not a GPU here", "export CUDA_VISIBLE_DEVICES=0"),
        ("1", "info", "CUDA_VISIBLE_DEVICES=1: torch sees 1 of 2 GPUs", None),
        ("GPU-1f3a9c2e", "info", "torch sees 1 of 2 GPUs", None),
        ("GPU-0f3a9c2e,1", "info", "torch sees 2 of 2 GPUs", None),
    ],
)
def test_cuda_visible_devices(value, severity, text, fix):
    finding = only(check_visible_devices({"CUDA_VISIBLE_DEVICES": value, **ORDERED}, TWO))
    assert finding.severity == severity and text in finding.message and finding.fix == fix


def test_device_order_unset_with_several_gpus_is_a_warning():
    finding = only(check_visible_devices({}, TWO))
    assert finding.severity == "warning" and "nvidia-smi" in finding.message
    assert finding.fix == "export CUDA_DEVICE_ORDER=PCI_BUS_ID"


@pytest.mark.parametrize("environ, facts", [({}, nvidia(gpu())), (ORDERED, TWO), ({}, NvidiaFacts())])
def test_device_order_is_fine_with_one_gpu_or_when_set(environ, facts):
    assert check_visible_devices(environ, facts) == []


def test_unknown_device_order_is_a_warning():
    finding = only(check_visible_devices({"CUDA_DEVICE_ORDER": "PCI"}, TWO))
    assert finding.severity == "warning" and finding.fix == "export CUDA_DEVICE_ORDER=PCI_BUS_ID"


# -- allocator settings ------------------------------------------------------------------

CUDA_CONF, ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"


@pytest.mark.parametrize(
    "environ, message, fix",
    [
        (
            {CUDA_CONF: "expandable_segment:True"},
            "PYTORCH_CUDA_ALLOC_CONF: unknown key 'expandable_segment' (did you mean expandable_segments?)",
            "replace expandable_segment with expandable_segments in PYTORCH_CUDA_ALLOC_CONF",
        ),
        ({CUDA_CONF: "zzz:1"}, "PYTORCH_CUDA_ALLOC_CONF: unknown key 'zzz'", "remove zzz from PYTORCH_CUDA_ALLOC_CONF"),
        (
            {CUDA_CONF: "max_split_size_mb:128,expandable_segments:True"},
            "PYTORCH_CUDA_ALLOC_CONF sets max_split_size_mb with expandable_segments:True",
            "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        ),
        (
            {CUDA_CONF: "expandable_segments"},
            "'expandable_segments' is not key:value",
            "fix or remove 'expandable_segments' in PYTORCH_CUDA_ALLOC_CONF",
        ),
        (
            {CUDA_CONF: "expandable_segments:yes"},
            "expandable_segments:yes must be True or False",
            "fix expandable_segments in PYTORCH_CUDA_ALLOC_CONF",
        ),
        (
            {CUDA_CONF: "max_split_size_mb:16"},
            "max_split_size_mb:16 must be more than 20 (MiB)",
            "fix max_split_size_mb in PYTORCH_CUDA_ALLOC_CONF",
        ),
        (
            {CUDA_CONF: "garbage_collection_threshold:1.5"},
            "garbage_collection_threshold:1.5 must be a fraction",
            "fix garbage_collection_threshold in PYTORCH_CUDA_ALLOC_CONF",
        ),
        (
            {CUDA_CONF: "backend:cudaMallocAsync,expandable_segments:True"},
            "backend:cudaMallocAsync ignores expandable_segments",
            "remove expandable_segments or the backend key from PYTORCH_CUDA_ALLOC_CONF",
        ),
        (
            {CUDA_CONF: "expandable_segments:True", ALLOC_CONF: "expandable_segments:False"},
            "PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF differ",
            "keep one: unset PYTORCH_ALLOC_CONF  (PYTORCH_CUDA_ALLOC_CONF is read by every release)",
        ),
    ],
)
def test_bad_allocator_settings_are_found(environ, message, fix):
    """Settings torch refuses at CUDA's start are errors (exit 1, issue 14 item 13); the rest warnings."""
    finding = only(check_allocator(environ, "2.13.0+cu130", variable_shapes=False))
    refused = "torch refuses to start" in finding.message
    assert finding.severity == ("error" if refused else "warning")
    assert message in finding.message and finding.fix == fix


@pytest.mark.parametrize(
    "value",
    [
        "expandable_segment:True",
        "zzz:1",
        "expandable_segments",
        "expandable_segments:yes",
        "max_split_size_mb:16",
        "garbage_collection_threshold:1.5",
        "backend:magic",
        "max_split_size_mb:lots",
    ],
)
def test_allocator_settings_torch_refuses_are_errors_and_fail_doctor(value):
    findings = check_allocator({CUDA_CONF: value}, "2.13.0+cu130", variable_shapes=False)
    assert [f.severity for f in findings] == ["error"], findings
    assert "torch refuses to start" in findings[0].message and findings[0].fix


@pytest.mark.parametrize("version, warned", [("2.9.1+cu128", True), ("2.5.1+cu124", True), ("2.11.0+cu128", False)])
def test_only_the_new_variable_is_warned_on_releases_that_may_ignore_it(version, warned):
    findings = check_allocator({ALLOC_CONF: "expandable_segments:True"}, version, variable_shapes=False)
    if warned:
        finding = only(findings)
        assert finding.severity == "warning" and "pytorch#183387" in finding.message
        assert finding.fix == "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    else:
        assert findings == []


@pytest.mark.parametrize(
    "environ, version, fix",
    [
        ({}, "2.13.0+cu130", "export PYTORCH_ALLOC_CONF=expandable_segments:True"),
        ({}, "2.5.1+cu124", "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
        (
            {CUDA_CONF: "garbage_collection_threshold:0.6,expandable_segments:False"},
            "2.5.1",
            "export PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.6,expandable_segments:True",
        ),
    ],
)
def test_expandable_segments_suggested_for_variable_shapes(environ, version, fix):
    finding = [
        f for f in check_allocator(environ, version, variable_shapes=True) if "variable input shapes" in f.message
    ]
    assert len(finding) == 1 and finding[0].severity == "info" and finding[0].fix == fix


def test_good_allocator_settings_give_no_warning():
    findings = check_allocator(
        {CUDA_CONF: "expandable_segments:True,roundup_power2_divisions:[256:1,>:4]"}, "2.5.1", variable_shapes=True
    )
    assert findings == []
    assert only(check_allocator({}, "2.5.1", variable_shapes=False)).severity == "info"


# -- host: /dev/shm and RAM; cudnn.benchmark; Python -------------------------------------


def host(shm: int | None, available: int = 60 * GiB) -> HostFacts:
    return HostFacts("Linux", "6.8.0", "x86_64", 32, 64 * GiB, available, shm, shm)


def test_docker_default_shm_is_a_warning():
    finding = only(check_host(host(64 * MiB), TrainingHints()), "warning")
    assert "64.00 MiB" in finding.message and "Bus error" in finding.message
    assert finding.fix == "docker run --shm-size=8g ...  (or --ipc=host)"


def test_shm_smaller_than_the_dataloader_needs_is_a_warning():
    hints = TrainingHints(workers=8, batch_bytes=512 * MiB)  # 8 workers x 2 batches x 512 MiB = 8 GiB
    finding = only(check_host(host(2 * GiB), hints), "warning")
    assert finding.message.startswith("/dev/shm holds 2.00 GiB, but 8 DataLoader workers × prefetch 2 × 512.00 MiB")
    assert finding.fix == "docker run --shm-size=16g ...  (or --ipc=host), or fewer workers: num_workers=2"


def test_host_ram_smaller_than_the_dataloader_needs_is_a_warning():
    hints = TrainingHints(workers=4, batch_bytes=GiB)
    findings = check_host(host(64 * GiB, available=4 * GiB), hints)
    finding = only(findings, "warning")
    assert "host RAM available (4.00 GiB)" in finding.message and "8.00 GiB" in finding.message


def test_enough_shm_and_ram_is_information():
    assert [f.severity for f in check_host(host(32 * GiB), TrainingHints(workers=4, batch_bytes=GiB))] == ["info"]
    assert [f.severity for f in check_host(host(None), TrainingHints())] == ["info"]


@pytest.mark.parametrize(
    "benchmark, variable, warned",
    [
        (True, True, True),
        (True, False, False),
        (False, True, False),
        (None, True, False),
    ],
)
def test_cudnn_benchmark_with_variable_shapes(benchmark, variable, warned):
    findings = check_cudnn_benchmark(benchmark, variable)
    assert len(findings) == int(warned)
    if warned:
        assert findings[0].severity == "warning"
        assert findings[0].fix == "torch.backends.cudnn.benchmark = False  (or pad inputs to a few fixed shapes)"


def test_cudnn_benchmark_is_read_from_this_process_when_not_given():
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        found = diagnose(RecordedProbe(), TrainingHints(variable_shapes=True))
    finally:
        torch.backends.cudnn.benchmark = previous
    assert [f.check for f in found.findings if f.severity == "warning"] == ["cudnn-benchmark"]


def python(prefix: str, base: str, conda_prefix: str | None = None, conda_env: str | None = None) -> PythonFacts:
    return PythonFacts("3.11.7", "CPython", f"{prefix}/bin/python", prefix, base, conda_prefix, conda_env)


def test_python_environment_manager(tmp_path):
    conda = only(
        check_python(python("/opt/conda/envs/train", "/opt/conda/envs/train", "/opt/conda/envs/train", "train"))
    )
    assert conda.severity == "info" and conda.message == "Python 3.11.7 in conda env 'train' (/opt/conda/envs/train)"
    venv = only(check_python(python("/work/.venv", "/usr")))
    assert venv.severity == "info" and venv.message == "Python 3.11.7 in virtual env /work/.venv"
    (tmp_path / "conda-meta").mkdir()  # a conda env that was not activated
    assert python(str(tmp_path), str(tmp_path)).manager == "conda"
    system_python = only(check_python(python("/usr", "/usr")))
    assert system_python.severity == "warning" and "system interpreter" in system_python.message
    assert system_python.fix == (
        "python3.11 -m venv .venv && . .venv/bin/activate  (or: conda create -n train python=3.11)"
    )


# -- the whole diagnosis -----------------------------------------------------------------


def test_diagnose_recorded_gpu_machine_with_a_cpu_wheel():
    notebook = GpuProcess(4242, "python", 56 * GiB)
    probe = RecordedProbe(
        nvidia=nvidia(gpu(0, used=57 * GiB, processes=(notebook,)), gpu(1)),
        torch=TorchFacts(version="2.5.1+cpu"),
        environ={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"},
        pid=1,
    )
    diagnosis = diagnose(probe, TrainingHints())
    assert diagnosis.exit_status == 1
    assert [f.check for f in diagnosis.findings if f.severity == "error"] == ["torch"]
    assert {f.check for f in diagnosis.findings if f.severity == "warning"} == {
        "gpu-memory",
        "device-order",
        "allocator",
    }
    data = json.loads(json.dumps(diagnosis.to_dict()))
    assert data["errors"] == 1 and data["warnings"] == 3 and data["exit_status"] == 1
    assert data["facts"]["nvidia"]["gpus"][0]["processes"][0]["pid"] == 4242


def nvml_present() -> bool:
    return LiveProbe().nvidia().source is not None


@pytest.mark.skipif(nvml_present(), reason="this machine has an NVIDIA driver")
def test_live_diagnosis_on_this_machine_reports_no_gpu_visible():
    diagnosis = diagnose()
    assert diagnosis.exit_status == 0
    torch_finding = only([f for f in diagnosis.findings if f.check == "torch"])
    assert torch_finding.severity == "info" and torch_finding.message.startswith("no GPU visible")
    assert torch.__version__ in torch_finding.message
    assert not torch.cuda.is_initialized()
