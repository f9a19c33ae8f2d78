"""Domain errors: raised by pure code, mapped to gRPC and HTTP at the edges only."""

from __future__ import annotations

import enum
import math


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    FAILED_PRECONDITION = "failed_precondition"
    INTERNAL = "internal"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"


class LlmeshError(Exception):
    """Base of every error a client may see. ``reason`` is a stable machine-readable
    word (OpenAI's ``code`` field); ``param`` names the offending request field."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, reason: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.param = param
        self.headers = headers or {}  # facts for the client: HTTP headers, gRPC trailing metadata


class InvalidArgument(LlmeshError):
    code = ErrorCode.INVALID_ARGUMENT


class NestedTooDeep(InvalidArgument):
    """A request nested deeper than the code handling it could recurse (Python's
    RecursionError): the client's doing, so INVALID_ARGUMENT, never a traceback."""

    def __init__(self) -> None:
        super().__init__("The request is nested too deeply to be processed; flatten it (JSON schemas: at most "
                         "64 levels).", reason="nested_too_deep")


def domain_error(exc: BaseException) -> LlmeshError | None:
    """The domain error an exception stands for at a front's edge: itself, a RecursionError
    as NestedTooDeep, anything else None (a bug: INTERNAL)."""
    if isinstance(exc, LlmeshError):
        return exc
    if isinstance(exc, RecursionError):
        return NestedTooDeep()
    return None


class ContextLengthExceeded(InvalidArgument):
    def __init__(self, prompt_tokens: int, requested: int, context_length: int):
        if requested > prompt_tokens:
            detail = (f"you requested {requested} tokens ({prompt_tokens} in the prompt, "
                      f"{requested - prompt_tokens} for the completion)")
        else:
            detail = f"the prompt has {prompt_tokens} tokens"
        super().__init__(
            f"This model's maximum context length is {context_length} tokens, but {detail}.",
            reason="context_length_exceeded", param="messages")
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length


class NotGenerative(InvalidArgument):
    """A chat or text completion asked of an embedding model (vLLM's and llmesh's 400)."""

    def __init__(self, model: str):
        super().__init__(f"The model '{model}' is an embedding model: it serves /v1/embeddings, not chat or text "
                         "completions.", reason="model_not_generative", param="model")


class NotEmbedding(InvalidArgument):
    """Embeddings asked of a generative model."""

    def __init__(self, model: str):
        super().__init__(f"The model '{model}' does not serve embeddings; list the models with GET /v1/models "
                         "(an embedding model's capabilities are [\"embeddings\"]).", reason="model_not_embedding",
                         param="model")


class InputTooLong(InvalidArgument):
    """An embeddings input over the model's token limit: refused (as OpenAI's API does), not truncated."""

    def __init__(self, index: int, tokens: int, limit: int):
        super().__init__(f"This model's maximum input length is {limit} tokens, but input[{index}] has {tokens} "
                         "tokens; shorten or split it.", reason="context_length_exceeded", param=f"input[{index}]")


class NotFound(LlmeshError):
    code = ErrorCode.NOT_FOUND


class ModelNotFound(NotFound):
    def __init__(self, model: str):
        super().__init__(f"The model '{model}' does not exist.", reason="model_not_found", param="model")


class Overloaded(LlmeshError):
    code = ErrorCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str = "The engine's queue is full; retry later.", *, reason: str = "overloaded"):
        super().__init__(message, reason=reason)


class ResourceExhausted(LlmeshError):
    """Not enough of a resource (memory, GPUs) for the operation now; it may fit later."""
    code = ErrorCode.RESOURCE_EXHAUSTED


class QueueFull(Overloaded):
    """Every engine that could serve a request refused it because its queue was full.
    The client should come back: ``headers`` carry the hint (Retry-After)."""

    def __init__(self, model: str, retry_after_s: float):
        ms = max(1, round(retry_after_s * 1000))
        LlmeshError.__init__(
            self, f"Every upstream serving the model '{model}' is at capacity (full queues); retry in {ms / 1000:g} s.",
            reason="queue_full", headers={"retry-after": str(math.ceil(ms / 1000)), "retry-after-ms": str(ms)})


