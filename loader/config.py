"""Where the object store is and how to sign requests to it: ``S3Config``.

The same training script runs against AWS S3, MinIO or the embedded server because everything
comes from the environment by default (``S3Config.from_env()``); an explicit ``S3Config`` wins.
Validation happens here, before any I/O, so a typo surfaces as a ``ConfigError`` naming the
variable rather than as a DNS failure deep inside botocore. Secrets never appear in ``repr``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Literal
from urllib.parse import urlsplit

from .errors import ConfigError

DEFAULT_REGION = "us-east-1"
AddressingStyle = Literal["auto", "path", "virtual"]
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class S3Config:
    """Endpoint, region, credentials and addressing for one S3-compatible service.

    ``endpoint_url=None`` means AWS S3 itself. Keys left as ``None`` are looked up the way boto3
    looks them up, for custom endpoints too: the environment, then ``profile`` (else
    ``AWS_PROFILE``, else ``default``) in the shared credentials and config files (keys, roles,
    ``credential_process``, SSO), then web identity, container and instance-metadata credentials
    (see ``loader.s3.credentials``). Custom endpoints default to path-style addressing, which
    is what MinIO, SeaweedFS, Ceph and ``localhost`` need (virtual-host style would put the
    bucket into the host name).
    """

    endpoint_url: str | None = None
    region: str = DEFAULT_REGION
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    addressing_style: AddressingStyle = "auto"
    verify: bool | str = True
    profile: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint_url is not None:
            object.__setattr__(self, "endpoint_url", _check_endpoint(self.endpoint_url, "endpoint_url"))
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise ConfigError(
                f"addressing_style={self.addressing_style!r} is not one of 'auto', 'path', 'virtual'"
            )
        if self.profile is not None and not self.profile.strip():
            raise ConfigError("profile is empty; give a profile name or None (AWS_PROFILE or 'default')")
        if not self.region:
            raise ConfigError("region is empty; set AWS_REGION (e.g. 'us-east-1')")
        for field in ("access_key_id", "secret_access_key"):
            if getattr(self, field) == "":
                raise ConfigError(
                    f"{field} is empty; give both keys, or leave both None to look credentials up "
                    "the way boto3 does"
                )
        if (self.access_key_id is None) != (self.secret_access_key is None):
            given = "access_key_id" if self.access_key_id is not None else "secret_access_key"
            raise ConfigError(
                f"only {given} is set; give both the access key id and the secret access key "
                "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
            )

    @property
    def path_style(self) -> bool:
        """Whether requests put the bucket in the path (``http://host/bucket/key``)."""
        if self.addressing_style == "auto":
            return self.endpoint_url is not None
        return self.addressing_style == "path"

    @property
    def has_credentials(self) -> bool:
        """Whether keys are given here (else the stores look them up the way boto3 does)."""
        return self.access_key_id is not None

    def __repr__(self) -> str:
        key = "set" if self.access_key_id else "unset"
        token = ", session_token=<set>" if self.session_token else ""
        profile = f", profile={self.profile!r}" if self.profile is not None else ""
        return (
            f"S3Config(endpoint_url={self.endpoint_url!r}, region={self.region!r}, "
            f"credentials=<{key}>{token}{profile}, addressing_style={self.addressing_style!r}, "
            f"verify={self.verify!r})"
        )

    __str__ = __repr__

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> S3Config:
        """Read the AWS variables, then MinIO's names for whatever AWS's left unset.

        ``AWS_PROFILE`` is not copied into ``profile``: botocore reads it itself, and keys in the
        environment win over it, as they do for boto3 (an explicit ``profile=`` wins over them).
        """
        env = os.environ if environ is None else environ

        endpoint = None
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL"):
            if env.get(name):
                endpoint = _check_endpoint(env[name], name)
                break
        if endpoint is None and env.get("MINIO_ENDPOINT"):
            endpoint = _minio_endpoint(env["MINIO_ENDPOINT"], env.get("MINIO_SECURE"))

        access = env.get("AWS_ACCESS_KEY_ID") or env.get("MINIO_ACCESS_KEY") or env.get("MINIO_ROOT_USER")
        secret = (
            env.get("AWS_SECRET_ACCESS_KEY")
            or env.get("MINIO_SECRET_KEY")
            or env.get("MINIO_ROOT_PASSWORD")
        )
        if bool(access) != bool(secret):
            missing = "AWS_SECRET_ACCESS_KEY" if access else "AWS_ACCESS_KEY_ID"
            raise ConfigError(f"{missing} is not set while its partner is; set both or neither")

        verify: bool | str = True
        if env.get("AWS_CA_BUNDLE"):
            verify = env["AWS_CA_BUNDLE"]
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or DEFAULT_REGION
        return cls(
            endpoint_url=endpoint,
            region=region,
            access_key_id=access or None,
            secret_access_key=secret or None,
            session_token=env.get("AWS_SESSION_TOKEN") or None,
            verify=verify,
        )

    def to_env(self) -> dict[str, str]:
        """The variables that make ``from_env()`` rebuild this config (for ``serve`` to print)."""
        out = {"AWS_REGION": self.region}
        if self.endpoint_url:
            out["AWS_ENDPOINT_URL"] = self.endpoint_url
        if self.access_key_id is not None:
            assert self.secret_access_key is not None  # __post_init__: both keys or neither
            out["AWS_ACCESS_KEY_ID"] = self.access_key_id
            out["AWS_SECRET_ACCESS_KEY"] = self.secret_access_key
        if self.session_token:
            out["AWS_SESSION_TOKEN"] = self.session_token
        if isinstance(self.verify, str):
            out["AWS_CA_BUNDLE"] = self.verify
        return out


def resolve_config(config: S3Config | None) -> S3Config:
    """An explicit config wins; otherwise the environment decides."""
    return config if config is not None else S3Config.from_env()


def _check_endpoint(value: str, name: str) -> str:
    value = value.strip()
    if "@" in value:  # user:password@host would leak the secret into repr and messages
        raise ConfigError(
            f"{name} contains '@' (credentials in the URL?); give only scheme, host and port and "
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for the credentials"
        )
    try:
        parts = urlsplit(value)
        _ = parts.port  # a non-numeric or out-of-range port raises ValueError here, not in botocore
    except ValueError as exc:
        raise ConfigError(
            f"{name}={value!r} is not a valid URL ({exc}); set it to scheme, host and port "
            "(e.g. http://127.0.0.1:9000 for a local MinIO)"
        ) from exc
    if parts.scheme not in ("http", "https") or not parts.netloc:
        hint = f"'http://{value}'" if "://" not in value else "an http:// or https:// URL"
        raise ConfigError(
            f"{name}={value!r} is not a URL with a scheme; set it to {hint} "
            "(e.g. http://127.0.0.1:9000 for a local MinIO)"
        )
    if parts.path not in ("", "/") or parts.query:
        raise ConfigError(
            f"{name}={value!r} has a path; give only scheme, host and port "
            "(the bucket goes into the s3:// URI, not the endpoint)"
        )
    return f"{parts.scheme}://{parts.netloc}"


def _minio_endpoint(value: str, secure: str | None) -> str:
    if "://" in value:
        return _check_endpoint(value, "MINIO_ENDPOINT")
    flag = (secure or "").strip().lower()
    if flag in _TRUE:
        scheme = "https"
    elif flag in _FALSE:
        scheme = "http"
    else:
        raise ConfigError(f"MINIO_SECURE={secure!r} is not a boolean; use 'true' or 'false'")
    return _check_endpoint(f"{scheme}://{value}", "MINIO_ENDPOINT")
