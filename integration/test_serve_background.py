"""``loader serve --background`` in a shell, as the docs show it: ``eval "$(...)"`` returns as
soon as the server is ready, the exports point at a server that answers, ``serve --stop`` ends it.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from s3servers import S3_VARS

REPO = Path(__file__).resolve().parents[1]
LIST_BUCKET = (  # what a user's script would do with the exported variables
    "import os, boto3; s3 = boto3.client('s3', endpoint_url=os.environ['AWS_ENDPOINT_URL']); "
    "print('endpoint', os.environ['AWS_ENDPOINT_URL'], 'objects', "
    "s3.list_objects_v2(Bucket='train')['KeyCount'])"
)


@pytest.fixture
def shell_env() -> dict[str, str]:
    from loader.tools.devserver import find_weed

    find_weed()  # a test dependency: missing, it fails here with the install advice
    env = {k: v for k, v in os.environ.items() if k not in S3_VARS}
    env["PYTHON"] = sys.executable
    return env


def alive(pid: int) -> bool:
    """Running, not merely a zombie waiting for a reaper (the shell that started it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def refused(endpoint: str) -> bool:
    host, port = endpoint.rsplit("//", 1)[1].split(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return True
    return False


def test_eval_returns_once_ready_and_stop_ends_the_server(tmp_path, shell_env):
    pidfile = tmp_path / "s3.pid"
    script = (
        f'eval "$("$PYTHON" -m loader serve --background --pidfile {shlex.quote(str(pidfile))} '
        f'--bucket train)" && "$PYTHON" -c {shlex.quote(LIST_BUCKET)}'
    )
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                          env=shell_env, cwd=REPO)
    try:
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        words = proc.stdout.split()
        assert words[0] == "endpoint" and words[2:] == ["objects", "0"], proc.stdout
        endpoint = words[1]
        pid = int(pidfile.read_text().split()[0])
        assert alive(pid), "the server should keep running after the shell returned"
    except BaseException:
        if pidfile.exists():  # do not leave a server behind a failed assertion
            subprocess.run([sys.executable, "-m", "loader", "serve", "--stop", str(pidfile)],
                           timeout=60, cwd=REPO, env=shell_env)
        raise

    again = subprocess.run([sys.executable, "-m", "loader", "serve", "--background", "--pidfile",
                            str(pidfile)], capture_output=True, text=True, timeout=60, cwd=REPO,
                           env=shell_env)
    assert again.returncode == 1 and "already" in again.stderr and str(pid) in again.stderr, again

    stop = subprocess.run([sys.executable, "-m", "loader", "serve", "--stop", str(pidfile)],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=shell_env)
    assert stop.returncode == 0, stop.stderr
    assert not alive(pid)
    assert not pidfile.exists()
    assert refused(endpoint)

    gone = subprocess.run([sys.executable, "-m", "loader", "serve", "--stop", str(pidfile)],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=shell_env)
    assert gone.returncode == 1 and "no server" in gone.stderr, gone


def test_a_server_that_cannot_start_fails_the_eval_with_its_error(tmp_path, shell_env):
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        pidfile = tmp_path / "s3.pid"
        # eval "$(...)" alone would hide the status (eval of nothing succeeds): scripts that must
        # stop on failure assign first, as the docs show
        proc = subprocess.run(
            ["bash", "-c", (f'exports="$("$PYTHON" -m loader serve --background --pidfile {pidfile} '
                            f'--port {port})" && eval "$exports"')],
            capture_output=True, text=True, timeout=120, env=shell_env, cwd=REPO)
    finally:
        taken.close()
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert f"port {port}" in proc.stderr and "already in use" in proc.stderr
    assert not pidfile.exists()


def test_background_needs_a_pidfile(shell_env):
    proc = subprocess.run([sys.executable, "-m", "loader", "serve", "--background"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=shell_env)
    assert proc.returncode == 2 and "--pidfile" in proc.stderr, proc


def test_stop_refuses_a_pidfile_that_names_another_program(tmp_path, shell_env):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        pidfile = tmp_path / "other.pid"
        pidfile.write_text(f"{sleeper.pid}\n")
        proc = subprocess.run([sys.executable, "-m", "loader", "serve", "--stop", str(pidfile)],
                              capture_output=True, text=True, timeout=60, cwd=REPO, env=shell_env)
        assert proc.returncode == 1 and "not a `loader serve`" in proc.stderr, proc
        assert sleeper.poll() is None
    finally:
        sleeper.send_signal(signal.SIGTERM)
        sleeper.wait(timeout=10)


@pytest.mark.parametrize("argv", [["--bucket", "ft"], ["--bucket", "train", "--bucket", "Bad_Name"],
                                  ["--background", "--pidfile", "{pidfile}", "--bucket", "10.0.0.1"]])
def test_an_invalid_bucket_name_is_refused_before_the_server_starts(tmp_path, shell_env, argv):
    """S3 answers a bad name with botocore's raw InvalidBucketName only after the server started;
    the name and the rule come first, in one line, and nothing is left running."""
    pidfile = tmp_path / "s3.pid"
    argv = [arg.format(pidfile=pidfile) for arg in argv]
    proc = subprocess.run([sys.executable, "-m", "loader", "serve", *argv], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env=shell_env)
    name = argv[-1]
    assert proc.returncode == 2 and proc.stdout == "", proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{name!r} is not a valid bucket name" in lines[0]
    assert "3-63 characters of lowercase letters, digits, dots and hyphens" in lines[0]
    assert not pidfile.exists()


def test_devserver_refuses_an_invalid_bucket_name_before_starting():
    from loader import ConfigError
    from loader.testing import DevServer

    with pytest.raises(ConfigError, match=r"DevServer bucket 'ft' is not a valid bucket name \(it has 2 "
                                          r"character\(s\)\); use 3-63 characters"):
        DevServer(buckets=["ft"])


EXAMPLES_DIGEST = (  # every object of the bucket the docs read, as a user's script would see it
    "import os, hashlib, boto3; s3 = boto3.client('s3', endpoint_url=os.environ['AWS_ENDPOINT_URL']); "
    "keys = [o['Key'] for page in s3.get_paginator('list_objects_v2').paginate(Bucket='bucket') "
    "for o in page.get('Contents', [])]; "
    "print(len(keys), hashlib.sha256(b''.join(k.encode() + hashlib.sha256(s3.get_object(Bucket='bucket', "
    "Key=k)['Body'].read()).digest() for k in sorted(keys))).hexdigest())"
)


def test_examples_creates_the_bucket_the_docs_read(tmp_path, shell_env):
    """``serve --examples``, as the first page runs it on a fresh machine: the bucket ``bucket``
    holds exactly the data every example of the docs reads (``loader.tools.examples``)."""
    import hashlib

    from loader.tools.examples import example_data

    pidfile = tmp_path / "s3.pid"
    script = (f'eval "$("$PYTHON" -m loader serve --background --pidfile {shlex.quote(str(pidfile))} --examples)" '
              f'&& "$PYTHON" -c {shlex.quote(EXAMPLES_DIGEST)}')
    try:
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=180,
                              env=shell_env, cwd=REPO)
    finally:
        if pidfile.exists():
            subprocess.run([sys.executable, "-m", "loader", "serve", "--stop", str(pidfile)],
                           timeout=60, cwd=REPO, env=shell_env)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    data = example_data()
    expected = hashlib.sha256(b"".join(key.encode() + hashlib.sha256(data[key]).digest()
                                       for key in sorted(data))).hexdigest()
    assert proc.stdout.split() == [str(len(data)), expected], proc.stdout
    assert "holds the examples' data: 174 objects" in proc.stderr
