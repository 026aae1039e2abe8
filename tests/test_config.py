"""Unit tests for ``loader.config``: every environment variable, every message, and the secrets.

``S3Config.from_env(environ=...)`` is given a plain dict, so no test depends on (or changes) the
real environment except the two that check ``environ=None`` reads ``os.environ``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loader.config import DEFAULT_REGION, S3Config, resolve_config
from loader.errors import ConfigError, LoaderError

# Recognisable values, so a leak shows up as a substring anywhere.
ACCESS = "test-access-key-id-0000"
SECRET = "wJalrXUtnFEMI-K7MDENG-SECRETKEY-do-not-leak"
TOKEN = "FwoGZXIvYXdzEJr-SESSIONTOKEN-do-not-leak"

ENV_NAMES = (
    "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL", "MINIO_ENDPOINT", "MINIO_SECURE",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MINIO_ACCESS_KEY", "MINIO_SECRET_KEY",
    "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD", "AWS_SESSION_TOKEN", "AWS_REGION",
    "AWS_DEFAULT_REGION", "AWS_CA_BUNDLE",
)


def creds(**extra: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET, **extra}


def assert_no_secret(text: str) -> None:
    assert SECRET not in text
    assert TOKEN not in text


# ------------------------------------------------------------------------------ the error type


def test_config_error_is_a_value_error_and_a_loader_error():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, LoaderError)
    with pytest.raises(ValueError):
        S3Config.from_env({"AWS_ENDPOINT_URL": "localhost:9000"})


# ------------------------------------------------------------------------------ defaults


def test_defaults_mean_aws_with_the_default_chain():
    cfg = S3Config()
    assert cfg.endpoint_url is None
    assert cfg.region == DEFAULT_REGION == "us-east-1"
    assert cfg.access_key_id is None and cfg.secret_access_key is None and cfg.session_token is None
    assert cfg.addressing_style == "auto"
    assert cfg.verify is True
    assert not cfg.has_credentials
    assert not cfg.path_style
    assert cfg.profile is None  # botocore's chain picks AWS_PROFILE or "default"


def test_empty_environment_gives_the_defaults():
    assert S3Config.from_env({}) == S3Config()


def test_fields_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        S3Config("http://localhost:9000")  # type: ignore[misc]
    cfg = S3Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.region = "eu-west-1"  # type: ignore[misc]


def test_environ_none_reads_os_environ(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_REGION", "eu-central-1")
    cfg = S3Config.from_env()
    assert cfg.endpoint_url == "http://127.0.0.1:9000"
    assert cfg.region == "eu-central-1"


def test_resolve_config_prefers_the_explicit_config(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://from-env:9000")
    explicit = S3Config(endpoint_url="http://explicit:9000")
    assert resolve_config(explicit) is explicit
    assert resolve_config(None).endpoint_url == "http://from-env:9000"


# ------------------------------------------------------------------------------ endpoints


@pytest.mark.parametrize("name", ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL"])
def test_each_endpoint_variable_is_read(name):
    assert S3Config.from_env({name: "http://localhost:9000"}).endpoint_url == "http://localhost:9000"


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("http://localhost:9000", "http://localhost:9000"),
        ("http://localhost:9000/", "http://localhost:9000"),
        ("  https://s3.example.com  ", "https://s3.example.com"),
        ("HTTP://127.0.0.1:9000", "http://127.0.0.1:9000"),
        ("http://[::1]:9000", "http://[::1]:9000"),
    ],
)
def test_endpoint_is_normalised_to_scheme_host_port(raw, normalised):
    assert S3Config.from_env({"AWS_ENDPOINT_URL": raw}).endpoint_url == normalised
    assert S3Config(endpoint_url=raw).endpoint_url == normalised


def test_endpoint_precedence():
    env = {
        "AWS_ENDPOINT_URL_S3": "http://s3-specific:1",
        "AWS_ENDPOINT_URL": "http://aws:2",
        "S3_ENDPOINT_URL": "http://s3:3",
        "MINIO_ENDPOINT": "minio:4",
    }
    assert S3Config.from_env(env).endpoint_url == "http://s3-specific:1"
    del env["AWS_ENDPOINT_URL_S3"]
    assert S3Config.from_env(env).endpoint_url == "http://aws:2"
    del env["AWS_ENDPOINT_URL"]
    assert S3Config.from_env(env).endpoint_url == "http://s3:3"
    del env["S3_ENDPOINT_URL"]
    assert S3Config.from_env(env).endpoint_url == "http://minio:4"


def test_empty_endpoint_variable_falls_through_to_the_next():
    env = {"AWS_ENDPOINT_URL": "", "S3_ENDPOINT_URL": "http://s3:3"}
    assert S3Config.from_env(env).endpoint_url == "http://s3:3"


def test_a_bad_higher_priority_endpoint_is_not_silently_skipped():
    env = {"AWS_ENDPOINT_URL": "localhost:9000", "S3_ENDPOINT_URL": "http://fine:9000"}
    with pytest.raises(ConfigError, match="AWS_ENDPOINT_URL='localhost:9000'"):
        S3Config.from_env(env)


@pytest.mark.parametrize("name", ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL"])
@pytest.mark.parametrize("value", ["localhost:9000", "127.0.0.1:9000", "minio.internal"])
def test_endpoint_without_scheme_names_the_variable_and_suggests_http(name, value):
    with pytest.raises(ConfigError) as info:
        S3Config.from_env({name: value})
    message = str(info.value)
    assert message.startswith(f"{name}={value!r} is not a URL with a scheme")
    assert f"'http://{value}'" in message


def test_localhost_endpoint_message_in_full():
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "AWS_ENDPOINT_URL='localhost:9000' is not a URL with a scheme; "
            "set it to 'http://localhost:9000'"
        ),
    ):
        S3Config.from_env({"AWS_ENDPOINT_URL": "localhost:9000"})


@pytest.mark.parametrize("value", ["ftp://host:21", "s3://bucket", "http://", "https:///path-only"])
def test_endpoint_with_wrong_scheme_or_no_host(value):
    with pytest.raises(
        ConfigError,
        match=rf"^AWS_ENDPOINT_URL={re.escape(repr(value))} is not a URL with a scheme; "
        r"set it to an http:// or https:// URL",
    ):
        S3Config.from_env({"AWS_ENDPOINT_URL": value})


@pytest.mark.parametrize(
    "value", ["http://localhost:9000/my-bucket", "http://localhost:9000/a/b/", "http://h:9000?x=1"]
)
def test_endpoint_with_path_or_query_is_refused(value):
    with pytest.raises(
        ConfigError,
        match=rf"AWS_ENDPOINT_URL={re.escape(repr(value))} has a path; give only scheme, host and port "
        r"\(the bucket goes into the s3:// URI",
    ):
        S3Config.from_env({"AWS_ENDPOINT_URL": value})


@pytest.mark.parametrize("value", ["http://h:port", "http://h:99999", "http://[::1"])
def test_endpoint_with_bad_port_or_host_is_a_config_error(value):
    """Caught here, not as a DNS or connection error deep inside botocore."""
    with pytest.raises(
        ConfigError, match=rf"^S3_ENDPOINT_URL={re.escape(repr(value))} is not a valid URL"
    ) as info:
        S3Config.from_env({"S3_ENDPOINT_URL": value})
    assert isinstance(info.value.__cause__, ValueError)


def test_endpoint_with_credentials_inside_is_refused_without_echoing_them():
    value = f"http://{ACCESS}:{SECRET}@localhost:9000"
    with pytest.raises(ConfigError, match=r"^AWS_ENDPOINT_URL contains '@'.*AWS_SECRET_ACCESS_KEY") as info:
        S3Config.from_env({"AWS_ENDPOINT_URL": value})
    assert_no_secret(str(info.value))
    with pytest.raises(ConfigError, match=r"^endpoint_url contains '@'") as info:
        S3Config(endpoint_url=value)
    assert_no_secret(str(info.value))


def test_endpoint_errors_read_whole():
    """The advice at the end of each message is part of the message."""
    with pytest.raises(ConfigError) as info:
        S3Config(endpoint_url="http://u:p@localhost:9000")
    assert str(info.value) == (
        "endpoint_url contains '@' (credentials in the URL?); give only scheme, host and port and "
        "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for the credentials")
    with pytest.raises(ConfigError) as info:
        S3Config(endpoint_url="http://h:port")
    assert str(info.value).endswith("set it to scheme, host and port (e.g. http://127.0.0.1:9000 for a local MinIO)")
    with pytest.raises(ConfigError) as info:
        S3Config(endpoint_url="ftp://h")
    assert str(info.value) == ("endpoint_url='ftp://h' is not a URL with a scheme; set it to an http:// or "
                               "https:// URL (e.g. http://127.0.0.1:9000 for a local MinIO)")


@pytest.mark.parametrize("profile", ["", "  "])
def test_empty_profile_is_refused(profile):
    with pytest.raises(ConfigError) as info:
        S3Config(profile=profile)
    assert str(info.value) == "profile is empty; give a profile name or None (AWS_PROFILE or 'default')"
    assert S3Config(profile="work").profile == "work"


def test_explicit_bad_endpoint_names_the_field():
    with pytest.raises(ConfigError, match=r"^endpoint_url='localhost:9000' .*'http://localhost:9000'"):
        S3Config(endpoint_url="localhost:9000")


@given(
    host=st.from_regex(r"[a-z][a-z0-9\-]{0,15}(\.[a-z0-9\-]{1,10}){0,3}", fullmatch=True),
    port=st.integers(1, 65535),
    scheme=st.sampled_from(["http", "https"]),
    slash=st.booleans(),
)
def test_any_host_port_endpoint_round_trips(host, port, scheme, slash):
    url = f"{scheme}://{host}:{port}"
    assert S3Config(endpoint_url=url + ("/" if slash else "")).endpoint_url == url
    with pytest.raises(ConfigError, match=re.escape(f"set it to 'http://{host}:{port}'")):
        S3Config(endpoint_url=f"{host}:{port}")


# ------------------------------------------------------------------------------ MinIO names


@pytest.mark.parametrize("secure", [None, "", "false", "False", "0", "no", "off", " OFF "])
def test_minio_endpoint_without_scheme_is_http_unless_secure(secure):
    env = {"MINIO_ENDPOINT": "localhost:9000"}
    if secure is not None:
        env["MINIO_SECURE"] = secure
    assert S3Config.from_env(env).endpoint_url == "http://localhost:9000"


@pytest.mark.parametrize("secure", ["true", "TRUE", "True", "1", "yes", "on", " true "])
def test_minio_secure_true_gives_https(secure):
    env = {"MINIO_ENDPOINT": "minio.example.com:9000", "MINIO_SECURE": secure}
    assert S3Config.from_env(env).endpoint_url == "https://minio.example.com:9000"


@pytest.mark.parametrize("secure", ["maybe", "2", "enabled", "tru"])
def test_minio_secure_garbage_names_the_variable_and_the_fix(secure):
    with pytest.raises(
        ConfigError,
        match=rf"^MINIO_SECURE={re.escape(repr(secure))} is not a boolean; use 'true' or 'false'$",
    ):
        S3Config.from_env({"MINIO_ENDPOINT": "localhost:9000", "MINIO_SECURE": secure})


def test_minio_secure_is_ignored_without_minio_endpoint():
    assert S3Config.from_env({"MINIO_SECURE": "garbage"}).endpoint_url is None


@pytest.mark.parametrize(
    ("value", "secure", "expected"),
    [
        ("http://localhost:9000", None, "http://localhost:9000"),
        ("https://minio.example.com", None, "https://minio.example.com"),
        ("http://localhost:9000/", "true", "http://localhost:9000"),  # an explicit scheme wins
        ("https://minio.example.com", "false", "https://minio.example.com"),
    ],
)
def test_minio_endpoint_with_scheme_keeps_it(value, secure, expected):
    env = {"MINIO_ENDPOINT": value}
    if secure is not None:
        env["MINIO_SECURE"] = secure
    assert S3Config.from_env(env).endpoint_url == expected


def test_minio_endpoint_with_a_path_names_minio_endpoint():
    with pytest.raises(ConfigError, match=r"^MINIO_ENDPOINT='http://localhost:9000/bucket' has a path"):
        S3Config.from_env({"MINIO_ENDPOINT": "localhost:9000/bucket"})


def test_minio_endpoint_with_a_bad_scheme_names_minio_endpoint():
    with pytest.raises(ConfigError, match=r"^MINIO_ENDPOINT='ftp://host' is not a URL with a scheme"):
        S3Config.from_env({"MINIO_ENDPOINT": "ftp://host"})


# ------------------------------------------------------------------------------ credentials


def test_aws_credentials_are_read():
    cfg = S3Config.from_env(creds(AWS_SESSION_TOKEN=TOKEN))
    assert cfg.access_key_id == ACCESS
    assert cfg.secret_access_key == SECRET
    assert cfg.session_token == TOKEN
    assert cfg.has_credentials


@pytest.mark.parametrize(
    ("user", "password"),
    [("MINIO_ACCESS_KEY", "MINIO_SECRET_KEY"), ("MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD")],
)
def test_minio_credential_names_are_read(user, password):
    cfg = S3Config.from_env({"MINIO_ENDPOINT": "localhost:9000", user: "minioadmin", password: SECRET})
    assert cfg.access_key_id == "minioadmin"
    assert cfg.secret_access_key == SECRET
    assert cfg.session_token is None


def test_aws_credentials_win_over_minio_names():
    env = creds(MINIO_ACCESS_KEY="minio-user", MINIO_SECRET_KEY="minio-pass",
                MINIO_ROOT_USER="root", MINIO_ROOT_PASSWORD="rootpass")
    cfg = S3Config.from_env(env)
    assert (cfg.access_key_id, cfg.secret_access_key) == (ACCESS, SECRET)


def test_minio_access_key_wins_over_root_user():
    env = {"MINIO_ACCESS_KEY": "k", "MINIO_SECRET_KEY": "s",
           "MINIO_ROOT_USER": "root", "MINIO_ROOT_PASSWORD": "rootpass"}
    cfg = S3Config.from_env(env)
    assert (cfg.access_key_id, cfg.secret_access_key) == ("k", "s")


def test_credentials_from_mixed_names_pair_up():
    cfg = S3Config.from_env({"AWS_ACCESS_KEY_ID": ACCESS, "MINIO_SECRET_KEY": SECRET})
    assert (cfg.access_key_id, cfg.secret_access_key) == (ACCESS, SECRET)


@pytest.mark.parametrize(
    ("env", "missing"),
    [
        ({"AWS_ACCESS_KEY_ID": ACCESS}, "AWS_SECRET_ACCESS_KEY"),
        ({"MINIO_ACCESS_KEY": ACCESS}, "AWS_SECRET_ACCESS_KEY"),
        ({"MINIO_ROOT_USER": ACCESS}, "AWS_SECRET_ACCESS_KEY"),
        ({"AWS_SECRET_ACCESS_KEY": SECRET}, "AWS_ACCESS_KEY_ID"),
        ({"MINIO_SECRET_KEY": SECRET}, "AWS_ACCESS_KEY_ID"),
        ({"AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": ""}, "AWS_SECRET_ACCESS_KEY"),
        ({"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": SECRET}, "AWS_ACCESS_KEY_ID"),
    ],
)
def test_partial_credentials_name_the_missing_variable(env, missing):
    with pytest.raises(
        ConfigError, match=rf"^{missing} is not set while its partner is; set both or neither$"
    ) as info:
        S3Config.from_env({**env, "AWS_SESSION_TOKEN": TOKEN})
    assert_no_secret(str(info.value))


def test_empty_credentials_count_as_unset():
    cfg = S3Config.from_env({"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SESSION_TOKEN": ""})
    assert cfg.access_key_id is None and cfg.secret_access_key is None and cfg.session_token is None


@pytest.mark.parametrize(
    ("kwargs", "given"),
    [({"access_key_id": ACCESS}, "access_key_id"), ({"secret_access_key": SECRET}, "secret_access_key")],
)
def test_explicit_partial_credentials(kwargs, given):
    with pytest.raises(
        ConfigError,
        match=rf"^only {given} is set; give both the access key id and the secret access key "
        r"\(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY\)$",
    ) as info:
        S3Config(**kwargs)
    assert_no_secret(str(info.value))


@pytest.mark.parametrize("field", ["access_key_id", "secret_access_key"])
def test_explicit_empty_key_is_refused(field):
    keys = {"access_key_id": ACCESS, "secret_access_key": SECRET, field: ""}
    with pytest.raises(ConfigError) as info:
        S3Config(**keys)
    assert str(info.value) == (f"{field} is empty; give both keys, or leave both None to look "
                               "credentials up the way boto3 does")
    assert_no_secret(str(info.value))


# ------------------------------------------------------------------------------ region, token, CA


@pytest.mark.parametrize(
    ("env", "region"),
    [
        ({}, DEFAULT_REGION),
        ({"AWS_REGION": "eu-west-1"}, "eu-west-1"),
        ({"AWS_DEFAULT_REGION": "ap-south-1"}, "ap-south-1"),
        ({"AWS_REGION": "eu-west-1", "AWS_DEFAULT_REGION": "ap-south-1"}, "eu-west-1"),
        ({"AWS_REGION": "", "AWS_DEFAULT_REGION": "ap-south-1"}, "ap-south-1"),
        ({"AWS_REGION": "", "AWS_DEFAULT_REGION": ""}, DEFAULT_REGION),
    ],
)
def test_region_precedence(env, region):
    assert S3Config.from_env(env).region == region


def test_explicit_empty_region_names_the_variable():
    with pytest.raises(ConfigError, match=r"^region is empty; set AWS_REGION \(e\.g\. 'us-east-1'\)$"):
        S3Config(region="")


def test_session_token_alone_is_kept():
    cfg = S3Config.from_env({"AWS_SESSION_TOKEN": TOKEN})
    assert cfg.session_token == TOKEN
    assert not cfg.has_credentials


def test_ca_bundle_sets_verify():
    assert S3Config.from_env({"AWS_CA_BUNDLE": "/etc/ssl/my-ca.pem"}).verify == "/etc/ssl/my-ca.pem"
    assert S3Config.from_env({"AWS_CA_BUNDLE": ""}).verify is True


# ------------------------------------------------------------------------------ addressing


@pytest.mark.parametrize(
    ("endpoint", "style", "expected"),
    [
        (None, "auto", False),
        (None, "virtual", False),
        (None, "path", True),
        ("http://localhost:9000", "auto", True),
        ("http://localhost:9000", "path", True),
        ("http://localhost:9000", "virtual", False),
        ("https://s3.us-east-1.amazonaws.com", "auto", True),
    ],
)
def test_path_style(endpoint, style, expected):
    assert S3Config(endpoint_url=endpoint, addressing_style=style).path_style is expected


def test_custom_endpoint_from_env_is_path_style():
    assert S3Config.from_env({"MINIO_ENDPOINT": "localhost:9000"}).path_style
    assert S3Config.from_env({"AWS_ENDPOINT_URL": "http://seaweed:8333"}).path_style
    assert not S3Config.from_env({"AWS_REGION": "eu-west-1"}).path_style


@pytest.mark.parametrize("style", ["sideways", "Path", "", None])
def test_bad_addressing_style(style):
    with pytest.raises(
        ConfigError,
        match=rf"^addressing_style={re.escape(repr(style))} is not one of 'auto', 'path', 'virtual'$",
    ):
        S3Config(addressing_style=style)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ to_env


def test_to_env_of_defaults_is_only_the_region():
    assert S3Config().to_env() == {"AWS_REGION": DEFAULT_REGION}


def test_to_env_contents():
    cfg = S3Config(endpoint_url="http://localhost:9000", region="eu-west-1", access_key_id=ACCESS,
                   secret_access_key=SECRET, session_token=TOKEN, verify="/ca.pem")
    assert cfg.to_env() == {
        "AWS_REGION": "eu-west-1",
        "AWS_ENDPOINT_URL": "http://localhost:9000",
        "AWS_ACCESS_KEY_ID": ACCESS,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_SESSION_TOKEN": TOKEN,
        "AWS_CA_BUNDLE": "/ca.pem",
    }


def test_to_env_of_a_minio_config_uses_aws_names():
    cfg = S3Config.from_env({"MINIO_ENDPOINT": "localhost:9000", "MINIO_ROOT_USER": "u",
                             "MINIO_ROOT_PASSWORD": "p", "MINIO_SECURE": "true"})
    assert cfg.to_env() == {"AWS_REGION": DEFAULT_REGION, "AWS_ENDPOINT_URL": "https://localhost:9000",
                            "AWS_ACCESS_KEY_ID": "u", "AWS_SECRET_ACCESS_KEY": "p"}
    assert S3Config.from_env(cfg.to_env()) == cfg


_words = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40)


@given(
    endpoint=st.one_of(st.none(), st.sampled_from(
        ["http://localhost:9000", "https://s3.example.com", "http://10.0.0.1:8333", "http://[::1]:9000"]
    )),
    region=st.from_regex(r"[a-z]{2}-[a-z]{4,9}-[1-9]", fullmatch=True),
    keys=st.one_of(st.none(), st.tuples(_words, _words)),
    token=st.one_of(st.none(), _words),
    verify=st.one_of(st.just(True), st.sampled_from(["/etc/ssl/ca.pem", "ca bundle.pem"])),
)
def test_from_env_of_to_env_rebuilds_the_config(endpoint, region, keys, token, verify):
    access, secret = keys if keys else (None, None)
    cfg = S3Config(endpoint_url=endpoint, region=region, access_key_id=access,
                   secret_access_key=secret, session_token=token, verify=verify)
    assert S3Config.from_env(cfg.to_env()) == cfg


# ------------------------------------------------------------------------------ secrets


def full_config() -> S3Config:
    return S3Config(endpoint_url="http://localhost:9000", access_key_id=ACCESS,
                    secret_access_key=SECRET, session_token=TOKEN)


@pytest.mark.parametrize("render", [repr, str, "{}".format, "{!r}".format, lambda c: f"{[c]}"])
def test_secrets_never_appear_when_rendered(render):
    text = render(full_config())
    assert_no_secret(text)
    assert ACCESS not in text
    assert "credentials=<set>" in text and "session_token=<set>" in text
    assert "http://localhost:9000" in text


def test_repr_says_unset_without_credentials():
    text = repr(S3Config())
    assert "credentials=<unset>" in text and "session_token" not in text
    assert text == (
        "S3Config(endpoint_url=None, region='us-east-1', credentials=<unset>, "
        "addressing_style='auto', verify=True)"
    )


def test_repr_of_a_full_config():
    cfg = dataclasses.replace(full_config(), profile="work")
    assert repr(cfg) == (
        "S3Config(endpoint_url='http://localhost:9000', region='us-east-1', credentials=<set>, "
        "session_token=<set>, profile='work', addressing_style='auto', verify=True)"
    )


def test_repr_of_a_from_env_config_hides_secrets():
    assert_no_secret(repr(S3Config.from_env(creds(AWS_SESSION_TOKEN=TOKEN))))


@pytest.mark.parametrize(
    "env",
    [
        {"AWS_ENDPOINT_URL": "localhost:9000"},
        {"AWS_ENDPOINT_URL": "http://localhost:9000/bucket"},
        {"S3_ENDPOINT_URL": "http://h:port"},
        {"MINIO_ENDPOINT": "localhost:9000", "MINIO_SECURE": "perhaps"},
        {"MINIO_ENDPOINT": "ftp://x"},
    ],
)
def test_secrets_never_appear_in_errors_about_other_variables(env):
    with pytest.raises(ConfigError) as info:
        S3Config.from_env(creds(AWS_SESSION_TOKEN=TOKEN, **env))
    assert_no_secret(str(info.value))
    assert_no_secret(repr(info.value))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"endpoint_url": "localhost:9000"},
        {"endpoint_url": "http://h/p"},
        {"addressing_style": "sideways"},
        {"region": ""},
    ],
)
def test_secrets_never_appear_in_errors_about_other_fields(kwargs):
    with pytest.raises(ConfigError) as info:
        S3Config(access_key_id=ACCESS, secret_access_key=SECRET, session_token=TOKEN, **kwargs)
    assert_no_secret(str(info.value))


def test_secrets_never_appear_in_log_records(caplog):
    caplog.set_level(logging.DEBUG)
    env = creds(AWS_SESSION_TOKEN=TOKEN, AWS_ENDPOINT_URL="http://localhost:9000")
    cfg = S3Config.from_env(env)
    S3Config(endpoint_url="http://localhost:9000", access_key_id=ACCESS, secret_access_key=SECRET,
             session_token=TOKEN)
    logging.getLogger("loader").debug("config: %r", cfg)  # how a caller would log it
    with pytest.raises(ConfigError):
        S3Config.from_env({**env, "AWS_ENDPOINT_URL": "bad:1"})
    assert caplog.records, "the explicit debug record should have been captured"
    for record in caplog.records:
        assert_no_secret(record.getMessage())
    assert_no_secret(caplog.text)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickling_keeps_the_secrets(protocol):
    """DataLoader workers rebuild the store from the pickled config, so nothing may be dropped."""
    cfg = full_config()
    back = pickle.loads(pickle.dumps(cfg, protocol=protocol))
    assert back == cfg
    assert back.secret_access_key == SECRET
    assert back.session_token == TOKEN
    assert back.access_key_id == ACCESS
    assert back.path_style


def test_copies_keep_the_secrets_and_equal_configs_hash_alike():
    cfg = full_config()
    assert copy.deepcopy(cfg) == cfg and copy.copy(cfg) == cfg
    assert hash(cfg) == hash(full_config())
    assert dataclasses.replace(cfg, region="eu-west-1").secret_access_key == SECRET
