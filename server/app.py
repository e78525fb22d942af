"""InferenceServer: grpc.aio with the Inference service, health, reflection, auth, TLS, metrics and draining."""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import signal
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from . import infer_pb2 as pb
from . import infer_pb2_grpc as pb_grpc
from .auth import BearerTokenInterceptor
from .malformed import MalformedRequestInterceptor
from .servicer import InferenceServicer
from .worker import EngineWorker

if TYPE_CHECKING:
    from .http import HttpServer

log = logging.getLogger("infer.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name


@dataclass
class ServeOptions:
    """The options of ``infer serve`` (besides the engine's)."""

    host: str = "127.0.0.1"
    port: int = 50051
    max_queue: int = 1024
    max_message_bytes: int = 4 * 1024 * 1024
    grace_period_s: float = 30.0
    token: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    metrics_port: int | None = None
    allow_lora_loading: bool = False  # the LoadLoraAdapter and UnloadLoraAdapter RPCs
    http_port: int | None = None  # OpenAI's HTTP API (server/openai_front.py) on this port too; 0 picks a free one
    served_model_name: str | None = None  # what the HTTP API's `model` field names; None: the model folder's name
    allowed_origins: tuple[str, ...] = ()  # CORS: the web origins whose pages may call the HTTP API ("*": any)

    def validate(self) -> ServeOptions:
        from ..core.errors import ConfigError

        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if not 1 <= self.max_queue < 2**32:  # Stats.max_queue is a uint32
            raise ConfigError(f"max-queue must be in [1, 2**32), got {self.max_queue}")
        if not 1024 <= self.max_message_bytes < 2**31:  # gRPC's channel arguments are int32
            raise ConfigError(f"max-message-bytes must be in [1024, 2**31), got {self.max_message_bytes}")
        if not 0 <= self.grace_period_s < math.inf:  # NaN fails this too
            raise ConfigError(f"grace-period must be a finite number of seconds >= 0, got {self.grace_period_s}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        if self.tls_cert is not None and self.tls_key is not None:
            check_tls_files(Path(self.tls_cert), Path(self.tls_key))
        if self.token is not None and not self.token:
            raise ConfigError("the token must not be empty")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics-port must be in [0, 65535], got {self.metrics_port}")
        if self.metrics_port and self.metrics_port == self.port:
            raise ConfigError(f"--metrics-port must differ from --port (both are {self.port})")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ConfigError(f"http-port must be in [0, 65535], got {self.http_port}")
        if self.http_port and self.http_port in (self.port, self.metrics_port):
            raise ConfigError(f"--http-port must differ from --port and --metrics-port (it is {self.http_port})")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("--served-model-name must not be empty")
        if self.allowed_origins and self.http_port is None:
            raise ConfigError("--allowed-origins is for the HTTP API: add --http-port")
        if bad := [o for o in self.allowed_origins if o != "*" and not _is_origin(o)]:
            raise ConfigError(f"--allowed-origins takes origins such as https://app.example.com (scheme, host and "
                              f"port, no path) or *, got {bad[0]!r}")
        return self

    def check_ports(self) -> None:
        """Fail fast, before the model loads, when --port or --metrics-port is taken (the server binds later)."""
        check_port_free(self.host, self.port, "--port")
        if self.metrics_port is not None:
            check_port_free(self.host, self.metrics_port, "--metrics-port")
        if self.http_port is not None:
            check_port_free(self.host, self.http_port, "--http-port")


def _is_origin(text: str) -> bool:
    """Whether ``text`` is a web origin as browsers send it: http(s), a host, maybe a port, nothing after."""
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    return parts.scheme in ("http", "https") and bool(parts.netloc) and not (parts.path or parts.query
                                                                            or parts.fragment) and "@" not in text


def check_tls_files(cert: Path, key: Path) -> None:
    """Raise ConfigError naming the file unless ``cert`` is a PEM certificate chain and ``key`` its unencrypted
    PEM private key (gRPC itself only logs and fails to bind)."""
    from ..core.errors import ConfigError

    for option, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read {option} {path}: {exc.strerror}") from exc
    try:
        # the password callback: an encrypted key fails here instead of prompting (gRPC cannot decrypt it either)
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"--tls-key {key} is not the private key of --tls-cert {cert}; pass the key that "
                              "the certificate was issued for") from exc
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert)
        except ssl.SSLError:
            raise ConfigError(f"--tls-cert {cert} is not a PEM certificate; pass the server's certificate chain "
                              "(-----BEGIN CERTIFICATE-----)") from exc
        raise ConfigError(f"--tls-key {key} is not an unencrypted PEM private key; pass the key of --tls-cert "
                          "(-----BEGIN PRIVATE KEY-----, e.g. from `openssl req -nodes`)") from exc


