"""Fixed costs by version: CUDA context tables, module loading, cuBLAS and cuDNN settings, the
CUDA version of an estimate (given, installed torch, lock, default)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.cli import main
from memfit.cuda import context
from memfit.cuda.context import (
    CONTEXT_FIGURES,
    DEFAULT_CUDA_VERSION,
    cublas_workspace,
    cublas_workspace_in_allocator,
    cuda_context,
    fixed_costs,
    module_loading,
    parse_cublas_workspace_config,
    parse_cuda_version,
    resolve_cuda_version,
)
from memfit.cuda.cudnn import conv_workspace_cap, rnn_reserve_bytes
from memfit.environment.envfile import Fingerprint
from memfit.errors import MemfitError
from memfit.run.settings import Settings
from memfit.search.lock import Lock, write_lock
from memfit.units import KiB, MiB

TINY = "mlp:layers=1,width=32,features=32"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12.4", (12, 4)),
        ("12.4.131", (12, 4)),
        ("11", (11, 0)),
        ("cu118", (11, 8)),
        ("cu124", (12, 4)),
        (" 13.0 ", (13, 0)),
    ],
)
def test_cuda_versions_parse_from_the_forms_people_write(text: str, expected: tuple[int, int]) -> None:
    assert parse_cuda_version(text) == expected


@pytest.mark.parametrize("text", ["", "twelve", "12.x", "cuda12", "1.2", "12.4.1.7", "cu1"])
def test_bad_cuda_versions_are_refused(text: str) -> None:
    with pytest.raises(MemfitError, match="invalid CUDA version"):
        parse_cuda_version(text)


def test_cuda_version_comes_from_the_user_then_torch_then_the_lock_then_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(context, "installed_cuda_version", lambda: None)
    assert resolve_cuda_version("11.8", locked="12.1") == ((11, 8), "given")
    assert resolve_cuda_version(None, locked="12.1") == ((12, 1), "memfit.lock")
    assert resolve_cuda_version(None) == (DEFAULT_CUDA_VERSION, "default")
    monkeypatch.setattr(context, "installed_cuda_version", lambda: (12, 6))
    assert resolve_cuda_version(None, locked="12.1") == ((12, 6), "installed torch")


@pytest.mark.parametrize(
    ("cuda", "setting", "expected"),
    [
        ((11, 2), None, "eager"),  # no lazy loading before CUDA 11.7
        ((11, 2), "LAZY", "eager"),
        ((11, 8), None, "lazy"),  # PyTorch sets LAZY when unset (#86509)
        ((11, 8), "DEFAULT", "eager"),  # CUDA's own default is eager before 12.2
        ((12, 2), "DEFAULT", "lazy"),
        ((12, 4), "eager", "eager"),
        ((12, 4), "LAZY", "lazy"),
    ],
)
def test_module_loading_follows_cuda_and_the_variable(
    cuda: tuple[int, int], setting: str | None, expected: str
) -> None:
    assert module_loading(cuda, setting) == expected


def test_an_unknown_module_loading_value_is_refused() -> None:
    with pytest.raises(MemfitError, match="CUDA_MODULE_LOADING"):
        module_loading((12, 4), "SOMETIMES")


@pytest.mark.parametrize(
    ("cuda", "loading", "family", "mib"),
    [
        ((11, 2), "eager", "volta", 1341),  # transformers docs, V100, CUDA 11.2
        ((11, 1), "eager", "ampere", 999),  # pytorch#54564, RTX 3090
        ((11, 4), "eager", "hopper", 1341),  # no Hopper figure: the generic one
        ((10, 1), "eager", "volta", 1005.25),  # pytorch#28394, Titan V
        ((11, 7), "eager", "ampere", 615.75),  # pytorch#86509, DEFAULT loading
        ((11, 7), "lazy", None, 253.75),  # pytorch#86509, LAZY
        ((12, 4), "lazy", "ampere", 400),
        ((12, 4), "lazy", "volta", 300),
        ((13, 0), "lazy", "hopper", 500),
    ],
)
def test_context_figures_by_version_loading_and_family(
    cuda: tuple[int, int], loading: context.ModuleLoading, family: str | None, mib: float
) -> None:
    figure = cuda_context(cuda, loading, family)
    assert figure.bytes == int(mib * MiB)
    assert figure.source  # every figure names where it comes from


def test_lazy_loading_makes_the_context_smaller_on_every_family() -> None:
    for family in ("volta", "turing", "ampere", "ada", "hopper"):
        assert cuda_context((12, 4), "lazy", family).bytes < cuda_context((12, 4), "eager", family).bytes


def test_a_version_without_any_figure_is_refused() -> None:
    with pytest.raises(MemfitError, match="no published CUDA context figure"):
        cuda_context((9, 2), "eager", "volta")


def test_every_context_figure_has_a_source_and_a_plausible_size() -> None:
    for figure in CONTEXT_FIGURES:
        assert 100 * MiB <= figure.bytes <= 2048 * MiB and len(figure.source) > 20


@pytest.mark.parametrize(
    ("config", "expected"),
    [(":4096:8", 32 * MiB), (":4096:2:16:8", 8320 * KiB), (":16:8", 128 * KiB), (":0:0", 0), (":1024:1", MiB)],
)
def test_cublas_workspace_config_is_summed_like_pytorch(config: str, expected: int) -> None:
    assert parse_cublas_workspace_config(config) == expected
    assert cublas_workspace(8, config) == expected


def test_an_unparsable_cublas_config_falls_back_to_the_default_as_pytorch_does() -> None:
    assert parse_cublas_workspace_config("4096,8") is None
    assert cublas_workspace(8, "4096,8") == 8320 * KiB and cublas_workspace(9, "junk") == 32 * MiB


def test_cublas_workspace_enters_the_allocator_with_torch_2() -> None:
    assert not cublas_workspace_in_allocator("1.13.1+cu117")
    assert cublas_workspace_in_allocator("2.0.0") and cublas_workspace_in_allocator("2.9.1+cu128")


def test_fixed_costs_read_the_users_settings() -> None:
    default = fixed_costs("ampere", 8, (12, 4), env={})
    assert default == {"cuda context": 400 * MiB, "cublas workspace": 2 * 8320 * KiB, "cudnn workspace": 0}
    custom = fixed_costs(
        "ampere",
        8,
        (12, 4),
        env={"CUDA_MODULE_LOADING": "EAGER", "CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUDNN_CONV_WSCAP_DBG": "256"},
    )
    assert custom == {
        "cuda context": int(615.75 * MiB),
        "cublas workspace": 2 * 128 * KiB,
        "cudnn workspace": 256 * MiB,
    }


def test_cudnn_workspace_cap_parses_mib_and_refuses_junk() -> None:
    assert (
        conv_workspace_cap("1024") == 1024 * MiB
        and conv_workspace_cap(None) is None
        and conv_workspace_cap(" ") is None
    )
    with pytest.raises(MemfitError, match="CUDNN_CONV_WSCAP_DBG"):
        conv_workspace_cap("1GiB")


def test_rnn_reserve_space_by_hand() -> None:
    # MIOpen's formula: 2 * scale * layers * steps * hidden elements (LSTM: halved, plus
    # one hidden state per step); H=100, 3 layers, 10 steps of 4 sequences, fp32.
    steps_hidden = 10 * 4 * 100
    assert rnn_reserve_bytes("GRU", hidden_size=100, num_layers=3, seq_len=10, batch=4, dtype_bytes=4) == (
        2 * 4 * 3 * steps_hidden * 4
    )
    lstm = rnn_reserve_bytes("LSTM", hidden_size=100, num_layers=3, seq_len=10, batch=4, dtype_bytes=4)
    assert lstm == 6 * 3 * steps_hidden * 4 + 3 * steps_hidden * 4
    assert rnn_reserve_bytes("RNN_TANH", hidden_size=100, num_layers=1, seq_len=10, batch=4, dtype_bytes=2) == (
        2 * steps_hidden * 2
    )
    both = rnn_reserve_bytes(
        "LSTM", hidden_size=100, num_layers=3, seq_len=10, batch=4, dtype_bytes=4, bidirectional=True, dropout=0.5
    )
    assert both == 2 * (lstm + 2 * steps_hidden * 5)
    with pytest.raises(MemfitError, match="unknown RNN mode"):
        rnn_reserve_bytes("QRNN", hidden_size=1, num_layers=1, seq_len=1, batch=1, dtype_bytes=4)  # type: ignore[arg-type]


def _estimate_json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, object]:
    assert main(["estimate", TINY, "--batch-size", "2", "--gpu", "V100 SXM2 16GB", "--json", *extra]) == 0
    data: dict[str, object] = json.loads(capsys.readouterr().out)
    return data


def test_cli_cuda_version_changes_the_context(capsys: pytest.CaptureFixture[str]) -> None:
    old = _estimate_json(capsys, "--cuda-version", "11.2")
    assert old["cuda_version"] == "11.2"
    breakdown = old["breakdown"]
    assert isinstance(breakdown, dict) and breakdown["cuda context"] == 1341 * MiB


def test_cli_bad_cuda_version_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", TINY, "--gpu", "T4", "--cuda-version", "twelve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memfit: error: invalid CUDA version") and err.count("\n") == 1


def test_cli_takes_the_locks_cuda_when_torch_here_has_none(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(context, "installed_cuda_version", lambda: None)
    monkeypatch.chdir(tmp_path)
    assert _estimate_json(capsys)["cuda_version"] == "{}.{}".format(*DEFAULT_CUDA_VERSION)
    fingerprint = Fingerprint(python="3.11.7", os="Linux x86_64", torch="1.10.1+cu111", torch_cuda="11.1")
    write_lock(
        Lock(workload=TINY, settings=Settings(micro_batch_size=2), target_batch_size=2, environment=fingerprint),
        tmp_path / "memfit.lock",
    )
    data = _estimate_json(capsys)
    breakdown = data["breakdown"]
    assert data["cuda_version"] == "11.1" and isinstance(breakdown, dict) and breakdown["cuda context"] == 1341 * MiB
