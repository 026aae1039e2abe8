"""The credential chain (``loader.s3.credentials``) without a server: which source wins,
what obstore is handed and when it is refreshed, and what an error says when nothing is found.

The root conftest points the profile files at an empty temporary directory and switches the
instance metadata service off; tests here write their own profile files. The same chain against
a real server, both backends: ``integration/test_credentials_s3.py``.
"""

from __future__ import annotations

import json
import pickle
import socket
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from loader.config import S3Config
from loader.errors import ConfigError, NoCredentialsError
from loader.s3.credentials import BotocoreCredentialProvider, resolve_credentials

ENDPOINT = "http://127.0.0.1:9"
SECRET = "wJalrXUtnFEMI-profile-secret"
PROC_SECRET = "proc-secret-value-7f3a"
_KEY_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MINIO_ACCESS_KEY",
             "MINIO_SECRET_KEY", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD")


@pytest.fixture
def profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Empty profile files of this test's own, no keys in the environment; returns the folder."""
    for name in _KEY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    return tmp_path


def write_credentials(folder: Path, **sections: tuple[str, str]) -> None:
    text = "".join(f"[{name}]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n"
                   for name, (key, secret) in sections.items())
    (folder / "credentials").write_text(text)


def credential_process(folder: Path, *, lifetime: float | None, key: str = "AKIDPROCESS") -> tuple[str, Path]:
    """A ``credential_process`` command that logs each run to a file; returns (command, log)."""
    log = folder / "process-runs"
    script = folder / "creds.py"
    script.write_text(
        "import datetime, json, sys\n"
        f"open({str(log)!r}, 'a').write('run\\n')\n"
        f"out = {{'Version': 1, 'AccessKeyId': {key!r}, 'SecretAccessKey': {PROC_SECRET!r}}}\n"
        f"lifetime = {lifetime!r}\n"
        "if lifetime is not None:\n"
        "    end = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=lifetime)\n"
        "    out['Expiration'] = end.strftime('%Y-%m-%dT%H:%M:%SZ')\n"
        "json.dump(out, sys.stdout)\n"
    )
    return f"{sys.executable} {script}", log


def frozen(config: S3Config) -> tuple[str, str, str | None]:
    creds = resolve_credentials(config).get_frozen_credentials()
    return creds.access_key, creds.secret_key, creds.token


def test_explicit_keys_win_over_everything(profiles, monkeypatch):
    write_credentials(profiles, default=("AKIDPROFILE", SECRET))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envsecret")
    config = S3Config(endpoint_url=ENDPOINT, access_key_id="AKIDGIVEN", secret_access_key="given",
                      profile="default")
    assert frozen(config) == ("AKIDGIVEN", "given", None)


