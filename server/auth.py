"""Bearer-token authentication: a grpc.aio interceptor that checks ``authorization: Bearer <token>`` metadata (and
the check itself, which the HTTP front makes of its ``Authorization`` header)."""
from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

UNAUTHENTICATED_DETAILS = "missing or invalid bearer token: send the metadata 'authorization: Bearer <token>'"
HEALTH_PREFIX = "/grpc.health.v1.Health/"  # probes (e.g. Kubernetes) cannot send metadata


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without the right token with UNAUTHENTICATED; health checks are exempt."""

    def __init__(self, token: str, exempt: tuple[str, ...] = (HEALTH_PREFIX,)) -> None:
        if not token:
            raise ValueError("the bearer token must not be empty")
        self._expected = token.encode()
        self._exempt = exempt

    def authorized(self, metadata: Any) -> bool:
        """Whether an ``authorization`` entry is ``Bearer <token>``: the scheme in any case, then one or more
        spaces (RFC 7235 section 2.1: auth-scheme is case-insensitive)."""
        return any(key.lower() == "authorization" and bearer_token_matches(value, self._expected)
                   for key, value in metadata or ())

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._exempt):
            return handler
        if self.authorized(handler_call_details.invocation_metadata):
            return handler
        return _refusing(handler)


def bearer_token_matches(value: str | bytes, expected: bytes) -> bool:
    """Whether an ``authorization`` value (gRPC metadata, an HTTP header) is ``Bearer <expected>``."""
    given = value.encode() if isinstance(value, str) else bytes(value)
    scheme, _, token = given.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.lstrip(b" "), expected)


async def _refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""
    kinds = [(handler.unary_unary, grpc.unary_unary_rpc_method_handler),
             (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
             (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
             (handler.stream_stream, grpc.stream_stream_rpc_method_handler)]
    make = next(make for behaviour, make in kinds if behaviour is not None)
    return make(_refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
