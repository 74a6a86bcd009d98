"""`cag bench` reports record a command line that `cag bench` itself accepts and that reruns the same run."""

import shlex

import pytest
from typer.testing import CliRunner

import eval.bench_ttft as bench_ttft
from cag.cli import app

ARGV = ["--source", "smollm2-135m", "--repeats", "2", "--out", "out-dir", "--targets", "qwen2.5-0.5b", "gemma3-270m",
        "--lengths", "1024", "4096", "--methods", "bottleneck", "mot", "--crux", "0.5", "--crux-select",
        "source_retriever", "--crux-ratio", "0.15", "0.2", "--stored", "--served"]


@pytest.mark.parametrize("argv", [ARGV, ARGV[:6] + ["--targets", "qwen2.5-0.5b", "--lengths", "4096",
                                                    "--methods", "auto", "--crux", "0.4"]])
def test_the_recorded_command_reruns_the_same_bench(argv, monkeypatch):
    args = bench_ttft.parse_args(argv)
    command = bench_ttft.cag_bench_command(args)
    assert command.startswith("cag bench ")
    seen = {}
    monkeypatch.setattr(bench_ttft, "main", lambda a: seen.setdefault("argv", a) and 0)
    result = CliRunner().invoke(app, shlex.split(command)[1:])
    assert result.exit_code == 0, result.output
    assert vars(bench_ttft.parse_args(seen["argv"])) == vars(args)