def test_given_keys_need_no_botocore_and_stay_hidden():
    """Keys given in the config reach obstore without importing botocore's credentials module
    (~30 ms of a store's start-up); their repr hides them, and they never expire."""
    code = ("import sys\n"
            "from loader.config import S3Config\n"
            "from loader.s3.credentials import BotocoreCredentialProvider, resolve_credentials\n"
            "keys = resolve_credentials(S3Config(access_key_id='AKIDGIVEN', secret_access_key='given'))\n"
            "answer = BotocoreCredentialProvider(keys)()\n"
            "print(answer['access_key_id'], answer['expires_at'], repr(keys), 'botocore.credentials' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["AKIDGIVEN", "None", "GivenKeys(<hidden>)", "False"]


def test_a_custom_endpoint_reads_the_default_profile(profiles):
    write_credentials(profiles, default=("AKIDDEFAULT", SECRET))
    assert frozen(S3Config.from_env({"AWS_ENDPOINT_URL": ENDPOINT})) == ("AKIDDEFAULT", SECRET, None)


def test_aws_profile_picks_the_profile(profiles, monkeypatch):
    write_credentials(profiles, default=("AKIDDEFAULT", "x"), dev=("AKIDDEV", SECRET))
    monkeypatch.setenv("AWS_PROFILE", "dev")
    assert frozen(S3Config(endpoint_url=ENDPOINT))[0] == "AKIDDEV"


def test_environment_keys_win_over_aws_profile_but_not_over_an_explicit_profile(profiles, monkeypatch):
    """As in boto3: ``AWS_PROFILE`` is one more variable, ``profile=`` a choice."""
    write_credentials(profiles, dev=("AKIDDEV", SECRET))
    monkeypatch.setenv("AWS_PROFILE", "dev")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envsecret")
    assert frozen(S3Config.from_env())[0] == "AKIDENV"
    assert frozen(S3Config(endpoint_url=ENDPOINT))[0] == "AKIDENV"
    assert frozen(S3Config(endpoint_url=ENDPOINT, profile="dev"))[0] == "AKIDDEV"


def test_a_profile_in_the_config_file_with_credential_process(profiles):
    command, log = credential_process(profiles, lifetime=None)
    (profiles / "config").write_text(f"[profile proc]\ncredential_process = {command}\n")
    assert frozen(S3Config(endpoint_url=ENDPOINT, profile="proc")) == ("AKIDPROCESS", PROC_SECRET, None)
    assert log.read_text().count("run") == 1


def test_obstore_provider_hands_over_permanent_keys_without_expiry():
    config = S3Config(endpoint_url=ENDPOINT, access_key_id="AKIDGIVEN", secret_access_key=SECRET)
    provider = BotocoreCredentialProvider(resolve_credentials(config))
    assert provider() == {"access_key_id": "AKIDGIVEN", "secret_access_key": SECRET, "token": None,
                          "expires_at": None}
    assert SECRET not in repr(provider)
    with pytest.raises(TypeError, match="not picklable"):
        pickle.dumps(provider)


def test_obstore_provider_refreshes_temporary_credentials_through_botocore(profiles):
    """Credentials that expire carry their expiry to obstore; once inside botocore's refresh
    window, asking again runs the process again, as boto3 would."""
    command, log = credential_process(profiles, lifetime=3600)
    (profiles / "config").write_text(f"[profile long]\ncredential_process = {command}\n")
    provider = BotocoreCredentialProvider(resolve_credentials(S3Config(profile="long")))
    first = provider()
    assert first["access_key_id"] == "AKIDPROCESS"
    expires = first["expires_at"]
    assert expires.tzinfo is timezone.utc  # obstore refuses any other tzinfo, dateutil's too
    assert timedelta(minutes=50) < expires - datetime.now(timezone.utc) <= timedelta(hours=1)
    provider()
    assert log.read_text().count("run") == 1  # an hour left: no refresh

    command, log = credential_process(profiles, lifetime=60, key="AKIDSHORT")
    (profiles / "config").write_text(f"[profile short]\ncredential_process = {command}\n")
    provider = BotocoreCredentialProvider(resolve_credentials(S3Config(profile="short")))
    assert provider()["access_key_id"] == "AKIDSHORT"
    runs = log.read_text().count("run")
    provider()
    assert log.read_text().count("run") == runs + 1  # a minute left: botocore fetches anew
    assert provider.refresh_threshold >= timedelta(minutes=10)  # obstore asks before expiry


def test_nothing_found_lists_what_was_tried_without_secrets(profiles, monkeypatch):
    write_credentials(profiles, other=("AKIDOTHER", SECRET))
    with pytest.raises(NoCredentialsError) as info:
        resolve_credentials(S3Config(endpoint_url=ENDPOINT))
    message = str(info.value)
    assert message.startswith(f"no credentials for endpoint {ENDPOINT!r}: set AWS_ACCESS_KEY_ID")
    for needle in ("AWS_PROFILE", "S3Config(profile=...)", "profile 'default' (no AWS_PROFILE)",
                   str(profiles / "credentials"), f"{profiles / 'config'} (missing)", "web identity",
                   "container credentials",
                   "instance metadata (skipped: AWS_EC2_METADATA_DISABLED=true)"):
        assert needle in message
    assert SECRET not in message and "AKIDOTHER" not in message
    assert info.value.tried and info.value.endpoint == f"endpoint {ENDPOINT!r}"
    copy = pickle.loads(pickle.dumps(info.value))  # crosses DataLoader workers intact
    assert (str(copy), copy.tried) == (message, info.value.tried)
    assert isinstance(info.value, ConfigError)


def test_a_missing_profile_names_the_profiles_there(profiles, monkeypatch):
    write_credentials(profiles, default=("AKIDDEFAULT", SECRET), dev=("AKIDDEV", SECRET))
    monkeypatch.setenv("AWS_PROFILE", "deve")
    with pytest.raises(ConfigError, match=r"^profile 'deve' \(AWS_PROFILE\) for endpoint "
                       r"'http://127.0.0.1:9' is in neither .*; profiles there: 'default', 'dev'; "
                       r"fix the name or add the profile$") as info:
        resolve_credentials(S3Config(endpoint_url=ENDPOINT))
    assert SECRET not in str(info.value)


def test_a_failing_credential_process_says_which_profile(profiles):
    (profiles / "config").write_text(f"[profile broken]\ncredential_process = {sys.executable} -c "
                                     "\"import sys; sys.exit('token expired, log in again')\"\n")
    with pytest.raises(ConfigError, match=r"^could not get credentials for AWS S3 with profile "
                       r"'broken' \(S3Config.profile\): .*token expired, log in again"):
        resolve_credentials(S3Config(profile="broken"))


def test_instance_metadata_lookup_is_bounded(profiles, monkeypatch):
    """A metadata service that accepts connections but never answers costs the lookup botocore's
    timeout (1 s per request by default), not a hang."""
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(silent.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, name="silent-imds", daemon=True)
    thread.start()
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
    try:
        with pytest.raises(NoCredentialsError, match=r"instance metadata \(no credentials within 1 s\)"):
            resolve_credentials(S3Config(endpoint_url=ENDPOINT))  # the silent service never answers
        assert accepted, "the lookup should have asked the metadata service"
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in accepted:
            conn.close()
        silent.close()


def test_config_profile_is_checked_and_shown():
    with pytest.raises(ConfigError, match="profile is empty"):
        S3Config(profile=" ")
    assert "profile='dev'" in repr(S3Config(profile="dev"))
    assert "profile" not in repr(S3Config())
    assert json.dumps(S3Config.from_env({"AWS_PROFILE": "dev"}).profile) == "null"
