import io
import json
import os
import stat

import pytest

from eaglenest import errors
from eaglenest import util


def test_write_atomic_writes_bytes_text_and_json_whole_and_readable(tmp_path):
    util.write_atomic(tmp_path / "a.bin", b"\x00\x01")
    util.write_atomic(tmp_path / "sub" / "b.txt", "héllo\n")
    util.write_atomic(tmp_path / "c.json", {"x": [1, 2]})
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "sub" / "b.txt").read_text(encoding="utf-8") == "héllo\n"
    assert json.loads((tmp_path / "c.json").read_text()) == {"x": [1, 2]}
    assert (tmp_path / "c.json").read_text().endswith("}\n")
    assert stat.S_IMODE(os.stat(tmp_path / "c.json").st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "c.json", "sub"]  # no temp file left


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "keep.json"
    util.write_atomic(path, {"old": True})
    with pytest.raises(TypeError):
        util.write_atomic(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["keep.json"]


def test_progress_in_a_log_file_writes_plain_lines_not_carriage_returns(monkeypatch):
    log = io.StringIO()  # not a tty, like a rule's log
    monkeypatch.setattr("sys.stderr", log)
    bar = util.progress_bar(total=1000, desc="work", unit="it")
    for _ in range(1000):
        bar.update(1)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert 1 <= len(lines) <= 4, lines  # a start line and an end line, not one per update
    assert "work" in lines[-1] and "1000/1000" in lines[-1]


def test_every_user_error_shares_one_base_and_keeps_its_old_base():
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.DiskSpaceError, OSError)
    assert issubclass(errors.ServerError, RuntimeError)
    user_errors = [c for c in vars(errors).values() if isinstance(c, type) and c.__module__ == errors.__name__]
    assert len(user_errors) >= 8
    assert all(issubclass(c, errors.EaglenestError) for c in user_errors)


@pytest.mark.parametrize("error, one_line", [("ConfigError('server.model is wrong: fix it')", True),
                                             ("KeyError('a bug')", False)])
def test_a_user_error_reaches_the_rule_log_as_one_message_a_bug_as_a_traceback(tmp_path, error, one_line):
    import subprocess
    import sys

    log = tmp_path / "rule.log"
    script = ("from eaglenest.logs import to_log\nfrom eaglenest.errors import ConfigError\n"
              f"to_log({str(log)!r})\nraise {error}\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    text = log.read_text()
    if one_line:
        assert text == "error: server.model is wrong: fix it\n"
    else:
        assert "Traceback" in text and "KeyError: 'a bug'" in text


def test_usable_threads_never_exceed_the_cpus_the_process_may_run_on():
    import subprocess
    import sys

    from eaglenest.util import usable_threads

    assert usable_threads(10_000) == len(os.sched_getaffinity(0)) and usable_threads(0) == 1
    one_cpu = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
               "from eaglenest.util import usable_threads; print(usable_threads(8))")
    assert subprocess.run([sys.executable, "-c", one_cpu], capture_output=True, text=True, check=True).stdout.strip() == "1"


def test_a_name_is_a_local_path_when_spelled_as_one_or_present_else_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "m").mkdir(parents=True)
    for spelled in ("/abs/missing", "./missing", "../missing", "~/missing", ".", ".."):
        assert util.is_local_path(spelled), spelled
    assert util.is_local_path("models/m") and util.is_local_path(tmp_path / "models")  # present here
    assert not util.is_local_path("org/name") and not util.is_local_path("gpt2") and not util.is_local_path("")
    assert util.is_local_path("m", base=tmp_path / "models") and not util.is_local_path("models/m", base=tmp_path / "models")
