"""Progress on stderr (cag.progress), and what `cag eval` / `cag bench` say about the host.

The reporter is tested with a fake clock; the commands on a tiny model saved to
a folder, through typer's runner, whose stderr is not a terminal: plain lines.
"""

from __future__ import annotations

import io
import json
import re
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from cag.cli import app
from cag.progress import Progress, build_progress, fit_progress, format_duration
from tests.stores.test_build import doc
from tests.tiny import tiny_model


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


# ------------------------------------------------------------------ the reporter


def test_plain_lines_say_count_note_elapsed_and_time_left():
    clock, stream = Clock(), io.StringIO()
    with Progress("cag eval", total=50, unit="questions", stream=stream, clock=clock) as bar:
        clock.now = 92.0
        bar.advance(12, note="synthetic-kb, qwen2.5-0.5b")
    out = lines(stream)
    assert out[0] == "cag eval: 0/50 questions, 0s elapsed"
    # 12 done in 92 s: 38 more take about 291 s
    assert out[1] == "cag eval: 12/50 questions, synthetic-kb, qwen2.5-0.5b, 1m32s elapsed, ~5m left"
    assert len(out) == 2  # nothing new at close: the last state was already written


def test_rate_limit_holds_and_the_last_line_is_always_written():
    clock, stream = Clock(), io.StringIO()
    with Progress("job", total=1000, unit="steps", stream=stream, clock=clock, interval_s=2.0) as bar:
        for i in range(1, 501):  # 500 steps in 5 s: at most one line every 2 s
            clock.now = i * 0.01
            bar.advance()
    out = lines(stream)
    counts = [int(re.match(r"job: (\d+)/1000", line).group(1)) for line in out]
    assert counts == [0, 200, 400, 500]  # start, t=2 s, t=4 s, and the last at close
    assert out[-1].startswith("job: 500/1000 steps, 5s elapsed")


def test_reaching_the_total_writes_at_once_and_unknown_totals_give_no_estimate():
    clock, stream = Clock(), io.StringIO()
    with Progress("job", total=3, stream=stream, clock=clock) as bar:
        bar.advance()
        bar.advance()  # held back by the rate limit
        assert len(lines(stream)) == 1
        bar.advance()  # the total: written whatever the rate limit says
        assert lines(stream)[-1] == "job: 3/3, 0s elapsed"
    stream = io.StringIO()
    with Progress("build", unit="chunks", stream=stream, clock=clock) as bar:
        clock.now += 10
        bar.advance(7, note="2,000 tokens")
    assert lines(stream)[-1] == "build: 7 chunks, 2,000 tokens, 10s elapsed"


def test_resumed_count_estimates_from_this_runs_work_only():
    clock, stream = Clock(), io.StringIO()
    with Progress("job", total=100, completed=90, stream=stream, clock=clock) as bar:
        clock.now = 10.0
        bar.advance(5)  # 5 in 10 s here; the 90 of an earlier run say nothing of this host
    assert lines(stream)[-1] == "job: 95/100, 10s elapsed, ~10s left"


def test_log_lines_are_never_rate_limited():
    stream = io.StringIO()
    with Progress("cag bench", total=2, stream=stream, clock=Clock()) as bar:
        bar.log("qwen: prefill 100 tokens/s")
        bar.log("qwen: floor 0.1 s")
    assert lines(stream)[1:] == ["cag bench: qwen: prefill 100 tokens/s", "cag bench: qwen: floor 0.1 s"]


def test_a_terminal_gets_a_rich_bar_on_that_stream_not_lines_and_not_stdout(capsys):
    stream = TTY()
    with Progress("cag eval", total=4, unit="questions", stream=stream) as bar:
        assert bar.rich
        bar.advance(2, note="toy [not markup]")
        bar.log("a message")
    text = stream.getvalue()
    assert "cag eval" in text and "a message" in text and "2/4" in text and "[not markup]" in text
    assert "elapsed" not in text  # the plain-line format is not used on a terminal
    assert capsys.readouterr().out == ""


def test_format_duration():
    assert [format_duration(s) for s in (0, 45.4, 92, 3599, 7500)] == ["0s", "45s", "1m32s", "59m59s", "2h05m"]


def test_build_and_fit_progress_off_a_terminal_turn_events_into_lines():
    stream = io.StringIO()
    with build_progress("cag build", stream=stream) as kw:
        assert kw["progress"] is False
        kw["on_event"](SimpleNamespace(kind="planned", chunks_stored=0, tokens_prefilled=0))
        kw["on_event"](SimpleNamespace(kind="chunk_stored", chunks_stored=1, tokens_prefilled=250))
        kw["on_event"](SimpleNamespace(kind="chunk_stored", chunks_stored=2, tokens_prefilled=500))
    assert lines(stream)[-1].startswith("cag build: 2 chunks prefilled, 500 tokens prefilled, ")
    with build_progress("cag build", stream=TTY()) as kw:
        assert kw == {"progress": True}  # the build's own bars, which know the totals

    stream = io.StringIO()
    with fit_progress("cag fit", stream=stream) as kw:
        assert kw["progress"] is False
        for batch in range(5):
            kw["on_batch"](batch)
        for step in range(1, 4):
            kw["on_step"](step)
    out = lines(stream)
    # the last statistics count is written when training starts, despite the rate limit
    assert any(line.startswith("cag fit: 5 statistics batches") for line in out)
    assert out[-1].startswith("cag fit: 3 training steps")


