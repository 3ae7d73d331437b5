"""``python -m workbench serve --requests FILE``: continuous against static batching on
the modeled clock, the latency table on stdout; bad input is one clear line, exit 2."""
import json

import pytest

from workbench.cli import main
from workbench.serve.batching import StepPricer, continuous, static
from workbench.serve.requests import latency_table, poisson_trace

# arriving faster than tiny serves them (steps of ~20 us): the schedules differ; each
# request fits tiny's 64-token context (prompt + output <= 64)
TRACE = poisson_trace(12, rate=1e6, prompt=(8, 40), output=(4, 24), seed=1)


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rows_of(trace):
    return [{"arrival": r.arrival, "prompt": r.prompt, "output": r.output} for r in trace]


def test_requests_prints_the_latency_table_of_both_schedules(tmp_path, capsys):
    f = write(tmp_path / "t.jsonl", rows_of(TRACE))
    rc = main(["serve", "--preset", "tiny", "--profile", "h100", "--requests", f,
               "--max-batch", "4", "--token-budget", "64"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    pricer = StepPricer("tiny", "h100")
    want = latency_table([continuous(TRACE, pricer, 4, 64), static(TRACE, pricer, 4)])
    assert cap.out == f"12 requests, tiny on h100\n{want}\n"
    cont, stat = cap.out.splitlines()[2:]
    assert cont.startswith("continuous") and stat.startswith("static")
    assert cont.split()[1:] != stat.split()[1:]
    assert cap.err == ""                 # stderr is no terminal here: no progress bar


def test_the_progress_bar_goes_to_a_terminals_stderr_only(tmp_path, capsys, monkeypatch):
    f = write(tmp_path / "t.jsonl", rows_of(TRACE))
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert main(["serve", "--requests", f]) == 0
    cap = capsys.readouterr()
    assert "schedule 2/2 [########################] done" in cap.err
    assert "#" not in cap.out and "static" in cap.out


def test_the_file_format_is_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert '"arrival": seconds, "prompt": tokens, "output": tokens' in out


@pytest.mark.parametrize("content, message", [
    (None, "--requests {f}: no such file"),
    ('{"arrival": 0, "prompt": 5, "output": 3}\n{"arrival": 1, "prompt": 5}\n', "{f}:2:"),
    ('{"arrival": 0, "prompt": 5, "output": 3}\n\nnot json\n', "{f}:3:"),
    ('{"arrival": -1, "prompt": 5, "output": 3}\n', "{f}:1: arrival must be >= 0"),
    ("\n", "{f}: no requests"),
])
def test_bad_requests_file_is_one_clear_line(tmp_path, capsys, content, message):
    f = tmp_path / "bad.jsonl"
    if content is not None:
        f.write_text(content)
    assert main(["serve", "--requests", str(f)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.startswith("error: ")
    assert message.format(f=f) in cap.err and cap.err.count("\n") == 1


@pytest.mark.parametrize("flags, message", [
    (["--prompt", "x"], "--prompt with --requests"),
    (["--max-batch", "0"], "--max-batch 0"),
    (["--profile", "nope"], "profile='nope' is not known"),
])
def test_bad_flags_with_requests(tmp_path, capsys, flags, message):
    f = write(tmp_path / "t.jsonl", rows_of(TRACE))
    assert main(["serve", "--requests", f, *flags]) == 2
    assert message in capsys.readouterr().err


def test_serve_without_prompt_or_requests_says_which(capsys):
    assert main(["serve"]) == 2
    assert "--prompt TEXT" in capsys.readouterr().err
