"""The ``solattn`` command line: version, help without a command, help texts in plain words,
``--arch`` comma-separated and repeatable in every command that takes it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

import solattn
from solattn.cli import build_parser, main, unique


def _subparsers(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"solattn {solattn.__version__}"


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: solattn")
    for cmd in ("aot", "warmup", "bench"):
        assert cmd in out


def test_console_script_without_arguments():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "solattn.cli"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0 and "usage: solattn" in res.stdout and not res.stderr.strip()


@pytest.mark.parametrize("cmd", [None, "aot", "warmup", "bench"])
def test_help_is_plain_words(cmd):
    parser = build_parser()
    p = parser if cmd is None else _subparsers(parser)[cmd]
    text = p.format_help()
    for markup in ("``", ":mod:", ":func:", ":class:", ":data:"):
        assert markup not in text, f"{cmd or 'solattn'} --help shows reST markup {markup!r}"
    if cmd is not None:
        assert p.description and len(p.description.split()) > 10, f"{cmd} has no description"


@pytest.mark.parametrize("cmd", ["aot", "warmup"])
@pytest.mark.parametrize("argv, expected", [
    (["--arch", "90,80"], [90, 80]),
    (["--arch", "90", "--arch", "80"], [90, 80]),
    (["--arch", "90,80", "--arch", "90", "--arch", "86"], [90, 80, 86]),
])
def test_arch_lists_and_repeats(cmd, argv, expected):
    args = build_parser().parse_args([cmd, *argv])
    assert unique(args.arch) == expected


@pytest.mark.parametrize("cmd", ["aot", "warmup"])
def test_arch_rejects_bad_values(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--arch", "90,x"])
    assert e.value.code == 2
    assert "expected comma-separated integers" in capsys.readouterr().err


def test_warmup_keeps_every_arch():
    """Through the real command: both architectures are listed, each once."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "solattn.cli", "warmup", "--arch", "90,80",
                          "--arch", "90", "--list", "--head-dims", "64", "--dtypes", "fp16",
                          "--no-gqa"], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    heads = [line for line in res.stdout.splitlines() if line.startswith("solattn warmup: sm_")]
    assert [h.split(",")[0] for h in heads] == ["solattn warmup: sm_90", "solattn warmup: sm_80"]
