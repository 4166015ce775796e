"""memfit env export / check: the files, the fingerprint, and what a difference means.

The pip side is this venv's real distributions; conda's answer and other GPUs are recorded
(:class:`memfit.environment.system.RecordedProbe`), since this machine has neither.
"""

from __future__ import annotations

import json
from dataclasses import replace
from importlib import metadata

import pytest
import torch

from memfit.environment.envfile import (
    Difference,
    Distribution,
    Fingerprint,
    GpuFingerprint,
    check_environment,
    compare,
    environment_document,
    export_environment,
    fingerprint,
    installed_distributions,
    load_fingerprint,
    merge_conda_pip,
    requirement_line,
    requirement_lines,
    to_yaml,
    torch_index_url,
)
from memfit.environment.system import GpuInfo, LiveProbe, NvidiaFacts, PythonFacts, RecordedProbe, TorchFacts
from memfit.errors import MemfitError

GiB = 2**30


@pytest.mark.parametrize(
    "version, expected",
    [
        ("2.5.1+cu124", "https://download.pytorch.org/whl/cu124"),
        ("2.13.0+cpu", "https://download.pytorch.org/whl/cpu"),
        ("2.5.1+rocm6.2", "https://download.pytorch.org/whl/rocm6.2"),
        ("2.5.1", None),
        ("1.0+local.build", None),
    ],
)
def test_torch_index_url(version, expected):
    assert torch_index_url(version) == expected


@pytest.mark.parametrize(
    "dist, line",
    [
        (Distribution("numpy", "1.26.4"), "numpy==1.26.4"),
        (Distribution("torch", "2.5.1+cu124"), "torch==2.5.1+cu124"),
        (
            Distribution(
                "tool",
                "0.3",
                direct_url={"url": "https://github.com/o/tool", "vcs_info": {"vcs": "git", "commit_id": "abc123"}},
            ),
            "tool @ git+https://github.com/o/tool@abc123",
        ),
        (
            Distribution("app", "0.1", direct_url={"url": "file:///work/app", "dir_info": {"editable": True}}),
            "# app==0.1 is installed editable from file:///work/app: pip install -e <that checkout>",
        ),
        (
            Distribution("wheel-local", "1.0", direct_url={"url": "file:///tmp/w.whl", "archive_info": {}}),
            "# wheel-local==1.0 is installed from a local file file:///tmp/w.whl",
        ),
        (
            Distribution("remote", "1.0", direct_url={"url": "https://example.org/r-1.0.tar.gz", "archive_info": {}}),
            "remote @ https://example.org/r-1.0.tar.gz",
        ),
    ],
)
def test_requirement_line(dist, line):
    assert requirement_line(dist) == line


def test_requirement_lines_keep_the_torch_cuda_variant_and_its_index():
    dists = [
        Distribution("numpy", "1.26.4"),
        Distribution("torch", "2.5.1+cu124"),
        Distribution("torchvision", "0.20.1+cu124"),
    ]
    assert requirement_lines(dists) == [
        "--extra-index-url https://download.pytorch.org/whl/cu124",
        "numpy==1.26.4",
        "torch==2.5.1+cu124",
        "torchvision==0.20.1+cu124",
    ]


def test_installed_distributions_are_this_venv():
    dists = {d.name.lower(): d for d in installed_distributions()}
    assert dists["torch"].version == metadata.version("torch")
    assert dists["click"].version == metadata.version("click")
    names = [d.name.lower() for d in installed_distributions()]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    "text, scalar",
    [
        ("numpy=1.26.4", "numpy=1.26.4"),
        ("torch==2.5.1+cu124", "torch==2.5.1+cu124"),
        (
            "--extra-index-url https://download.pytorch.org/whl/cu124",
            '"--extra-index-url https://download.pytorch.org/whl/cu124"',
        ),
        ("yes", '"yes"'),
        ("3.11", '"3.11"'),
        ("a: b", '"a: b"'),
    ],
)
def test_yaml_scalars_are_quoted_when_ambiguous(text, scalar):
    assert to_yaml({"k": text}) == f"k: {scalar}\n"


def test_yaml_reads_back_as_written():
    yaml = pytest.importorskip("yaml")
    document = {
        "name": "train",
        "channels": ["conda-forge"],
        "dependencies": ["python=3.11.7", "pip", {"pip": ["--extra-index-url https://x/y", "torch==2.5.1+cu124"]}],
    }
    assert yaml.safe_load(to_yaml(document)) == document


# -- conda (a recorded `conda env export --no-builds --json`) ----------------------------

