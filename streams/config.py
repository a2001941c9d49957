"""Kafka connection settings, read from ROLLOUT_* environment variables.

When ROLLOUT_BOOTSTRAP_SERVERS is set, every component talks to that cluster and nothing local is
started. Otherwise the local single-node broker (streams.local_broker) is used, on
localhost:$ROLLOUT_KAFKA_PORT (default 9092).

    ROLLOUT_BOOTSTRAP_SERVERS         host:port[,host:port...] of an existing cluster
    ROLLOUT_KAFKA_SECURITY_PROTOCOL   PLAINTEXT (default) | SSL | SASL_PLAINTEXT | SASL_SSL
    ROLLOUT_KAFKA_SASL_MECHANISM      PLAIN (default) | SCRAM-SHA-256 | SCRAM-SHA-512
    ROLLOUT_KAFKA_SASL_USERNAME / ROLLOUT_KAFKA_SASL_PASSWORD
    ROLLOUT_KAFKA_SSL_CAFILE          CA bundle to verify the brokers (default: system CAs)
    ROLLOUT_KAFKA_SSL_CERTFILE / ROLLOUT_KAFKA_SSL_KEYFILE / ROLLOUT_KAFKA_SSL_KEY_PASSWORD  (mTLS)
    ROLLOUT_KAFKA_SSL_CHECK_HOSTNAME  1 (default) | 0
    ROLLOUT_KAFKA_CLIENT_ID           client.id prefix (default rollout-log)
    ROLLOUT_KAFKA_PORT                port of the local broker (default 9092)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, SecretStr, field_validator

from streams.kafka_errors import KafkaError
from streams.local_broker import DEFAULT_LOCAL_PORT, LocalBroker

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI"]

_ENV = {
    "bootstrap_servers": "ROLLOUT_BOOTSTRAP_SERVERS",
    "security_protocol": "ROLLOUT_KAFKA_SECURITY_PROTOCOL",
    "sasl_mechanism": "ROLLOUT_KAFKA_SASL_MECHANISM",
    "sasl_username": "ROLLOUT_KAFKA_SASL_USERNAME",
    "sasl_password": "ROLLOUT_KAFKA_SASL_PASSWORD",
    "ssl_cafile": "ROLLOUT_KAFKA_SSL_CAFILE",
    "ssl_certfile": "ROLLOUT_KAFKA_SSL_CERTFILE",
    "ssl_keyfile": "ROLLOUT_KAFKA_SSL_KEYFILE",
    "ssl_key_password": "ROLLOUT_KAFKA_SSL_KEY_PASSWORD",
    "ssl_check_hostname": "ROLLOUT_KAFKA_SSL_CHECK_HOSTNAME",
    "client_id": "ROLLOUT_KAFKA_CLIENT_ID",
    "local_port": "ROLLOUT_KAFKA_PORT",
}


class KafkaSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap_servers: str | None = None
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism = "PLAIN"
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_key_password: SecretStr | None = None
    ssl_check_hostname: bool = True
    client_id: str = "rollout-log"
    local_port: int = DEFAULT_LOCAL_PORT

    @field_validator("security_protocol", "sasl_mechanism", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.strip().upper() if isinstance(v, str) else v

    @field_validator("bootstrap_servers", mode="before")
    @classmethod
    def _strip(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = ",".join(p.strip() for p in v.split(",") if p.strip())
            return v or None
        return v

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> KafkaSettings:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {f: env[var] for f, var in _ENV.items() if env.get(var, "") != ""}
        values.update(overrides)
        try:
            return cls(**values)
        except Exception as e:  # pydantic ValidationError: report the env var names, one line
            raise KafkaError(f"invalid Kafka settings in the environment: {_one_line(e)}") from None

    @property
    def external(self) -> bool:
        """True when an existing cluster is configured (ROLLOUT_BOOTSTRAP_SERVERS)."""
        return self.bootstrap_servers is not None

    @property
    def bootstrap(self) -> str:
        return self.bootstrap_servers or f"localhost:{self.local_port}"

    def with_bootstrap(self, bootstrap_servers: str) -> KafkaSettings:
        return self.model_copy(update={"bootstrap_servers": bootstrap_servers})

    def client_kwargs(self, **extra: Any) -> dict[str, Any]:
        """Keyword arguments accepted by AIOKafkaProducer, AIOKafkaConsumer and AIOKafkaAdminClient."""
        kw: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
        }
        if self.security_protocol in ("SSL", "SASL_SSL"):
            from aiokafka.helpers import create_ssl_context

            ctx = create_ssl_context(
                cafile=self.ssl_cafile,
                certfile=self.ssl_certfile,
                keyfile=self.ssl_keyfile,
                password=self.ssl_key_password.get_secret_value() if self.ssl_key_password else None,
            )
            ctx.check_hostname = self.ssl_check_hostname
            kw["ssl_context"] = ctx
        if self.security_protocol.startswith("SASL_"):
            kw["sasl_mechanism"] = self.sasl_mechanism
            if self.sasl_mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
                if not self.sasl_username or self.sasl_password is None:
                    raise KafkaError(
                        f"{self.security_protocol}/{self.sasl_mechanism} needs ROLLOUT_KAFKA_SASL_USERNAME "
                        "and ROLLOUT_KAFKA_SASL_PASSWORD"
                    )
                kw["sasl_plain_username"] = self.sasl_username
                kw["sasl_plain_password"] = self.sasl_password.get_secret_value()
        kw.update(extra)
        return kw

    def admin_kwargs(self, **extra: Any) -> dict[str, Any]:
        return self.client_kwargs(**extra)


def _one_line(e: BaseException) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        parts = []
        for err in errors():
            field = str(err["loc"][0]) if err.get("loc") else "?"
            parts.append(f"{_ENV.get(field, field)}: {err['msg']}")
        return "; ".join(parts)
    return " ".join(str(e).split())


def ensure_broker(settings: KafkaSettings | None = None) -> str:
    """Bootstrap servers to use: the configured cluster, or the local broker (started if needed)."""
    settings = settings or KafkaSettings.from_env()
    if settings.external:
        return settings.bootstrap
    broker = LocalBroker.from_env(port=settings.local_port)
    broker.up()
    return broker.bootstrap


def broker_starting(settings: KafkaSettings) -> tuple[KafkaSettings, Future[str]]:
    """``settings`` with their bootstrap servers, known at once, and ``ensure_broker`` running on a thread: a
    command with other slow work to start (vLLM, a model) awaits the broker only where it first talks to Kafka, so
    a cold local broker's start (seconds of a JVM) overlaps that work instead of preceding it."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="broker-start")
    try:
        return settings.with_bootstrap(settings.bootstrap), pool.submit(ensure_broker, settings)
    finally:
        pool.shutdown(wait=False)  # the thread ends with the start
