"""Security of the local test bed: a private CA, certificates, SASL users, client settings.

Theory of operation
-------------------
``TestbedSecurity.create(dir, protocol)`` makes everything a secured cluster and
its clients need, once, under ``dir`` (files 0600 where they hold a key or a
password): a CA (trustme, on top of ``cryptography``), a broker certificate for
the brokers' addresses, a proxy certificate for every address a proxy node may
serve (its own and the ones it stands in on: one certificate names them all), a
client certificate for mTLS, and a generated SCRAM/PLAIN password. Nothing is
fixed in the repository: each test bed has its own CA and password.

``broker_props`` is what a broker's listener needs (PEM stores, SCRAM users are
added at format time by ``format_args``, PLAIN and OAUTHBEARER in Kafka's
unsecured-token mode), ``client`` is what one client needs to reach it, in the
words of each client family (``ClientSecurity.confluent()`` ...).
"""

from __future__ import annotations

import datetime
import enum
import json
import os
import secrets
import ssl
from pathlib import Path
from typing import Any

import attrs

SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
MECHANISMS = ("PLAIN", *SCRAM_MECHANISMS, "OAUTHBEARER")
DEFAULT_MECHANISM = "SCRAM-SHA-512"
USER = "kproxy"
STATE_FILE = "security.json"
UPSTREAM_PASSWORD_ENV = "KPROXY_UPSTREAM_PASSWORD"


class Protocol(enum.Enum):
    """Kafka's security.protocol values."""

    PLAINTEXT = "PLAINTEXT"
    SSL = "SSL"
    SASL_PLAINTEXT = "SASL_PLAINTEXT"
    SASL_SSL = "SASL_SSL"

    @classmethod
    def parse(cls, value: str) -> "Protocol":
        return cls(value.upper())

    @property
    def tls(self) -> bool:
        return self in (Protocol.SSL, Protocol.SASL_SSL)

    @property
    def sasl(self) -> bool:
        return self in (Protocol.SASL_PLAINTEXT, Protocol.SASL_SSL)


SECURITY_CHOICES = tuple(p.value.lower() for p in Protocol)  # the CLI's --security values


@attrs.frozen
class CertFiles:
    """A PEM certificate chain and its key (``bundle``: both in one file, as Java's PEM keystore wants)."""

    cert: Path
    key: Path
    bundle: Path