CONDA_EXPORT = {
    "name": "train",
    "channels": ["conda-forge", "nodefaults"],
    "dependencies": [
        "_libgcc_mutex=0.1",
        "numpy=1.26.4",
        "python=3.11.7",
        "pip=24.0",
        {"pip": ["torch==2.5.1", "tqdm==4.66.4", "old-thing==0.1"]},
    ],
    "prefix": "/opt/conda/envs/train",
}


def test_merge_conda_pip_keeps_conda_packages_and_exact_pip_ones():
    dists = [
        Distribution("numpy", "1.26.4", installer="conda"),
        Distribution("torch", "2.5.1+cu124"),
        Distribution("tqdm", "4.66.4"),
    ]
    document = merge_conda_pip(CONDA_EXPORT, dists)
    assert document == {
        "name": "train",
        "channels": ["conda-forge", "nodefaults"],
        "dependencies": [
            "_libgcc_mutex=0.1",
            "numpy=1.26.4",
            "python=3.11.7",
            "pip=24.0",
            {
                "pip": [
                    "--extra-index-url https://download.pytorch.org/whl/cu124",
                    "torch==2.5.1+cu124",
                    "tqdm==4.66.4",
                    "old-thing==0.1",
                ]
            },
        ],
    }


def conda_probe(**nvidia: object) -> RecordedProbe:
    python = PythonFacts(
        "3.11.7",
        "CPython",
        "/opt/conda/envs/train/bin/python",
        "/opt/conda/envs/train",
        "/opt/conda/envs/train",
        "/opt/conda/envs/train",
        "train",
    )
    return RecordedProbe(
        python=python, conda=CONDA_EXPORT, torch=TorchFacts(version="2.5.1+cu124", cuda="12.4", cudnn=90100), **nvidia
    )


def test_export_under_conda_holds_conda_and_pip_packages(tmp_path):
    exported = export_environment(tmp_path, conda_probe())
    assert exported.conda is True
    text = (tmp_path / "environment.yml").read_text()
    assert "name: train\n" in text and "  - numpy=1.26.4\n" in text and "  - _libgcc_mutex=0.1\n" in text
    assert f"      - click=={metadata.version('click')}\n" in text  # a real pip package of this venv
    assert "      - old-thing==0.1\n" in text  # a pip package only conda knew about
    assert "prefix" not in text
    yaml = pytest.importorskip("yaml")
    pip = next(dep for dep in yaml.safe_load(text)["dependencies"] if isinstance(dep, dict))["pip"]
    assert f"torch=={torch.__version__}" in pip


def test_export_without_conda_writes_python_and_a_pip_section(tmp_path):
    exported = export_environment(tmp_path, RecordedProbe(torch=TorchFacts(version=torch.__version__)))
    assert exported.conda is False and [p.name for p in exported.paths] == [
        "environment.yml",
        "requirements.lock.txt",
        "environment.json",
    ]
    yml = (tmp_path / "environment.yml").read_text()
    assert f"  - python={exported.fingerprint.python}\n  - pip\n  - pip:\n" in yml
    lock = (tmp_path / "requirements.lock.txt").read_text().splitlines()
    assert f"torch=={torch.__version__}" in lock
    index = torch_index_url(torch.__version__)
    if index:
        assert f"--extra-index-url {index}" in lock
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "environment.json",
        "environment.yml",
        "requirements.lock.txt",
    ]


def test_export_into_a_file_is_a_user_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(MemfitError, match="it is a file, not a folder"):
        export_environment(tmp_path / "f", RecordedProbe())


# -- fingerprint and compare -------------------------------------------------------------

A100 = GpuInfo(0, "NVIDIA A100-SXM4-80GB", "GPU-1", "00000000:07:00.0", 80 * GiB, GiB, 79 * GiB, (8, 0))
H100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", "GPU-2", "00000000:19:00.0", 80 * GiB, GiB, 79 * GiB, (9, 0))


def test_fingerprint_of_a_recorded_gpu_machine():
    probe = conda_probe(nvidia=NvidiaFacts("nvml", "550.54.14", (12, 4), (A100,)))
    print_ = fingerprint(probe)
    assert (print_.torch, print_.torch_cuda, print_.cudnn, print_.driver, print_.cuda_driver) == (
        "2.5.1+cu124",
        "12.4",
        "9.1.0",
        "550.54.14",
        "12.4",
    )
    assert print_.gpus == (GpuFingerprint("NVIDIA A100-SXM4-80GB", 80 * GiB, "8.0"),)
    assert Fingerprint.from_dict(json.loads(json.dumps(print_.to_dict()))) == print_
    assert "cudnn" not in Fingerprint(python="3.11.7", os="Linux x86_64").to_dict(omit_missing=True)


