"""The `deltatrain` console script without the C++ command line: --help names every subcommand that
tools/main.cpp registers (read from the C++ sources, so a new subcommand there fails this until the list
agrees), and a subcommand says that it needs the C++ build. Loaded from its file: it needs no native module."""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"


def load_cli(monkeypatch):
    path = ROOT / "python" / "deltatrain" / "cli.py"
    spec = importlib.util.spec_from_file_location("deltatrain_cli_under_test", path)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    # Never exec a C++ command line that a build installed beside it, and no version from the native module.
    monkeypatch.setattr(cli, "_NATIVE_CLI", pathlib.Path("/nonexistent/deltatrain"))
    monkeypatch.setattr(cli, "_version", lambda: "0.0.0-test")
    return cli


def registered_subcommands():
    """The top-level subcommands of tools/main.cpp: its own app.add_subcommand("...") calls, and the first
    add_subcommand("...") on the parameter of each add_*_command(app) it calls (defined in tools/*.cpp)."""
    main = (TOOLS / "main.cpp").read_text()
    body = main[main.index("int main("):]
    names = set(re.findall(r'\bapp\.add_subcommand\(\s*"([\w-]+)"', body))
    called = re.findall(r"\badd_(\w+)_command\(\s*app\s*\)", body)
    assert called, "tools/main.cpp: no add_*_command(app) call found (the parser here needs updating)"
    sources = "\n".join(p.read_text() for p in sorted(TOOLS.glob("*.cpp")))
    for function in called:
        definition = re.search(rf"void add_{function}_command\(CLI::App&\s*(\w+)\)\s*\{{(.*?)\n\}}", sources, re.S)
        assert definition, f"add_{function}_command's definition not found in tools/*.cpp"
        parameter, function_body = definition.groups()
        name = re.search(rf'\b{parameter}\.add_subcommand\(\s*"([\w-]+)"', function_body)
        assert name, f"add_{function}_command adds no subcommand to {parameter}"
        names.add(name.group(1))
    return names


@pytest.mark.skipif(not (TOOLS / "main.cpp").is_file(), reason="no C++ sources beside this test (an installed copy)")
def test_help_lists_the_cpp_command_lines_subcommands(monkeypatch, capsys):
    cli = load_cli(monkeypatch)
    expected = registered_subcommands()
    assert {"info", "train", "rl"} <= expected  # the parser found the registrations at all
    assert set(cli._SUBCOMMANDS.split(", ")) == expected
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in expected:
        assert re.search(rf"\b{name}\b", out), f"--help does not mention '{name}'"


def test_a_subcommand_says_it_needs_the_cpp_build(monkeypatch, capsys):
    cli = load_cli(monkeypatch)
    for name in cli._SUBCOMMANDS.split(", "):
        assert cli.main([name, "--help"]) == 2
        err = capsys.readouterr().err
        assert f"'{name}' needs the C++ command line" in err and "make build" in err