def check_port_free(host: str, port: int, option: str) -> None:
    """Raise ConfigError when host:port is in use, needs privileges, or host is not this machine's (port 0, any
    free port, is probed for the host alone)."""
    from ..core.errors import ConfigError

    try:
        addresses = {info[4]: info[0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                     flags=socket.AI_PASSIVE)}
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve --host {host}: {exc.strerror}") from exc
    for address, family in addresses.items():
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and the metrics server bind
            try:
                probe.bind(address)
                probe.listen()
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise ConfigError(f"could not listen on {host_port(host, port)}: {exc.strerror} (--host must be "
                                      "an address of this machine: 127.0.0.1, 0.0.0.0 for every interface, or one "
                                      "of its own)") from exc
                hint = {errno.EADDRINUSE: "is the port in use?", errno.EACCES: "ports below 1024 need privileges;"}
                if exc.errno in hint:  # other errors: let the real bind report them
                    raise ConfigError(f"could not listen on {host_port(host, port)}: {exc.strerror} "
                                      f"({hint[exc.errno]} pick another {option}, or 0 for a free one)") from exc


def host_port(host: str, port: int) -> str:
    return f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"


def describe_engine(engine: Any) -> pb.ModelInfo:
    """GetModelInfo's answer, read once before the worker thread starts."""
    from .. import __version__

    loaded = engine.loaded
    return pb.ModelInfo(
        model=str(Path(loaded.path).resolve()), architecture=loaded.architecture or type(loaded.model).__name__,
        max_model_len=engine.max_model_len, vocab_size=loaded.model.spec.vocab_size,
        dtype=str(loaded.dtype).removeprefix("torch."), device=str(loaded.device), quant=engine.active["quant"],
        components=engine.active, block_size=engine.config.block_size, num_kv_blocks=engine.num_blocks,
        version=__version__, chat_template=bool(getattr(engine.tokenizer, "chat_template", None)),
        default_chat_template_kwargs=json.dumps(engine.config.default_chat_template_kwargs)
        if engine.config.default_chat_template_kwargs else "",
        sanitize_chat_control_tokens=engine.config.sanitize_chat_control_tokens,
        lora_adapters=engine.lora_adapters, generates=loaded.model.spec.has_lm_head, labels=labels_of(engine))


def labels_of(engine: Any) -> list[str]:
    """A sequence classifier's label names, by index (config.json's id2label, as transformers reads it); else []."""
    from ..core.classification import read_id2label

    if engine.loaded.model.spec.num_labels is None:
        return []
    named = read_id2label(Path(engine.loaded.path)) or {}
    return [named.get(str(i), f"LABEL_{i}") for i in range(engine.loaded.model.spec.num_labels)]


def list_plugins(engine: Any) -> pb.ListPluginsResponse:
    return pb.ListPluginsResponse(plugins=[pb.Plugin(kind=c.kind, name=c.name, source=c.source, aliases=c.aliases)
                                           for c in engine.plugins.components()])


