"""Request bodies of the OpenAI API as pydantic models: strict types, unknown fields refused.

Fields the OpenAI API defines but this server does not implement are accepted only at their
neutral value (`logprobs: null`, `presence_penalty: 0`, ...), so a client never silently gets
something other than what it asked for. `top_k` and `stop_token_ids` are extensions, as vLLM
takes them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_SEED = 2**63 - 1
NEUTRAL = {"best_of": (None, 1), "echo": (None, False), "logprobs": (None, False), "top_logprobs": (None, 0),
           "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
           "logit_bias": (None, {}), "parallel_tool_calls": (None, False), "tools": (None, []),
           "response_format": (None, {"type": "text"})}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """Fields both endpoints share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="0 or -1: off (vLLM's convention)")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list, description="extension: token ids that end the answer")
    n: int = 1
    user: str | None = None
    best_of: int | None = None
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n = 1 is supported")
        return n

    @model_validator(mode="after")
    def _neutral(self) -> Sampling:
        for name in self.model_fields_set & set(NEUTRAL):
            if getattr(self, name) not in NEUTRAL[name]:
                raise ValueError(f"{name} is not supported by this server (leave it out)")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())


class CompletionRequest(Sampling):
    """POST /v1/completions: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    echo: bool | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("one prompt per request (n = 1; send several requests)")
            prompt = prompt[0]
        return prompt


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(Sampling):
    """POST /v1/chat/completions: a conversation in the target tokenizer's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
