"""The OpenAI API's answers as this server speaks them: `Completion`, `ChatCompletion`, their
stream chunks, `Usage` and the model list, built by the server and serialized with
`model_dump_json`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from metrale.runtime.serving.stats import Drafts


class CompletionTokensDetails(BaseModel):
    """OpenAI's breakdown of the completion tokens; the prediction fields (its Predicted Outputs'
    names) count the request's verified drafts: those the target accepted, and the rest."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class SpeculativeUsage(BaseModel):
    """The request's drafts (metrale's extension of `usage`): made by the drafter, verified by
    the target, and accepted."""

    drafts_proposed: int
    drafts_verified: int
    drafts_accepted: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = Field(None, exclude_if=lambda d: d is None)
    speculative: SpeculativeUsage | None = Field(None, exclude_if=lambda d: d is None)

    @classmethod
    def of(cls, prompt: int, completion: int, drafts: Drafts | None = None) -> Usage:
        """The usage of a request; its drafts where its server speculates."""
        details = spec = None
        if drafts is not None:
            details = CompletionTokensDetails(accepted_prediction_tokens=drafts.accepted,
                                              rejected_prediction_tokens=drafts.verified - drafts.accepted)
            spec = SpeculativeUsage(drafts_proposed=drafts.proposed, drafts_verified=drafts.verified,
                                    drafts_accepted=drafts.accepted)
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   completion_tokens_details=details, speculative=spec)


Finish = Literal["stop", "length"]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Finish | None = None


class Completion(BaseModel):
    """A `/v1/completions` answer; streamed, each chunk is one of these (`usage` on the last
    only, when asked for: `stream_options.include_usage`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=lambda u: u is None)


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: None = None
    finish_reason: Finish


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """A chunk's new text: the first chunk says the role, the last carries nothing."""

    role: Literal["assistant"] | None = Field(None, exclude_if=lambda v: v is None)
    content: str | None = Field(None, exclude_if=lambda v: v is None)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: Finish | None = None


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=lambda u: u is None)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "metrale"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
