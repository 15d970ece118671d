"""The OpenAI-compatible API's request and response bodies (pydantic), as vLLM's entrypoints/openai/protocol.py.

Requests refuse unknown fields by name; responses are declared so /openapi.json documents what comes back.
Nothing here knows HTTP or the engine.
"""

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError


def _lone_surrogate(v):
    """The first lone surrogate in v's strings (JSON's "\\ud800" parses to one; it is not Unicode text), else None."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            return v[e.start]
        return None
    items = list(v.items()) if isinstance(v, dict) else v if isinstance(v, list) else ()
    for item in items:
        for x in item if isinstance(v, dict) else (item,):
            found = _lone_surrogate(x)
            if found is not None:
                return found
    return None


class Body(BaseModel):
    """A request body: null for a field with a default means that default (OpenAI documents its optional
    fields as nullable; vLLM takes null), and text must be Unicode (no lone surrogate). Types are strict, as
    OpenAI's API checks them: "10" is not an integer, nor true a token id (an integer is a number, though)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # JSON's NaN: "a finite number"

    @field_validator("*", mode="before")
    @classmethod
    def _null_is_default(cls, v, info: ValidationInfo):
        field = cls.model_fields[info.field_name]
        return field.default if v is None and field.default is not None and not field.is_required() else v

    @field_validator("*", mode="after")
    @classmethod
    def _unicode(cls, v):
        bad = _lone_surrogate(v)
        if bad is not None:
            raise ValueError(f"holds a lone surrogate (U+{ord(bad):04X}), which is not Unicode text")
        return v


class StreamOptions(Body):
    include_usage: bool = Field(False, description="a last chunk with the usage, and no choices")
    continuous_usage_stats: bool = Field(False, description="vLLM's usage in every chunk: not supported (false only)")
    include_obfuscation: bool = Field(True, description="OpenAI's padding of stream chunks: accepted; none is added")

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous_usage(cls, v):
        if v:
            raise ValueError("vLLM's usage in every chunk is not supported; include_usage gives it in a last chunk")
        return v