@attrs.frozen
class ClientSecurity:
    """What one client needs to reach a listener: its protocol, the CA to trust, SASL
    credentials, an optional client certificate (mTLS). ``check_hostname`` off only
    for tests that mean it."""

    protocol: Protocol
    ca: Path | None = None
    mechanism: str = DEFAULT_MECHANISM
    username: str = USER
    password: str = attrs.field(default="", repr=False)
    client_cert: CertFiles | None = None
    check_hostname: bool = True

    def with_cert(self, cert: CertFiles | None) -> "ClientSecurity":
        return attrs.evolve(self, client_cert=cert)

    def with_mechanism(self, mechanism: str) -> "ClientSecurity":
        return attrs.evolve(self, mechanism=mechanism)

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.protocol.tls:
            return None
        ctx = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
        ctx.check_hostname = self.check_hostname
        if self.client_cert is not None:
            ctx.load_cert_chain(self.client_cert.cert, self.client_cert.key)
        return ctx

    def confluent(self) -> dict[str, Any]:
        """librdkafka (confluent-kafka) settings."""
        out: dict[str, Any] = {"security.protocol": self.protocol.value}
        if self.protocol.tls:
            out["ssl.ca.location"] = str(self.ca)
            out["ssl.endpoint.identification.algorithm"] = "https" if self.check_hostname else "none"
            if self.client_cert is not None:
                out["ssl.certificate.location"] = str(self.client_cert.cert)
                out["ssl.key.location"] = str(self.client_cert.key)
        if self.protocol.sasl:
            out["sasl.mechanisms"] = self.mechanism
            if self.mechanism == "OAUTHBEARER":
                out["enable.sasl.oauthbearer.unsecure.jwt"] = True
                out["sasl.oauthbearer.config"] = f"principal={self.username}"
            else:
                out["sasl.username"] = self.username
                out["sasl.password"] = self.password
        return out

    def kafka_python(self) -> dict[str, Any]:
        """kafka-python settings: the same keys as aiokafka's."""
        return self.aiokafka()

    def aiokafka(self) -> dict[str, Any]:
        """aiokafka settings (an ``ssl.SSLContext`` is built here)."""
        out: dict[str, Any] = {"security_protocol": self.protocol.value}
        if self.protocol.tls:
            out["ssl_context"] = self.ssl_context()
        if self.protocol.sasl:
            out.update(self._python_sasl())
        return out

    def _python_sasl(self) -> dict[str, Any]:
        if self.mechanism == "OAUTHBEARER":
            raise ValueError("the Python client families need a token provider for OAUTHBEARER; "
                             "use confluent-kafka or the Java tools")
        return {"sasl_mechanism": self.mechanism, "sasl_plain_username": self.username,
                "sasl_plain_password": self.password}

    def java(self) -> dict[str, str]:
        """Java client properties (Kafka's tools: ``--command-config``, ``--producer.config`` ...)."""
        out = {"security.protocol": self.protocol.value}
        if self.protocol.tls:
            out["ssl.truststore.type"] = "PEM"
            out["ssl.truststore.location"] = str(self.ca)
            if not self.check_hostname:
                out["ssl.endpoint.identification.algorithm"] = ""
            if self.client_cert is not None:
                out["ssl.keystore.type"] = "PEM"
                out["ssl.keystore.location"] = str(self.client_cert.bundle)
        if self.protocol.sasl:
            out["sasl.mechanism"] = self.mechanism
            out["sasl.jaas.config"] = _jaas(self.mechanism, self.username, self.password)
        return out

    def java_properties(self, path: Path) -> Path:
        _write_private(path, "".join(f"{k}={v}\n" for k, v in self.java().items()))
        return path

    def to_json(self) -> dict[str, Any]:
        """Everything, the password included: for a 0600 file (``save``), never for a log."""
        cert = self.client_cert
        return {"protocol": self.protocol.value, "ca": str(self.ca) if self.ca else None,
                "mechanism": self.mechanism, "username": self.username, "password": self.password,
                "client_cert": None if cert is None else [str(cert.cert), str(cert.key), str(cert.bundle)],
                "check_hostname": self.check_hostname}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ClientSecurity":
        cert = data.get("client_cert")
        return cls(Protocol(data["protocol"]), ca=Path(data["ca"]) if data.get("ca") else None,
                   mechanism=data.get("mechanism", DEFAULT_MECHANISM), username=data.get("username", USER),
                   password=data.get("password", ""), check_hostname=data.get("check_hostname", True),
                   client_cert=None if not cert else CertFiles(*(Path(c) for c in cert)))

    def save(self, path: Path) -> Path:
        """A file (0600) a client process started elsewhere reads with ``load`` (the drills' workloads)."""
        _write_private(path, json.dumps(self.to_json()))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "ClientSecurity":
        return cls.from_json(json.loads(Path(path).read_text()))

    def describe(self) -> dict[str, Any]:
        """For ``kproxy kafka up``: what to give a client (the password is in the 0600 file, not here)."""
        return {"security.protocol": self.protocol.value, "ca": str(self.ca) if self.ca else None,
                "sasl.mechanisms": list(MECHANISMS) if self.protocol.sasl else [],
                "username": self.username if self.protocol.sasl else None}


def _jaas(mechanism: str, username: str, password: str) -> str:
    if mechanism == "OAUTHBEARER":
        return ("org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required"
                f' unsecuredLoginStringClaim_sub="{username}";')
    module = ("org.apache.kafka.common.security.plain.PlainLoginModule" if mechanism == "PLAIN"
              else "org.apache.kafka.common.security.scram.ScramLoginModule")
    return f'{module} required username="{username}" password="{password}";'


