import pytest

from memfit.errors import MemfitError
from memfit.units import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 2**30),
        ("8GB", 8 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1024", 1024),
        ("1.5GiB", 3 * 2**29),
        ("16 gb", 16 * 10**9),
        ("3kib", 3 * 1024),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "8GiG", "GiB", "-1", "0", "abc", "1e9", 0, -5, True])
def test_parse_size_rejects(text):
    with pytest.raises(MemfitError):
        parse_size(text)


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (2048, "2.00 KiB"),
        (3 * 2**20, "3.00 MiB"),
        (8 * 2**30, "8.00 GiB"),
        (-(2**20), "-1.00 MiB"),
    ],
)
def test_format_size(nbytes, expected):
    assert format_size(nbytes) == expected
