"""A private CA and a leaf certificate for a lab domain (``trustme``): what an https,
virtual-hosted endpoint on loopback needs, for the dev server and the proxy alike."""

from __future__ import annotations

from pathlib import Path


def lab_certificates(where: Path, domain: str) -> dict[str, str]:
    """``{"ca", "cert", "key"}`` PEM paths under ``where``: a CA, and a leaf for ``domain``,
    ``*.domain`` (its buckets, virtual-hosted) and 127.0.0.1, with its chain."""
    import trustme

    ca = trustme.CA()
    leaf = ca.issue_cert(domain, f"*.{domain}", "127.0.0.1")
    paths = {name: where / f"{name}.pem" for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(paths["ca"])
    leaf.private_key_pem.write_to_path(paths["key"])
    for index, pem in enumerate(leaf.cert_chain_pems):
        pem.write_to_path(paths["cert"], append=index > 0)
    return {name: str(path) for name, path in paths.items()}
