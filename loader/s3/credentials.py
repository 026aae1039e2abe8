"""Credentials found the way AWS SDKs find them, for every endpoint (custom ones too).

Keys in ``S3Config`` first, then botocore's resolver (environment, profiles with roles,
``credential_process`` and SSO, web identity, container and instance roles), because that is
what users of boto3 and the AWS CLI already have set up. Both backends use what botocore
resolved; ``NoCredentialsError`` lists what was tried. The order in full: docs/design/stores.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any, NamedTuple

from ..config import S3Config
from ..errors import ConfigError, NoCredentialsError

__all__ = ["LIBRARY_ADVICE", "BotocoreCredentialProvider", "GivenKeys", "chain_tried", "credentials_error",
           "no_credentials_found", "resolve_credentials"]

LIBRARY_ADVICE = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE to a profile of "
    "~/.aws/credentials or ~/.aws/config, or pass S3Config(access_key_id=..., "
    "secret_access_key=...) or S3Config(profile=...)"
)


def botocore_session(config: S3Config) -> Any:
    """A plain botocore session for ``config``'s profile (``None``: botocore's own choice)."""
    import botocore.session

    return botocore.session.Session(profile=config.profile)


def resolve_credentials(config: S3Config) -> Any:
    """``botocore.credentials.Credentials`` for ``config``: its keys, else botocore's chain.

    Blocking (the chain may read files, run a ``credential_process`` or ask a metadata service);
    raises ``NoCredentialsError`` when nothing is found and ``ConfigError`` when a source fails.
    """
    if config.has_credentials:  # no botocore: its credentials module costs ~30 ms to import
        return GivenKeys(config.access_key_id or "", config.secret_access_key or "", config.session_token)
    session = botocore_session(config)
    try:
        credentials = session.get_credentials()
    except Exception as exc:
        raise credentials_error(config, exc) from exc
    if credentials is None:
        raise no_credentials_found(config)
    return credentials


class GivenKeys(NamedTuple):
    """Keys given in the config, shaped as botocore's frozen credentials (``access_key``,
    ``secret_key``, ``token``); they never expire, so they are their own frozen form."""

    access_key: str
    secret_key: str
    token: str | None

    def get_frozen_credentials(self) -> GivenKeys:
        return self

    def __repr__(self) -> str:
        return "GivenKeys(<hidden>)"


def credentials_error(config: S3Config, exc: BaseException) -> ConfigError:
    """A credential source that exists but failed (missing profile, failing process, SSO)."""
    from botocore.exceptions import ProfileNotFound

    profile, source = _profile(config, os.environ)
    where = _endpoint(config)
    if isinstance(exc, ProfileNotFound):
        files = _profile_files(os.environ)
        return ConfigError(
            f"profile {profile!r} ({source}) for {where} is in neither {files.replace(' and ', ' nor ')}; "
            f"profiles there: {_known_profiles()}; fix the name or add the profile"
        )
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return ConfigError(
        f"could not get credentials for {where} with profile {profile!r} ({source}): "
        f"{type(exc).__name__}: {detail}"
    )


def no_credentials_found(config: S3Config, environ: Mapping[str, str] | None = None) -> NoCredentialsError:
    """Nothing in the chain had credentials: say what was tried and what to set."""
    where = _endpoint(config)
    tried = tuple(chain_tried(config, environ))
    return NoCredentialsError(
        f"no credentials for {where}: {LIBRARY_ADVICE}. Tried: " + "; ".join(tried),
        endpoint=where, tried=tried,
    )


def chain_tried(config: S3Config, environ: Mapping[str, str] | None = None) -> list[str]:
    """What the chain looked at, in order, one phrase each; names and paths, never values."""
    env = os.environ if environ is None else environ
    profile, source = _profile(config, env)
    web_identity = ("AWS_WEB_IDENTITY_TOKEN_FILE set, no credentials from it"
                    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE") else "AWS_WEB_IDENTITY_TOKEN_FILE unset")
    container = ("none from AWS_CONTAINER_CREDENTIALS_*"
                 if _any(env, "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                         "AWS_CONTAINER_CREDENTIALS_FULL_URI")
                 else "AWS_CONTAINER_CREDENTIALS_* unset")
    tried = [
        ("the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, MINIO_ACCESS_KEY / "
         "MINIO_SECRET_KEY: unset)"),
        (f"profile {profile!r} ({source}) in {_profile_files(env)}: no keys, credential_process, "
         "SSO or role there"),
        f"web identity ({web_identity})",
        f"container credentials ({container})",
    ]
    if env.get("AWS_EC2_METADATA_DISABLED", "").strip().lower() == "true":
        tried.append("instance metadata (skipped: AWS_EC2_METADATA_DISABLED=true)")
    else:
        timeout = env.get("AWS_METADATA_SERVICE_TIMEOUT") or "1"
        tried.append(f"instance metadata (no credentials within {timeout} s)")
    return tried


class BotocoreCredentialProvider:
    """obstore's ``credential_provider``: what botocore resolved, refreshed as botocore would.

    Hand-written rather than ``obstore.auth.boto3.Boto3CredentialProvider``, which tells obstore
    that every answer lives for a fixed 30 minutes, past the expiry of shorter temporary
    credentials. Here each answer carries the credentials' own expiry (``None`` for permanent
    keys: obstore then asks once), and obstore asks again ``refresh_threshold`` before it, when
    botocore's ``get_frozen_credentials()`` refreshes them (a process, STS, SSO or IMDS).
    The repr hides the keys, and the object refuses to be pickled.
    """

    # botocore refreshes temporary credentials once they are within 15 minutes of expiring
    # (its "advisory" window); obstore asking from then on gets the refreshed ones.
    refresh_threshold = timedelta(minutes=15)

    __slots__ = ("_credentials",)

    def __init__(self, credentials: Any) -> None:
        self._credentials = credentials

    def __call__(self) -> dict[str, Any]:
        frozen = self._credentials.get_frozen_credentials()  # refreshes temporary ones when due
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": _expiry(self._credentials),
        }

    def __repr__(self) -> str:
        return "BotocoreCredentialProvider(<hidden>)"

    def __reduce__(self) -> Any:
        raise TypeError("credentials are not picklable")


def _expiry(credentials: Any) -> datetime | None:
    # RefreshableCredentials keep their expiry in ``_expiry_time`` (no public accessor);
    # plain Credentials have none and never expire. obstore accepts only ``timezone.utc``
    # (botocore's is dateutil's ``tzutc()``).
    expiry = getattr(credentials, "_expiry_time", None)
    if expiry is None:
        return None
    if expiry.tzinfo is None:
        return expiry.replace(tzinfo=timezone.utc)
    return expiry.astimezone(timezone.utc)


def _endpoint(config: S3Config) -> str:
    return f"endpoint {config.endpoint_url!r}" if config.endpoint_url else "AWS S3"


def _profile(config: S3Config, env: Mapping[str, str]) -> tuple[str, str]:
    if config.profile:
        return config.profile, "S3Config.profile"
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        if env.get(name):
            return env[name], name
    return "default", "no AWS_PROFILE"


def _profile_files(env: Mapping[str, str]) -> str:
    credentials = env.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials"
    config = env.get("AWS_CONFIG_FILE") or "~/.aws/config"
    return f"{_describe_file(credentials)} and {_describe_file(config)}"


def _describe_file(path: str) -> str:
    return path if os.path.exists(os.path.expanduser(path)) else f"{path} (missing)"


def _known_profiles() -> str:
    import botocore.session

    try:
        names = sorted(botocore.session.Session().available_profiles)
    except Exception:  # noqa: BLE001 - only for the message
        return "(unreadable)"
    return ", ".join(repr(n) for n in names) if names else "none"


def _any(env: Mapping[str, str], *names: str) -> bool:
    return any(env.get(name) for name in names)
