"""deltatrain.parse_version: the spellings drivers, runtimes and libraries use, and garbage as ValueError."""

import pathlib
import random
import re
from importlib import metadata

import pytest

import deltatrain as dt


@pytest.mark.parametrize(
    "text, release, prerelease, local",
    [
        ("12.8", (12, 8, 0), "", ""),
        ("12.8rc1", (12, 8, 0), "rc1", ""),
        ("2.8a0", (2, 8, 0), "a0", ""),
        ("2.9.0+cu128", (2, 9, 0), "", "cu128"),
        ("13.0.88", (13, 0, 88), "", ""),
        ("2.8.0a0+gitabc123", (2, 8, 0), "a0", "gitabc123"),
        ("v1.2", (1, 2, 0), "", ""),
    ],
)
def test_spellings(text, release, prerelease, local):
    version = dt.parse_version(text)
    assert version.release == release
    assert (version.major, version.minor, version.patch) == release
    assert version.prerelease == prerelease
    assert version.local == local


def test_comparisons_use_release_numbers():
    # A release candidate of 12.8 satisfies "needs 12.8"; 12.10 is newer than 12.9 (not a string compare).
    assert dt.parse_version("12.8rc1") >= dt.parse_version("12.8")
    assert dt.parse_version("12.10") > dt.parse_version("12.9")
    assert dt.parse_version("2.9.0+cu128") == dt.parse_version("2.9")
    major, minor = random.randrange(100), random.randrange(100)
    assert dt.parse_version(f"{major}.{minor}").release == (major, minor, 0)
    assert dt.parse_version(f"{major}.{minor}") < dt.parse_version(f"{major}.{minor + 1}")


@pytest.mark.parametrize("garbage", ["", "abc", "1..2", "1.2.x", "+cu1"])
def test_garbage_is_a_value_error_quoting_the_text(garbage):
    with pytest.raises(ValueError) as error:
        dt.parse_version(garbage, "torch version")
    assert "torch version" in str(error.value)
    assert f"'{garbage}'" in str(error.value)


def test_version_is_the_one_cmakelists_declares():
    """CMakeLists.txt declares the version; the package, its native module and its metadata report it."""
    root = pathlib.Path(__file__).resolve().parents[2]
    declared = re.search(r"project\(deltatrain VERSION (\S+)", (root / "CMakeLists.txt").read_text()).group(1)
    assert not re.search(r"^version\s*=", (root / "pyproject.toml").read_text(), re.M), "pyproject.toml declares one too"
    assert dt.__version__ == declared
    assert dt._deltatrain.__version__ == declared
    assert metadata.version("deltatrain") == declared