BASE = Fingerprint(
    python="3.11.7",
    os="Linux x86_64",
    os_release="6.8.0",
    torch="2.5.1+cu124",
    torch_cuda="12.4",
    cudnn="9.1.0",
    driver="550.54.14",
    cuda_driver="12.4",
    gpus=(GpuFingerprint("NVIDIA A100-SXM4-80GB", 80 * GiB, "8.0"),),
)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({}, []),
        (
            {"torch": "2.6.0+cu124"},
            [
                Difference(
                    "torch",
                    "2.5.1+cu124",
                    "2.6.0+cu124",
                    True,
                    "another build runs other kernels and allocates differently",
                )
            ],
        ),
        (
            {"torch_cuda": "12.1"},
            [
                Difference(
                    "torch_cuda", "12.4", "12.1", True, "another build runs other kernels and allocates differently"
                )
            ],
        ),
        (
            {"driver": "535.104.05"},
            [Difference("driver", "550.54.14", "535.104.05", True, "older: it may not run the recorded CUDA")],
        ),
        (
            {"driver": "560.35.03"},
            [Difference("driver", "550.54.14", "560.35.03", False, "newer: runs what the old one ran")],
        ),
        (
            {"python": "3.11.9", "os_release": "6.9.1"},
            [Difference("python", "3.11.7", "3.11.9", False), Difference("os_release", "6.8.0", "6.9.1", False)],
        ),
        (
            {"gpus": (GpuFingerprint("NVIDIA H100 80GB HBM3", 80 * GiB, "9.0"),)},
            [
                Difference("gpus[0].name", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", True, "another GPU model"),
                Difference("gpus[0].capability", "8.0", "9.0", True, "another GPU model"),
            ],
        ),
        ({"gpus": ()}, [Difference("gpus", 1, 0, True, "number of GPUs")]),
    ],
)
def test_compare(changes, expected):
    assert compare(BASE, replace(BASE, **changes)) == expected


def test_export_then_check_in_the_same_environment_finds_no_difference(tmp_path):
    probe = LiveProbe()  # the live machine; torch's facts from one child process
    export_environment(tmp_path, probe)
    assert check_environment(tmp_path / "environment.json", probe).differences == []


def test_changed_torch_or_gpu_model_in_the_file_is_reported(tmp_path):
    here = conda_probe(nvidia=NvidiaFacts("nvml", "550.54.14", (12, 4), (H100,)))
    export_environment(tmp_path, here)
    path = tmp_path / "environment.json"
    data = json.loads(path.read_text())
    data["torch"], data["gpus"][0]["name"] = "2.4.0+cu121", "NVIDIA A100-SXM4-80GB"
    path.write_text(json.dumps(data))
    result = check_environment(path, here)
    assert result.matters and result.exit_status == 1 and result.source == str(path)
    assert [(d.field, d.old, d.new, d.matters) for d in result.differences] == [
        ("torch", "2.4.0+cu121", "2.5.1+cu124", True),
        ("gpus[0].name", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", True),
    ]


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "is not valid JSON (line 1, column 2); expected a file written by memfit env export"),
        ("", "is not valid JSON (line 1, column 1)"),
        (
            '{"name": "train", "dependencies": []}',
            'is not a memfit environment fingerprint (no "schema": "memfit.environment")',
        ),
        ("[1, 2]", "is not a memfit environment fingerprint"),
        (
            '{"schema": "memfit.environment", "schema_version": 9, "python": "3.11", "os": "Linux"}',
            "has schema_version 9; this memfit reads up to 1: upgrade memfit",
        ),
        (
            '{"schema": "memfit.environment", "schema_version": 1, "os": "Linux"}',
            "is a damaged memfit fingerprint: python is missing",
        ),
    ],
)
def test_corrupt_or_foreign_file_is_a_one_line_user_error(tmp_path, content, message):
    path = tmp_path / "environment.json"
    path.write_text(content)
    with pytest.raises(MemfitError) as raised:
        load_fingerprint(path)
    assert str(raised.value) == f"{path} {message}" or str(raised.value).startswith(f"{path} {message}")
    assert "\n" not in str(raised.value)


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(MemfitError, match=r"cannot read .*nope\.json: No such file or directory"):
        load_fingerprint(tmp_path / "nope.json")


def test_environment_document_without_conda_leaves_pip_tools_out():
    dists = [Distribution("pip", "24.0"), Distribution("setuptools", "70.0"), Distribution("rich", "13.7.1")]
    assert environment_document("train", "3.11.7", dists) == {
        "name": "train",
        "dependencies": ["python=3.11.7", "pip", {"pip": ["rich==13.7.1"]}],
    }
