"""Credentials from AWS profiles with a custom endpoint, against the real server, both backends.

A user with keys in ``~/.aws`` (here: profile files in a temporary folder, named by
``AWS_SHARED_CREDENTIALS_FILE`` / ``AWS_CONFIG_FILE``) and ``AWS_ENDPOINT_URL`` set reads the bucket
with no ``AWS_ACCESS_KEY_ID`` in sight: through ``AWS_PROFILE``, the ``[default]`` profile, and a
``credential_process`` whose short-lived credentials are fetched again as they near expiry. The
CLI does the same, and tells a shell user what to set when nothing is found.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from loader import AsyncS3Dataset

from datasets import upload_objects

BACKENDS = ["aioboto3", "obstore"]  # obstore is in the "obstore" extra that make test installs
OBJECTS = {f"train/{i:03d}.bin": bytes([i]) * (1000 + i) for i in range(6)}
_KEY_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MINIO_ACCESS_KEY",
             "MINIO_SECRET_KEY", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD", "AWS_PROFILE",
             "LOADER_STORE")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bucket(s3_server) -> str:
    name = s3_server.new_bucket("creds")
    upload_objects(s3_server.minio, name, OBJECTS)
    return name


@pytest.fixture
def profile_env(s3_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_server) -> dict[str, str]:
    """``s3_env`` without the keys: only the endpoint, and profile files of this test's own."""
    for name in _KEY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    config = s3_server.config
    return {"folder": str(tmp_path), "key": config.access_key_id, "secret": config.secret_access_key}


def read_all(uri: str, store: str, workers: int = 0) -> dict[str, bytes]:
    ds = AsyncS3Dataset.from_prefix(uri, store=store)
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    return {sample["__key__"] + ".bin": sample["bin"] for sample in loader}


@pytest.mark.parametrize("store", BACKENDS)
def test_aws_profile_with_a_custom_endpoint(bucket, profile_env, monkeypatch, store):
    folder = Path(profile_env["folder"])
    (folder / "credentials").write_text(
        "[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n"
        f"[training]\naws_access_key_id = {profile_env['key']}\n"
        f"aws_secret_access_key = {profile_env['secret']}\n")
    monkeypatch.setenv("AWS_PROFILE", "training")
    assert read_all(f"s3://{bucket}/train/", store) == OBJECTS


@pytest.mark.parametrize("store", BACKENDS)
def test_default_profile_in_the_config_file_read_by_workers(bucket, profile_env, store):
    """Keys in ``~/.aws/config``'s ``[default]``, no AWS_PROFILE; DataLoader workers resolve too."""
    Path(profile_env["folder"], "config").write_text(
        f"[default]\naws_access_key_id = {profile_env['key']}\n"
        f"aws_secret_access_key = {profile_env['secret']}\n")
    workers = 0 if store == "obstore" else 2  # obstore's runtime does not survive fork
    assert read_all(f"s3://{bucket}/train/", store, workers=workers) == OBJECTS


@pytest.mark.parametrize("store", BACKENDS)
def test_credential_process_is_asked_again_before_expiry(bucket, profile_env, monkeypatch, store):
    """A ``credential_process`` handing out credentials that expire within botocore's refresh
    window: every backend gets them fetched anew while reading, as boto3 would."""
    folder = Path(profile_env["folder"])
    log, script = folder / "runs", folder / "creds.py"
    script.write_text(
        "import datetime, json, sys\n"
        f"open({str(log)!r}, 'a').write('run\\n')\n"
        "end = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=5)\n"
        f"json.dump({{'Version': 1, 'AccessKeyId': {profile_env['key']!r}, "
        f"'SecretAccessKey': {profile_env['secret']!r}, "
        "'Expiration': end.strftime('%Y-%m-%dT%H:%M:%SZ')}, sys.stdout)\n")
    (folder / "config").write_text(f"[profile proc]\ncredential_process = {sys.executable} {script}\n")
    monkeypatch.setenv("AWS_PROFILE", "proc")
    assert read_all(f"s3://{bucket}/train/", store) == OBJECTS
    assert log.read_text().count("run") >= 2


def cli(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loader", *argv], capture_output=True, text=True,
                          timeout=120, env=env, cwd=REPO)


def test_cli_ls_with_a_profile_and_its_advice_without_one(bucket, profile_env, monkeypatch):
    folder = Path(profile_env["folder"])
    (folder / "credentials").write_text(
        f"[minio]\naws_access_key_id = {profile_env['key']}\naws_secret_access_key = {profile_env['secret']}\n")
    env = dict(os.environ, AWS_PROFILE="minio")
    proc = cli("ls", f"s3://{bucket}/train/", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "6 objects" in proc.stdout

    del env["AWS_PROFILE"]
    proc = cli("ls", f"s3://{bucket}/train/", env=env)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    error = proc.stderr.strip()
    assert error.startswith("loader ls: error: no credentials for endpoint"), error
    assert "AWS_PROFILE" in error and "S3Config" not in error and "Traceback" not in error
    assert profile_env["secret"] not in error
