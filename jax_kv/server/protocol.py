"""The OpenAI request bodies the server takes (pydantic, validated strictly: a string is not a
number, a bool is not an int) and the OpenAI error shape it answers bad input with."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
_TYPES = ("str", "int", "float", "bool", "list", "dict")


class APIError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type, headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampled(BaseModel):
    """What both endpoints take. Unknown fields are ignored, as OpenAI-compatible servers do
    for the many optional ones (user, logit_bias, ...); the ones that change the answer and
    are not supported (n > 1, logprobs, best_of) are refused."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # an extension (vLLM's): 0 = all tokens
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: (
        str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] | None
    ) = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    best_of: Any = None


class CompletionBody(_Sampled):
    prompt: str | list[str] | list[int]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatBody(_Sampled):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


def parse(model: type[BaseModel], raw: bytes) -> Any:
    """The body as `model`, or APIError 400 naming the first bad field."""
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:

        def where(err: Any) -> list[str]:
            # A union names its member types in the location (str, list[int], ...): dropped.
            loc = [str(x) for x in err.get("loc", ())]
            return [x for x in loc if not any(c in x for c in "[]-") and x not in _TYPES]

        # A union reports one error per member: the deepest says what was wrong.
        errors = e.errors()
        first = where(errors[0])[:1]
        same = [x for x in errors if where(x)[:1] == first]
        err = max(same, key=lambda x: len(where(x)))
        param = ".".join(where(err)) or None
        if err.get("type") == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {err.get('msg')}") from None
        message = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
        if "input" in err and err.get("type") != "missing":
            message += f", got {err['input']!r}"[:200]
        raise APIError(400, message, param=param) from None
