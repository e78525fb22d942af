"""Requests that do not decode (corrupt wire data, strings that are not UTF-8) get INVALID_ARGUMENT, not UNKNOWN."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc


class _Malformed:
    """Stands in for a request message that failed to decode; the handler answers INVALID_ARGUMENT."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each unary-request handler so that a decoding error becomes INVALID_ARGUMENT with a useful message."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        deserialize = handler.request_deserializer
        message = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
        name = message.full_name if message is not None else "request"

        def tolerant(data: bytes) -> Any:
            try:
                return deserialize(data)
            except Exception as exc:  # DecodeError; invalid UTF-8 in a string field is one too
                return _Malformed(exc)

        async def refuse(request: _Malformed, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not a valid {name} message ({request.error}); check that the client "
                                "uses this server's infer.proto and sends strings as UTF-8")

        if handler.unary_stream is not None:
            behaviour = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                result = behaviour(request, context)
                if hasattr(result, "__aiter__"):  # an async generator (Generate)
                    try:
                        async for response in result:
                            yield response
                    finally:  # closed here, not when collected: its own finally aborts the request
                        await result.aclose()
                else:  # a coroutine that sends with context.write (grpc's own Health.Watch)
                    await result

            return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=tolerant,
                                                        response_serializer=handler.response_serializer)
        unary = handler.unary_unary

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await refuse(request, context)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(call, request_deserializer=tolerant,
                                                   response_serializer=handler.response_serializer)
