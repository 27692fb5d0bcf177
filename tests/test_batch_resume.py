"""run-batch's checks of its files: repeated custom_ids refused, an interrupted run's output resumed
(only the lines without a result run again), through the CLI on a one-layer dummy model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flashserve.entrypoints.run_batch.lines import parse_line
from flashserve.entrypoints.run_batch.resume import duplicate_ids, prepare_output, remaining


def line(custom_id: str, body: dict | None = None) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": body or {"prompt": [1, 2, 3], "max_tokens": 2}})


def result(custom_id: str | None, status: int | None = 200) -> str:
    response = None if status is None else {"status_code": status, "request_id": "r", "body": {}}
    error = {"code": "invalid_json", "message": "x"} if status is None else None
    return json.dumps({"id": "batch_req_1", "custom_id": custom_id, "response": response, "error": error}) + "\n"


def test_repeated_custom_ids_are_named_with_their_lines() -> None:
    items = [parse_line(text, n) for n, text in enumerate([line("a"), line("b"), line("a"), line("b"), line("c")], 1)]
    message = duplicate_ids(items)
    assert message is not None and '"a" on lines 1, 3' in message and '"b" on lines 2, 4' in message
    assert '"c"' not in message


def test_unique_custom_ids_pass() -> None:
    assert duplicate_ids([parse_line(line(c), n) for n, c in enumerate("abc", 1)]) is None


def test_resume_keeps_finished_results_and_drops_server_failures_and_a_cut_line(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text(result(None, None) + result("a") + result("b", 400) + result("c", 503) + result("d")[:20])
    resume = prepare_output(str(out), overwrite=False)
    assert resume.done == {"a", "b"} and resume.num_anonymous_errors == 1
    assert out.read_text() == result(None, None) + result("a") + result("b", 400)


def test_overwrite_empties_the_output(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text(result("a"))
    assert prepare_output(str(out), overwrite=True).num_done == 0 and out.read_text() == ""


def test_the_remaining_lines_are_those_without_a_result(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text(result(None, None) + result("a"))
    items = [parse_line(text, n) for n, text in enumerate(["{bad", line("a"), "{bad too", line("b")], 1)]
    assert [item.line_no for item in remaining(items, prepare_output(str(out), False))] == [3, 4]


def run_batch(tmp_path: Path, config: Path, *extra: str, **popen: object) -> subprocess.Popen:
    args = [sys.executable, "-m", "flashserve", "run-batch", "-i", str(tmp_path / "in.jsonl"),
            "-o", str(tmp_path / "out.jsonl"), "--model", str(config), "--load-format", "dummy",
            "--served-model-name", "tiny", "--max-num-seqs", "2", "--num-pages", "64", "--no-progress", *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_a_file_with_a_repeated_custom_id_is_refused_before_the_model_loads(tmp_path: Path,
                                                                            tiny_llama_config: Path) -> None:
    (tmp_path / "in.jsonl").write_text("\n".join([line("x"), line("y"), line("x")]) + "\n")
    proc = run_batch(tmp_path, tiny_llama_config)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and '"x" on lines 1, 3' in err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_rerun_over_a_finished_output_ends_at_once_without_loading_the_model(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text("\n".join(line(c) for c in "abc") + "\n")
    finished = result("a") + result("b") + result("c", 400)
    (tmp_path / "out.jsonl").write_text(finished)
    proc = run_batch(tmp_path, tmp_path / "no-such-model")  # a model load would fail
    summary, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "every line of" in err and "nothing to run" in err
    assert "requests: 0 ok, 0 failed" in summary
    assert (tmp_path / "out.jsonl").read_text() == finished


def test_a_run_interrupted_halfway_is_finished_by_a_rerun_that_runs_only_the_rest(
        tmp_path: Path, tiny_llama_config: Path) -> None:
    total = 40
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    (tmp_path / "in.jsonl").write_text("\n".join(line(f"r{i}", body) for i in range(total)) + "\n")
    out = tmp_path / "out.jsonl"
    # Ctrl-C in a terminal: SIGINT at its default in the run, even where the tests themselves were
    # started in the background (which ignores SIGINT, and a child inherits that).
    first = run_batch(tmp_path, tiny_llama_config, start_new_session=True,
                      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not (out.exists() and len(out.read_text().splitlines()) >= 5):
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C: the whole process group
    first.communicate(timeout=60)
    written = out.read_text()
    written = written[:written.rfind("\n") + 1]  # a line cut off mid-write is run again
    done = len(written.splitlines())
    assert first.returncode == 130 and 5 <= done < total

    second = run_batch(tmp_path, tiny_llama_config)
    summary, err = second.communicate(timeout=300)
    assert second.returncode == 0, err
    assert f"{done} of {total} lines have results" in err
    assert f"requests: {total - done} ok" in summary
    text = out.read_text()
    assert text.startswith(written)  # the first run's results are kept as they were
    ids = [json.loads(t)["custom_id"] for t in text.splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(total))