def _write_private(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)


@attrs.frozen
class TestbedSecurity:
    """The CA, certificates and SASL password of one test bed (see the module doc)."""

    __test__ = False  # not a pytest class, whatever its name

    protocol: Protocol
    dir: Path
    password: str = attrs.field(repr=False)
    ca: Path = attrs.field()
    broker: CertFiles
    proxy: CertFiles
    client_cert: CertFiles

    @classmethod
    def create(cls, directory: str | os.PathLike[str], protocol: Protocol, *, broker_hosts: tuple[str, ...] = (
            "127.0.0.1", "localhost"), proxy_hosts: tuple[str, ...] = ()) -> "TestbedSecurity":
        """Load what ``directory`` holds, or make it. ``proxy_hosts``: every address a proxy
        node may serve (all nodes' addresses: a survivor stands in on a vacant node's)."""
        d = Path(directory).resolve()
        state = d / STATE_FILE
        if state.exists():
            loaded = cls.load(d)
            if loaded.protocol is protocol:
                return loaded
        import trustme

        ca = trustme.CA(organization_name="kproxy test bed")
        d.mkdir(parents=True, exist_ok=True)
        ca_path = d / "ca.pem"
        ca_path.write_bytes(ca.cert_pem.bytes())
        _write_private(d / "ca.key", ca.private_key_pem.bytes())
        proxy_names = proxy_hosts or tuple(f"127.0.0.{i}" for i in range(2, 100))  # every test fleet's
        self = cls(protocol=protocol, dir=d, password=secrets.token_urlsafe(18), ca=ca_path,
                   broker=issue(ca, d / "broker", broker_hosts),
                   proxy=issue(ca, d / "proxy", (*proxy_names, "localhost")),
                   client_cert=issue(ca, d / "client", ("kproxy-client",)))
        _write_private(state, json.dumps({"protocol": protocol.value, "password": self.password}))
        return self

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> "TestbedSecurity":
        d = Path(directory).resolve()
        data = json.loads((d / STATE_FILE).read_text())
        return cls(protocol=Protocol(data["protocol"]), dir=d, password=data["password"], ca=d / "ca.pem",
                   broker=_cert_files(d / "broker"), proxy=_cert_files(d / "proxy"),
                   client_cert=_cert_files(d / "client"))

    def ca_object(self) -> Any:
        import trustme

        return trustme.CA.from_pem(self.ca.read_bytes(), (self.dir / "ca.key").read_bytes())

    @property
    def client(self) -> ClientSecurity:
        return ClientSecurity(self.protocol, ca=self.ca if self.protocol.tls else None, password=self.password)

    # ----------------------------------------------------------------- proxies
    def proxy_config(self, *, listeners: bool = True, mtls: bool = False,
                     mechanism: str = DEFAULT_MECHANISM) -> dict[str, Any]:
        """The ``[security]`` section of a fleet in front of these brokers: TLS and the node's own
        SASL login upstream as the brokers need, TLS toward clients with the proxy certificate
        (``mtls``: client certificates required, from this CA). The password is read from
        ``UPSTREAM_PASSWORD_ENV`` (see ``proxy_env``)."""
        section: dict[str, Any] = {}
        if listeners:
            section["listeners"] = {"cert": str(self.proxy.cert), "key": str(self.proxy.key)}
            if mtls:
                section["listeners"]["client_ca"] = str(self.ca)
        if self.protocol.tls:
            section["upstream"] = {"tls": True, "ca": str(self.ca)}
        if self.protocol.sasl:
            section["upstream_sasl"] = {"mechanism": mechanism, "username": USER,
                                        "password_env": UPSTREAM_PASSWORD_ENV}
        return section

    def proxy_env(self) -> dict[str, str]:
        return {UPSTREAM_PASSWORD_ENV: self.password} if self.protocol.sasl else {}

    def proxy_client(self, *, mtls: bool = False) -> ClientSecurity:
        """What a client needs to reach a fleet configured with ``proxy_config``: TLS with this CA
        (the proxy certificate is from it), SASL as the brokers want (it passes through)."""
        protocol = Protocol.SASL_SSL if self.protocol.sasl else Protocol.SSL
        return ClientSecurity(protocol, ca=self.ca, password=self.password,
                              client_cert=self.client_cert if mtls else None)

    # ----------------------------------------------------------------- brokers
    def broker_props(self, listener: str, *, reauth_ms: int = 0) -> dict[str, Any]:
        """Properties of a broker whose listener ``listener`` (also the inter-broker one) speaks
        this protocol; ``reauth_ms``: ``connections.max.reauth.ms`` (KIP-368), 0 for never."""
        props: dict[str, Any] = {}
        prefix = f"listener.name.{listener.lower()}"
        if self.protocol.tls:
            props.update({
                "ssl.keystore.type": "PEM",
                "ssl.keystore.location": self.broker.bundle,  # key + chain, unencrypted PKCS#8
                "ssl.truststore.type": "PEM",
                "ssl.truststore.location": self.ca,
                "ssl.client.auth": "requested",  # mTLS clients are verified, the others admitted
                "ssl.enabled.protocols": "TLSv1.2,TLSv1.3",
            })
        if self.protocol.sasl:
            props.update({
                "sasl.enabled.mechanisms": ",".join(MECHANISMS),
                "sasl.mechanism.inter.broker.protocol": DEFAULT_MECHANISM,
                f"{prefix}.plain.sasl.jaas.config":
                    "org.apache.kafka.common.security.plain.PlainLoginModule required"
                    f' username="{USER}" password="{self.password}" user_{USER}="{self.password}";',
                f"{prefix}.oauthbearer.sasl.jaas.config": _jaas("OAUTHBEARER", USER, ""),
            })
            for mechanism in SCRAM_MECHANISMS:
                props[f"{prefix}.{mechanism.lower()}.sasl.jaas.config"] = _jaas(mechanism, USER, self.password)
            if reauth_ms:
                props["connections.max.reauth.ms"] = reauth_ms
        return props

    def format_args(self) -> list[str]:
        """``kafka-storage format`` arguments that create the SCRAM users."""
        if not self.protocol.sasl:
            return []
        return [arg for m in SCRAM_MECHANISMS
                for arg in ("--add-scram", f"{m}=[name={USER},password={self.password}]")]