class FlowRefused(Overloaded):
    """The gateway's flow control turned a waiting (or arriving) request away: ``reason`` says
    why (queue_full, tenant_queue_full, preempted, shed, deadline), Retry-After when to come back."""

    def __init__(self, message: str, reason: str, retry_after_s: float):
        ms = max(1, round(retry_after_s * 1000))
        LlmeshError.__init__(self, message, reason=reason,
                             headers={"retry-after": str(math.ceil(ms / 1000)), "retry-after-ms": str(ms)})


class Unavailable(LlmeshError):
    code = ErrorCode.UNAVAILABLE


class EngineLost(Unavailable):
    """The engine's process went away under a call it had taken (killed, crashed): its
    connection reset or closed before the answer ended. Not a refusal the engine sent
    (draining, a full queue), nor a connection refused before the call reached it."""

    def __init__(self, message: str):
        super().__init__(message, reason="engine_lost")


class PoisonRequest(InvalidArgument):
    """The engines that took a request went away under it, one after another: it is
    refused rather than tried on yet another engine (it may be what kills them). A 400
    (INVALID_ARGUMENT), not a 5xx, so clients and SDKs do not send it again by
    themselves, each time taking engines down with it."""

    def __init__(self, request_id: str, lost: int):
        super().__init__(
            f"Request {request_id} was not answered: {lost} engines stopped while it was on them, one after "
            "the other, so it is not tried on another. It may be what stops them; if the request is valid, "
            f"report its id ({request_id}).", reason="poison_request")


class DiscoveryError(Unavailable):
    """The discovery backend (etcd, Consul) failed or refused a call: unreachable, no
    leader, permission denied, a bad answer. Every backend raises this and only this,
    so long-lived tasks can survive it and keep what they last knew."""

    def __init__(self, message: str):
        super().__init__(message, reason="discovery_unavailable")


class DeadlineExceeded(LlmeshError):
    code = ErrorCode.DEADLINE_EXCEEDED

    def __init__(self, message: str = "The request's deadline expired."):
        super().__init__(message, reason="deadline_exceeded")


class BodyTimeout(DeadlineExceeded):
    """The client did not send its request's body in time (HTTP answers 408)."""

    def __init__(self, message: str):
        LlmeshError.__init__(self, message, reason="request_timeout")


class Cancelled(LlmeshError):
    code = ErrorCode.CANCELLED


class FailedPrecondition(LlmeshError):
    """The system is not in the state the operation needs (e.g. a promotion the
    eval gate blocked, a rollback with nothing to roll back to)."""
    code = ErrorCode.FAILED_PRECONDITION


class Internal(LlmeshError):
    code = ErrorCode.INTERNAL


class Unauthenticated(LlmeshError):
    code = ErrorCode.UNAUTHENTICATED

    def __init__(self, message: str, reason: str = "invalid_api_key"):
        super().__init__(message, reason=reason)


class PermissionDenied(LlmeshError):
    code = ErrorCode.PERMISSION_DENIED


class RateLimited(Overloaded):
    """A tenant's limit or budget said no; ``headers`` say when to come back."""

    def __init__(self, message: str, reason: str, headers: dict[str, str]):
        LlmeshError.__init__(self, message, reason=reason, headers=headers)


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, NotFound, Overloaded, Unavailable,
                                      DeadlineExceeded, Cancelled, FailedPrecondition, Internal, Unauthenticated,
                                      PermissionDenied)}


def error_for(code: ErrorCode, message: str, *, reason: str | None = None,
              param: str | None = None) -> LlmeshError:
    """Rebuild a domain error received from another service."""
    cls = _BY_CODE.get(code, Internal)
    err = LlmeshError.__new__(cls)
    LlmeshError.__init__(err, message, reason=reason, param=param)
    return err