class InferenceServer:
    """One grpc.aio server in front of one engine. Use :meth:`start`, then :meth:`drain` (or :meth:`run`)."""

    def __init__(self, engine: Any, options: ServeOptions) -> None:
        self.options = options.validate()
        self.worker = EngineWorker(engine, on_fatal=self._on_worker_failed)
        self.servicer = InferenceServicer(self.worker, describe_engine(engine), list_plugins(engine),
                                          options.max_queue, options.max_message_bytes, options.allow_lora_loading)
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._stop_metrics: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None  # where the OpenAI HTTP API listens (ServeOptions.http_port)
        self._http: HttpServer | None = None
        self.served_name = options.served_model_name or Path(engine.loaded.path).name

    async def start(self) -> int:
        """Start the engine thread and the server; health turns SERVING. Returns the bound port."""
        o = self.options
        interceptors: list[grpc.aio.ServerInterceptor] = [BearerTokenInterceptor(o.token)] if o.token else []
        interceptors.append(MalformedRequestInterceptor())
        size = o.max_message_bytes
        server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
            ("grpc.so_reuseport", 0)])
        pb_grpc.add_InferenceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server)
        address = host_port(o.host, o.port)
        try:
            if o.tls_cert is not None and o.tls_key is not None:
                creds = grpc.ssl_server_credentials([(Path(o.tls_key).read_bytes(), Path(o.tls_cert).read_bytes())])
                self.port = server.add_secure_port(address, creds)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as exc:
            from ..core.errors import ConfigError

            hint = " (is the port in use?)" if o.port else ""
            raise ConfigError(f"could not listen on {address}: {exc}{hint}") from exc
        if o.metrics_port is not None:
            self._start_metrics(asyncio.get_running_loop())
        if o.http_port is not None:
            await self._start_http(o.http_port)
        self._server = server
        self._loop = asyncio.get_running_loop()
        self.worker.start()
        await server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def _start_http(self, port: int) -> None:
        from ..core.errors import ConfigError
        from .http import start_http_server
        from .openai_front import OpenAIFront

        o, context = self.options, None
        if o.tls_cert is not None and o.tls_key is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(o.tls_cert, o.tls_key)
        front = OpenAIFront(self.servicer, self.served_name, o.token, o.allowed_origins)
        try:
            self._http = await start_http_server(front, o.host, port, ssl=context, max_body_bytes=o.max_message_bytes)
        except OSError as exc:
            raise ConfigError(f"could not listen on {host_port(o.host, port)} for --http-port: {exc}") from exc
        self.http_port = self._http.port

    def _on_worker_failed(self, exc: BaseException) -> None:
        """On the worker thread, after it failed: health turns NOT_SERVING, so that a balancer routes elsewhere."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        for service in ("", SERVICE_NAME):
            asyncio.run_coroutine_threadsafe(self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING),
                                             loop)

    def _start_metrics(self, loop: asyncio.AbstractEventLoop) -> None:
        from .metrics import StatsCollector, start_metrics_server

        def fetch() -> pb.Stats:  # runs on the HTTP thread; the stats are read on the loop and engine threads
            return asyncio.run_coroutine_threadsafe(self.servicer.stats(), loop).result(timeout=10)

        collector = StatsCollector(fetch, lambda: self.servicer.rejected)
        self.metrics_port, self._stop_metrics = start_metrics_server(self.options.host, self.options.metrics_port or 0,
                                                                     collector)

    async def drain(self, force: asyncio.Event | None = None) -> None:
        """Graceful shutdown: NOT_SERVING, refuse new requests, let in-flight ones finish within the grace period,
        then cancel the rest (their KV is freed) and stop the engine thread. ``force`` cuts the wait short."""
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()
        waits = [asyncio.ensure_future(self.servicer.idle.wait())]
        if force is not None:
            waits.append(asyncio.ensure_future(force.wait()))
        done, pending = await asyncio.wait(waits, timeout=self.options.grace_period_s,
                                           return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if not self.servicer.idle.is_set():
            why = "a second signal" if force is not None and force.is_set() else "grace period over"
            log.warning("%s: cancelling %d requests in flight", why, self.servicer.in_flight)
        await self.close(grace=1.0)

    async def close(self, grace: float | None = None) -> None:
        """Stop the engine thread (its requests still running end with UNAVAILABLE and a message that says why),
        then the server (calls still open are cancelled after ``grace`` seconds) and the metrics endpoint."""
        if self._http is not None:
            self._http.stop_listening()  # the requests in flight end with the engine's UNAVAILABLE (a 503)
        await asyncio.to_thread(self.worker.stop)
        if self._http is not None:
            await self._http.close()
        if self._server is not None:
            await self._server.stop(grace)
        if self._stop_metrics is not None:
            await asyncio.to_thread(self._stop_metrics)

    async def run(self, on_ready: Callable[[InferenceServer], None] | None = None) -> None:
        """Start, serve until SIGTERM or SIGINT, then drain. A second signal skips the rest of the grace period."""
        loop = asyncio.get_running_loop()
        stop, force = asyncio.Event(), asyncio.Event()

        def on_signal() -> None:
            (force if stop.is_set() else stop).set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        if on_ready is not None:
            on_ready(self)
        await stop.wait()
        log.warning("shutting down: draining requests in flight (grace period %g s)", self.options.grace_period_s)
        await self.drain(force)


def serve(engine: Any, options: ServeOptions, on_ready: Callable[[InferenceServer], None] | None = None) -> None:
    """Serve ``engine`` until SIGTERM/SIGINT, then drain and return."""
    asyncio.run(InferenceServer(engine, options).run(on_ready))