# Fields OpenAI or vLLM document that change nothing here at these values: taken at them (null always), refused
# by name at any other, with why. None: any value is taken (it asks for nothing gpt2ffn would do otherwise).
NEUTRAL = {
    "store": (None, "accepted; nothing is stored"), "metadata": (None, "accepted; nothing is stored"),
    "service_tier": (None, "accepted; one tier"), "priority": ((0,), "vLLM's; one priority"),
    "tools": (([],), "tools are not supported: GPT-2 has no tool calling"),
    "tool_choice": (("none", "auto"), "tools are not supported: GPT-2 has no tool calling"),
    "functions": (([],), "functions are not supported: GPT-2 has no tool calling"),
    "function_call": (("none", "auto"), "functions are not supported: GPT-2 has no tool calling"),
    "modalities": ((["text"],), "GPT-2 reads and writes text only"),
    "audio": ((), "GPT-2 reads and writes text only"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    "reasoning_effort": ((), "GPT-2 is not a reasoning model"),
    "min_p": ((0, 0.0), "vLLM's min_p is not supported (top_p and top_k are)"),
    "include_stop_str_in_output": ((False,), "vLLM's include_stop_str_in_output is not supported: a stop string "
                                   "is left out of the answer"),
    "skip_special_tokens": ((True,), "special tokens are always skipped in the text"),
    "spaces_between_special_tokens": ((True,), "special tokens are always skipped in the text"),
    "truncate_prompt_tokens": ((), "prompts are not truncated: a prompt beyond the context is a 400"),
    "add_special_tokens": (None, "accepted; GPT-2's tokenizer adds none"),
    "chat_template_kwargs": (({},), "the chat template takes no extra variables here"),
    "prompt_logprobs": ((), "vLLM's prompt_logprobs: give echo: true with logprobs for the prompt's log-probs"),
    "n_probs": ((0,), "llama-server's n_probs: give logprobs"),
    "response_format": (({"type": "text"},), "structured output is not supported (no grammar here)"),
    "continue_final_message": ((False,), "not supported"),
}


def _same(value, allowed) -> bool:
    """value is the allowed one: equal and of its kind (a number for a number, 0.0 for 0; not true for 1)."""
    number = (int, float)
    if isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    if isinstance(value, number) and isinstance(allowed, number):
        return value == allowed
    return type(value) is type(allowed) and value == allowed


class SamplingFields(Body):
    """What completions and chat share: OpenAI's sampling fields and the common extras of vLLM and
    llama-server (n_predict and repeat_penalty are llama-server's names of max_tokens and repetition_penalty).
    Fields OpenAI or vLLM document that change nothing at the values given are taken (NEUTRAL); other fields
    are refused by name."""

    @model_validator(mode="before")
    @classmethod
    def _documented_elsewhere(cls, data):
        """llama-server's names to ours; NEUTRAL fields checked and dropped (a value that would change the answer
        is refused, naming the field)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for theirs, ours in (("n_predict", "max_tokens"), ("repeat_penalty", "repetition_penalty")):
            value = data.pop(theirs, None)
            if value is None:  # not sent, or null: nothing asked
                continue
            if data.get(ours) is not None:
                raise PydanticCustomError("alias", f"give {ours} or llama-server's {theirs}, not both",
                                          {"field": theirs})
            data[ours] = None if theirs == "n_predict" and value == -1 else value  # -1: llama-server's no limit
        for name, (allowed, why) in NEUTRAL.items():
            if name in cls.model_fields or name not in data:
                continue
            value = data.pop(name)
            if value is not None and allowed is not None and not any(_same(value, a) for a in allowed):
                raise PydanticCustomError("unsupported", f"{why} (got {json.dumps(value)[:60]})", {"field": name})
        return data

    model: str | None = Field(None, description="one of /v1/models' names; left out: the served model, as vLLM "
                              "and llama-server take it")
    max_tokens: int | None = Field(None, ge=0, description="at most the context less the prompt (checked by "
                                   "the server: a 400 context_length_exceeded)")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 or 0: off (vLLM, llama-server)")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=16, description="vLLM's: token ids that end a "
                                             "choice as a stop string does (the id stays in the answer)")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="with stream: true only")
    n: int = Field(1, ge=1, le=128, description="choices per prompt (the server caps it: --max-n, default 16)")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=4096)
    cache_prompt: bool | None = Field(None, description="llama-server's; accepted (there is no prompt cache)")
    user: str | None = None
    return_token_ids: bool | None = Field(None, description="vLLM's: each choice also carries prompt_token_ids "
                                          "and token_ids (a stream: token_ids per chunk, prompt_token_ids in a "
                                          "choice's first); default: only when the server has no tokenizer")


    @model_validator(mode="after")
    def _stream_options_need_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("stream_options", "only allowed with stream: true", {"field": "stream_options"})
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    logprobs: int | None = Field(None, ge=0, le=5)
    return_tokens_as_token_ids: bool | None = Field(None, description="vLLM's: logprobs name each token "
                                                    "'token_id:N', not its text; default: only when the server "
                                                    "has no tokenizer")
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=128, description="candidates generated per prompt; the n of "
                                "highest cumulative log-prob come back (not streamed; capped by --max-n)")
    suffix: str | None = Field(None, description="OpenAI's insertion text: refused unless empty (GPT-2 has no "
                               "fill-in-the-middle), as vLLM refuses it")


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: str
    content: str | list[TextPart] | None = Field(description="text, or OpenAI's content parts (text ones); null "
                                                 "for an assistant turn that called a tool")
    name: str | None = None

    def for_template(self) -> dict:
        """What a chat template reads: role, name and the content as one string (parts joined, null empty)."""
        text = "".join(p.text for p in self.content) if isinstance(self.content, list) else self.content or ""
        return {"role": self.role, "content": text, **({"name": self.name} if self.name is not None else {})}


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = Field(False, description="each generated token's log-prob (choices[].logprobs.content)")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: this many likeliest tokens "
                                     "at each position")
    response_format: dict | None = Field(None, description="OpenAI's: {'type': 'text'} only (no grammar here)")
    parallel_tool_calls: bool | None = Field(None, description="OpenAI's: accepted; there are no tools")
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = Field(True, description="vLLM's: the template's assistant prefix after the "
                                        "messages (false: none, the answer continues the last message's text)")


class TokenizeRequest(Body):
    model_config = ConfigDict(extra="allow")
    prompt: str | None = None
    content: str | None = None  # llama-server's name


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    tokens: list[int]


# -- responses ---------------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx, in OpenAI's shape."""

    error: ErrorDetail


class Logprobs(BaseModel):
    """OpenAI's legacy completions logprobs: per token its text, log-prob, top alternatives and offset."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Logprobs | None = None
    finish_reason: str | None = Field(None, description="stop, length or abort")
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids")
    token_ids: list[int] | None = Field(None, description="with return_token_ids: the generated ids")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: dict | None = Field(None, description="with logprobs: {content: [{token, logprob, bytes, "
                                  "top_logprobs}]}, OpenAI's chat shape")
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, description="with return_token_ids: the generated ids")


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "gpt2ffn"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: str
    model: str
    running: int
    waiting: int


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
    content: str
