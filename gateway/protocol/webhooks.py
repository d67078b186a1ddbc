"""Webhook signatures: Ed25519 over ``<timestamp>.<raw body>``, keys published as a JWKS.

PROTOCOL 7.1, 6.5 and 12.10. Receivers pick the verification key by the ``kid`` of the
``Webhook-Signature`` header from ``GET .../__ds/jwks.json``; ``kid`` is derived from the key
material (an RFC 7638 thumbprint) so every gateway holding the same key publishes the same
kid, and a rotated-in key gets a new one without any registry.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SIGNATURE_HEADER = "Webhook-Signature"
REPLAY_WINDOW_S = 300  # the spec's "small replay window such as five minutes"

# The spec's header shape, strictly: one of each parameter, in this order, nothing else.
_HEADER = re.compile(r"\At=([0-9]{1,15}),kid=([^,\s]{1,200}),ed25519=([A-Za-z0-9_-]{1,200})\Z")


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def key_id(public_raw: bytes) -> str:
    """``ds_`` + the RFC 7638 JWK thumbprint (SHA-256, base64url) of an Ed25519 public key.

    The thumbprint input is the required members in lexicographic order with no whitespace
    (RFC 7638 section 3.2), so any implementation computes the same kid from the same key.
    """
    thumbprint_input = '{"crv":"Ed25519","kty":"OKP","x":"' + _b64url(public_raw) + '"}'
    return "ds_" + _b64url(hashlib.sha256(thumbprint_input.encode("ascii")).digest())


def _public_raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class SigningKey:
    """A webhook signing key: the private half signs, the public half goes in the JWKS."""

    kid: str
    private: Ed25519PrivateKey

    @classmethod
    def _of(cls, private: Ed25519PrivateKey) -> SigningKey:
        return cls(kid=key_id(_public_raw(private.public_key())), private=private)

    @classmethod
    def generate(cls) -> SigningKey:
        """A fresh key (fine for a single dev server; production keeps keys across restarts)."""
        return cls._of(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, data: bytes) -> SigningKey:
        """A key from an unencrypted PKCS#8 PEM (``openssl genpkey -algorithm ed25519``)."""
        try:
            private = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"not an unencrypted PKCS#8 PEM private key: {exc}") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise ValueError(
                f"webhook signing keys must be Ed25519, not {type(private).__name__.lstrip('_')}"
            )
        return cls._of(private)

    def to_pem(self) -> bytes:
        """The private key as an unencrypted PKCS#8 PEM (what from_pem reads)."""
        return self.private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def public_jwk(self) -> dict[str, str]:
        """The public key as the JWK the JWKS endpoint publishes (spec 6.5)."""
        return {
            "kty": "OKP",
            "crv": "Ed25519",
            "kid": self.kid,
            "use": "sig",
            "alg": "EdDSA",
            "x": _b64url(_public_raw(self.private.public_key())),
        }


def signature_header(key: SigningKey, body: bytes, timestamp: int) -> str:
    """The ``Webhook-Signature`` value for a body sent at ``timestamp`` (Unix seconds)."""
    signature = key.private.sign(str(timestamp).encode("ascii") + b"." + body)
    return f"t={timestamp},kid={key.kid},ed25519={_b64url(signature)}"


def jwks(public_jwks: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The JWK Set body of ``GET .../__ds/jwks.json``."""
    return {"keys": list(public_jwks)}


def verify(header: str, body: bytes, jwks: dict[str, Any], now: int, window_s: int = REPLAY_WINDOW_S) -> bool:
    """Whether ``header`` is a valid signature of ``body`` by a key of ``jwks`` made within
    ``window_s`` seconds of ``now`` (the receiver's side; never raises on bad input).

    A receiver must verify the exact bytes it received, before parsing them.
    """
    try:
        match = _HEADER.match(header)
        if match is None:
            return False
        timestamp, kid, signature = match.groups()
        if abs(now - int(timestamp)) > window_s:
            return False
        for jwk in jwks.get("keys", ()):
            if (
                isinstance(jwk, dict)
                and jwk["kid"] == kid
                and jwk.get("kty") == "OKP"
                and jwk.get("crv") == "Ed25519"
                and isinstance(jwk.get("x"), str)
            ):
                public = Ed25519PublicKey.from_public_bytes(_b64url_decode(jwk["x"]))
                public.verify(_b64url_decode(signature), timestamp.encode("ascii") + b"." + body)
                return True
        return False
    except (InvalidSignature, ValueError, TypeError, AttributeError):
        return False