# ------------------------------------------------------------------ the commands

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    model, tok = tiny_model("qwen2")
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root / "model"


def test_cag_eval_json_keeps_stdout_to_json_and_progress_on_stderr(tiny_folder, tmp_path):
    qa = tmp_path / "qa.jsonl"
    docs = [{"id": f"d{i}", "text": doc(i)} for i in range(2)]
    with open(qa, "w") as f:
        for i in range(3):
            f.write(json.dumps({"id": f"q{i}", "question": f"What is kept in the tower, item {i}?",
                                "answers": ["maps"], "documents": docs, "meta": {"dataset": "toy"}}) + "\n")
    model = str(tiny_folder)
    result = runner.invoke(app, ["eval", "--qa", str(qa), "--source", model, "--targets", model,
                                 "--methods", "identity", "--top-k", "1", "--out", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)  # the whole of stdout is one JSON document
    stderr = result.stderr.splitlines()
    assert "cag eval: 0/3 questions, 0s elapsed" in stderr
    assert any(re.match(r"cag eval: 3/3 questions, toy, .+ elapsed$", line) for line in stderr)
    assert any(line.startswith("cag eval: store: ") and "chunks prefilled" in line for line in stderr)
    host, prefill = summary["run"]["host"], summary["run"]["prefill"][model]
    assert host["cpu"] and host["cores"] >= 1 and host["torch_threads"] >= 1
    assert prefill["prefill_tok_s"] > 0 and prefill["prefill_tokens"] == 1024
    assert all(e["prefill_tok_s"] == prefill["prefill_tok_s"] for e in summary["table"])
    table = (tmp_path / "out" / "results.md").read_text()
    assert f"Host: {host['cpu']}" in table and "target prefill tok/s" in table


def test_cag_eval_takes_a_token_budget_and_refuses_to_resume_with_another(tiny_folder, tmp_path):
    qa = tmp_path / "qa.jsonl"
    docs = [{"id": "d0", "text": doc(0)}]
    qa.write_text(json.dumps({"id": "q0", "question": "What is kept in the tower?", "answers": ["maps"],
                              "documents": docs, "meta": {"dataset": "toy"}}) + "\n")
    model = str(tiny_folder)
    args = ["eval", "--qa", str(qa), "--source", model, "--targets", model, "--methods", "identity",
            "--top-k", "1", "--out", str(tmp_path / "out"), "--json"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["run"]["max_new_tokens"] == 3
    again = runner.invoke(app, [*args, "--max-new-tokens", "5"])
    assert again.exit_code == 1 and "Traceback" not in again.stderr  # a clear error, not a crash
    assert "max_new_tokens = 3" in again.stderr and "asks 5" in again.stderr


def test_cag_bench_rows_carry_floor_host_and_prefill_rate(tiny_folder, tmp_path):
    model = str(tiny_folder)
    out = tmp_path / "bench"
    result = runner.invoke(app, ["bench", "--source", model, "--targets", model, "--lengths", "48",
                                 "--lengths", "96", "--repeats", "3", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    stderr = result.stderr.splitlines()
    assert "cag bench: 0/8 rounds, 0s elapsed" in stderr
    assert any(line.startswith("cag bench: 8/8 rounds") for line in stderr)
    assert any("over the floor" in line for line in stderr)
    rows = report["rows"]
    assert {(r["length"], r["condition"]) for r in rows} == {(n, c) for n in (48, 96)
                                                              for c in ("direct", "native_cache")}
    rate = report["run"]["prefill"][model]["prefill_tok_s"]
    for r in rows:
        assert r["cpu"] == report["run"]["host"]["cpu"] != ""
        assert r["prefill_tok_s"] == rate > 0
        assert len(r["floor_all_s"]) == 3 and r["floor_s"] > 0
        # every path searches the index and places or prefills the context before
        # the question: none gets under the floor
        assert r["ttft_median_s"] > r["floor_s"]
        assert r["overhead_s"] == pytest.approx(r["ttft_median_s"] - r["floor_s"])
        assert r["floor_ratio"] == pytest.approx(r["ttft_median_s"] / r["floor_s"])
    # one floor per (target, length), shared by its rows
    for n in (48, 96):
        assert len({r["floor_s"] for r in rows if r["length"] == n}) == 1
    md = (out / "ttft.md").read_text()
    assert "| floor s | over floor s | × floor | target prefill tok/s |" in md
    assert f"Host: {report['run']['host']['cpu']}" in md