def issue(ca: Any, stem: Path, names: tuple[str, ...], *, not_after: datetime.datetime | None = None,
          not_before: datetime.datetime | None = None) -> CertFiles:
    """A certificate for ``names`` (DNS names or IP addresses) signed by ``ca``, as PEM files."""
    leaf = ca.issue_cert(*names, not_after=not_after, not_before=not_before)
    files = _cert_files(stem)
    chain = b"".join(blob.bytes() for blob in leaf.cert_chain_pems)
    key = _pkcs8(leaf.private_key_pem.bytes())
    files.cert.write_bytes(chain)
    _write_private(files.key, key)
    _write_private(files.bundle, key + chain)
    return files


def _pkcs8(pem: bytes) -> bytes:
    """Java's PEM keystore reads PKCS#8 keys only (trustme writes the traditional format)."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pem, password=None)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_files(stem: Path) -> CertFiles:
    return CertFiles(cert=stem.with_suffix(".crt"), key=stem.with_suffix(".key"),
                     bundle=stem.with_suffix(".pem"))


def client_settings(security: ClientSecurity | None, family: str) -> dict[str, Any]:
    """The settings of ``family`` (a ``chaos.clients.FAMILIES`` name) for ``security``; none for plaintext."""
    if security is None or security.protocol is Protocol.PLAINTEXT:
        return {}
    return {"aiokafka": security.aiokafka, "confluent": security.confluent,
            "kafka-python": security.kafka_python, "java": security.java}[family]()
