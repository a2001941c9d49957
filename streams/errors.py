"""Kafka failures in one line: what aiokafka raises for security problems, mapped to a ``KafkaError`` that
names the cause and what to do (the CLI prints KafkaError without a traceback).

aiokafka reports a failed bootstrap only as "Unable to bootstrap from [...]" and logs the reason; ``explain``
then opens one connection to each bootstrap server with the same settings to find the reason itself
(TLS verification, SASL credentials, or nothing listening).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from typing import Any

from aiokafka import errors as ak

from streams.kafka_errors import KafkaAccessError, KafkaError, KafkaUnreachable


def principal(client_kwargs: Mapping[str, Any]) -> str:
    user = client_kwargs.get("sasl_plain_username")
    return f"User:{user}" if user else "User:ANONYMOUS"


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def explain_now(e: BaseException, client_kwargs: Mapping[str, Any]) -> KafkaError | None:
    """The one-line KafkaError for a security failure ``e``, or None when ``e`` is none of them."""
    who = principal(client_kwargs)
    servers = client_kwargs.get("bootstrap_servers")
    if isinstance(e, KafkaError):
        return e
    if isinstance(e, ssl.SSLCertVerificationError):
        return KafkaAccessError(
            f"TLS: the certificate of the Kafka broker at {servers} is not trusted ({e.verify_message}): set "
            "ROLLOUT_KAFKA_SSL_CAFILE to the CA that signed the brokers' certificates")
    if isinstance(e, ssl.SSLError):
        return KafkaAccessError(f"TLS handshake with the Kafka broker at {servers} failed ({_first_line(e)}): check that "
                          "the listener speaks SSL/SASL_SSL and ROLLOUT_KAFKA_SSL_* are right")
    if isinstance(e, ak.SaslAuthenticationFailed):
        return KafkaAccessError(
            f"SASL authentication of {who} ({client_kwargs.get('sasl_mechanism')}) at {servers} failed: check "
            "ROLLOUT_KAFKA_SASL_USERNAME / ROLLOUT_KAFKA_SASL_PASSWORD and ROLLOUT_KAFKA_SASL_MECHANISM")
    if isinstance(e, ak.UnsupportedSaslMechanismError):
        return KafkaAccessError(f"the Kafka broker at {servers} does not accept SASL mechanism "
                          f"{client_kwargs.get('sasl_mechanism')}: set ROLLOUT_KAFKA_SASL_MECHANISM to one it enables")
    for denied, (what, more) in _DENIED.items():
        if isinstance(e, denied):
            return KafkaAccessError(f"{who} {what} {_args(e)}: grant it with `rollout kafka acls --apply`{more}")
    if isinstance(e, ak.ClusterAuthorizationFailedError):
        return KafkaAccessError(f"{who} lacks a cluster permission for this request ({_first_line(e)}): use an admin "
                          "principal (a super user) for it")
    return None


# an ACL refusal -> what the principal may not do (the resource follows), and any further advice
_DENIED = {
    ak.TopicAuthorizationFailedError: ("is not allowed this on topic(s)", " (as an admin) or fix the principal's ACLs"),
    ak.GroupAuthorizationFailedError: ("may not use consumer group", ""),
    ak.TransactionalIdAuthorizationFailed: ("may not use transactional id", ""),
}


def _args(e: BaseException) -> str:
    args = [str(a) for a in getattr(e, "args", ()) if a]
    return ", ".join(args) or "(not named by the broker)"


async def diagnose(e: BaseException, client_kwargs: Mapping[str, Any]) -> KafkaError:
    """``explain_now``, and for an opaque bootstrap failure (aiokafka's, or our ``KafkaUnreachable`` wrapping it)
    the reason found by connecting once more."""
    opaque = (ak.KafkaConnectionError, OSError, asyncio.TimeoutError, KafkaUnreachable)
    known = None if isinstance(e, KafkaUnreachable) else explain_now(e, client_kwargs)
    if known is not None:
        return known
    if isinstance(e, opaque):
        from aiokafka.conn import create_conn

        kw = dict(client_kwargs)
        reasons = []
        for server in str(kw.get("bootstrap_servers", "")).split(","):
            host, _, port = server.strip().rpartition(":")
            try:
                conn = await asyncio.wait_for(create_conn(
                    host, int(port), ssl_context=kw.get("ssl_context"),
                    security_protocol=kw.get("security_protocol", "PLAINTEXT"),
                    sasl_mechanism=kw.get("sasl_mechanism", "PLAIN"),
                    sasl_plain_username=kw.get("sasl_plain_username"),
                    sasl_plain_password=kw.get("sasl_plain_password")), 10)
                conn.close()
            except Exception as probe:  # noqa: BLE001 - the reason we are looking for
                found = explain_now(probe, client_kwargs)
                if found is not None:
                    return found
                reasons.append(f"{server}: {_first_line(probe)}")
        why = "; ".join(reasons) or _first_line(e)
        return KafkaUnreachable(f"cannot reach Kafka at {kw.get('bootstrap_servers')}: {why}")
    return KafkaError(f"Kafka: {type(e).__name__}: {_first_line(e)}")
