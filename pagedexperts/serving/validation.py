"""Validation of the OpenAI requests served here: the limits and the one validation.

Owns: the limits as named constants and ``prepare`` (a parsed request -> token ids and
per-sequence sampling, every range checked, refusals as ``protocol.ApiError``), the chat
template's arguments (``template_kwargs``) and the note on informational fields
(``ignored_fields``). Cheap checks first: the JSON and its types, the model name, every range,
the prompt's bytes against ``context_length x MAX_PROMPT_BYTES_PER_TOKEN`` (before tokenizing),
then tokenization and the token counts. Runs in a worker thread. Does not: parse JSON
(``protocol``), sample, batch or build responses (``bodies``).
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass

from pagedexperts.engine.sampling import GREEDY_BELOW, SamplingParams
from pagedexperts.serving.protocol import (INFORMATIONAL, SGLANG_DEFAULTS, UNSUPPORTED, ApiError, ChatCompletionRequest,
                                           ChatMessage)

logger = logging.getLogger(__name__)

# max_tokens when a request gives none: OpenAI's and vLLM's defaults. Completions: 16 (capped by what
# the context leaves); chat (and the Responses API, which is served through it): what the context leaves.
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0  # presence / frequency penalty range [-2, 2] (OpenAI's)
MAX_REPETITION_PENALTY = 100.0  # repetition_penalty in (0, 100]; 1 = none (vLLM asks > 0)
MAX_TOP_K = 2**31 - 1  # top_k: -1 or 0 = all tokens (vLLM's and SGLang's "off"), k >= 1 the k most likely
MAX_LOGIT_BIAS = 100.0  # bias range [-100, 100] (OpenAI's)
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGPROBS = 20  # completions ``logprobs`` and chat ``top_logprobs`` (OpenAI chat's and vLLM's max)
MAX_STOP_STRINGS = 16  # vLLM takes any number; bounded here (the stop scan runs every token)
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256  # vLLM takes any number; bounded here like the stop strings
MAX_N = 16
MAX_SEQUENCES = 64  # prompts x n of one request
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_PROMPT_BYTES_PER_TOKEN = 32  # generous: byte-level BPE averages ~4 bytes per token
PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}Assistant:{% endif %}")
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits
# chat_template_kwargs keys vLLM refuses (the template is the server's, the prompt text is what it renders)
TEMPLATE_KWARGS_REFUSED = {"chat_template": "the chat template is the model's", "tokenize": "the server tokenizes"}

@dataclass(frozen=True)
class Prepared:
    """A validated request: its prompts (ids and text, for echo), one SamplingParams per
    sequence (prompts x n, prompt-major), and how to answer."""

    prompt_ids: list[list[int]]
    prompt_texts: list[str]
    sequences: list[SamplingParams]
    n: int
    echo: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage in every chunk


def check_model(name: str, served_model_name: str) -> None:
    """Raises ApiError 404 (``model_not_found``, OpenAI's) for a model name not served here."""
    if name != served_model_name:
        raise ApiError(f"The model {name!r} does not exist; this server serves {served_model_name!r} "
                       "(GET /v1/models)", param="model", status=404, code="model_not_found")


def _in_range(value, low, high, param: str, *, note: str = "") -> None:
    """Raises ApiError unless ``value`` is None or a finite number in [low, high]."""
    if value is None:
        return
    if (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high:
        raise ApiError(f"{param} must be in [{low}, {high}]{note}, got {value}", param=param)


def _refuse_unsupported(body) -> None:
    """Declared fields of the API that are not implemented: only their default passes."""
    defaults = {"best_of": (None, body.n or 1), "suffix": (None, ""), "tools": (None, []),
                "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False),
                "response_format": (None, {"type": "text"}), **SGLANG_DEFAULTS}
    for name, allowed in defaults.items():
        if name in type(body).model_fields and getattr(body, name) not in allowed:
            raise ApiError(f"unsupported field {name!r}: {UNSUPPORTED.get(name, name)} is not supported by this server "
                           f"(got {getattr(body, name)!r})", param=name, code="unsupported_field")


def check_metadata(metadata: dict[str, str] | None) -> None:
    """Raises ApiError for ``metadata`` over OpenAI's limits (keys, key and value lengths)."""
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise ApiError(f"metadata takes at most {MAX_METADATA_KEYS} keys, got {len(metadata)}", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise ApiError(f"metadata keys take at most {MAX_METADATA_KEY_CHARS} characters and values "
                           f"{MAX_METADATA_VALUE_CHARS}, got key {key[:80]!r}", param="metadata")


def ignored_fields(body) -> dict:
    """The informational fields of ``body`` sent with a value that asks for something this server
    does not do (``protocol.INFORMATIONAL``: store a completion, keep its metadata, a service
    tier), logged once per request as vLLM logs the fields it ignores; they change no output."""
    ignored = {name: getattr(body, name) for name, defaults in INFORMATIONAL.items()
               if name in type(body).model_fields and getattr(body, name) not in defaults}
    if ignored:
        logger.warning("request fields accepted and ignored (nothing is stored, one service tier): %s", ignored)
    return ignored


def _utf8(text: str, param: str) -> None:
    """Raises ApiError for text that is not valid Unicode (a lone surrogate such as \\ud800)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(f"{param} is not valid Unicode: {exc.reason} at character {exc.start} "
                       f"({text[exc.start:exc.end]!r})", param=param, code="invalid_unicode") from None


def check_ranges(body) -> tuple[str, ...]:
    """Every option's range (no tokenizer needed); returns the stop strings.

    Raises:
        ApiError: the first option out of range, naming it, its range and its value.
    """
    _refuse_unsupported(body)
    check_metadata(body.metadata)
    if body.stream_options is not None and not body.stream:
        raise ApiError("stream_options is only allowed with stream: true", param="stream_options")
    if isinstance(body, ChatCompletionRequest) and body.continue_final_message and body.add_generation_prompt:
        raise ApiError("Cannot set both `continue_final_message` and `add_generation_prompt` to True: the final "
                       "message is continued, no new one is started", param="continue_final_message")
    _in_range(body.temperature, 0, MAX_TEMPERATURE, "temperature",
              note=f"; below {GREEDY_BELOW:g} it samples greedily")
    if body.top_p is not None and not (math.isfinite(body.top_p) and 0 < body.top_p <= 1):
        raise ApiError(f"top_p must be in (0, 1], got {body.top_p}", param="top_p")
    _in_range(body.seed, *SEED_RANGE, "seed")
    _in_range(body.n, 1, MAX_N, "n")
    _in_range(body.presence_penalty, -MAX_PENALTY, MAX_PENALTY, "presence_penalty")
    _in_range(body.frequency_penalty, -MAX_PENALTY, MAX_PENALTY, "frequency_penalty")
    _in_range(body.top_k, -1, MAX_TOP_K, "top_k", note=" (-1 or 0: all tokens)")
    _in_range(body.min_p, 0, 1, "min_p")
    if body.repetition_penalty is not None and not (math.isfinite(body.repetition_penalty)
                                                    and 0 < body.repetition_penalty <= MAX_REPETITION_PENALTY):
        raise ApiError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1: none), got "
                       f"{body.repetition_penalty}", param="repetition_penalty")
    _in_range(body.min_tokens, 0, 2**31 - 1, "min_tokens")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
    for i, s in enumerate(stop):
        if not s or len(s) > MAX_STOP_CHARS:
            raise ApiError(f"stop strings must be non-empty and at most {MAX_STOP_CHARS} characters; stop[{i}] "
                           f"has {len(s)}", param="stop")
    for s in stop:
        _utf8(s, "stop")
    if isinstance(body, ChatCompletionRequest):
        _in_range(body.top_logprobs, 0, MAX_LOGPROBS, "top_logprobs")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        _in_range(body.logprobs, 0, MAX_LOGPROBS, "logprobs")
    return stop


def stop_token_ids(body, vocab_size: int) -> tuple[int, ...]:
    """vLLM's ``stop_token_ids``, deduplicated in order; raises ApiError for too many or an id
    outside the vocabulary."""
    ids = tuple(dict.fromkeys(body.stop_token_ids or ()))
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}", param="stop_token_ids")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(f"stop_token_ids must be token ids in [0, {vocab_size}) (the vocabulary), got {bad}",
                       param="stop_token_ids")
    return ids


def logit_bias(body, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs; raises ApiError for a bad id or bias."""
    pairs = []
    entries = body.logit_bias or {}
    if len(entries) > MAX_LOGIT_BIAS_ENTRIES:
        raise ApiError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(entries)}",
                       param="logit_bias")
    for key, bias in entries.items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise ApiError(f"logit_bias keys are token ids in [0, {vocab_size}), got {key!r}", param="logit_bias")
        _in_range(bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template takes them: ``developer`` as ``system``, text parts
    joined with newlines (as vLLM does), an assistant's null content as "", ``name`` passed
    on when given (as vLLM does; a template may use it).

    Raises:
        ApiError: no messages, a non-text content part, a null content outside assistant.
    """
    if not messages:
        raise ApiError("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ApiError(f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                   f"are supported, got type {part.type!r}", param=f"messages.{i}.content.{j}",
                                   code="unsupported_field")
            content = "\n".join(part.text for part in content)
        if m.tool_calls:
            raise ApiError(f"unsupported field 'messages.{i}.tool_calls': tool calling is not supported by this "
                           "server (an empty list is accepted)", param=f"messages.{i}.tool_calls",
                           code="unsupported_field")
        if content is None:
            if m.role != "assistant":
                raise ApiError(f"messages[{i}].content may be null only for role 'assistant'",
                               param=f"messages.{i}.content")
            content = ""
        _utf8(content, f"messages.{i}.content")
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content,
                    **({"name": m.name} if m.name is not None else {})})
    return out


def template_kwargs(body: ChatCompletionRequest | None, tokenizer) -> dict:
    """The chat template's arguments of a chat request, as vLLM passes them: ``chat_template_kwargs``,
    then ``reasoning_effort`` (``enable_thinking`` false for "none", else true, unless given), then
    ``add_generation_prompt`` (default true; false for ``continue_final_message`` without it, as
    SGLang) and ``continue_final_message``, which win over the same keys in chat_template_kwargs.

    Raises:
        ApiError: a chat_template_kwargs key that is another argument of transformers'
            ``apply_chat_template`` (``chat_template``, ``tokenize``, ``tools``, ``return_dict``, ...).
    """
    kwargs = dict(body.chat_template_kwargs or {}) if body is not None else {}
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"conversation", "kwargs"}
    allowed = {"add_generation_prompt", "continue_final_message", "documents"}
    for key in kwargs:
        if key in TEMPLATE_KWARGS_REFUSED or (key in own and key not in allowed) or key == "tools":
            why = TEMPLATE_KWARGS_REFUSED.get(key, "tool calling is not supported" if key == "tools" else
                                              "an argument of apply_chat_template the server sets itself")
            raise ApiError(f"chat_template_kwargs.{key} is refused: {why}; chat_template_kwargs passes the chat "
                           "template's own variables", param=f"chat_template_kwargs.{key}")
    if body is not None and body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
        kwargs.setdefault("enable_thinking", body.reasoning_effort != "none")
    cont = bool(body is not None and body.continue_final_message)
    generation = body.add_generation_prompt if body is not None and body.add_generation_prompt is not None else not cont
    return {**kwargs, "add_generation_prompt": generation, "continue_final_message": cont}


def chat_prompt(tokenizer, messages: list[dict], body: ChatCompletionRequest | None = None) -> str:
    """The prompt text of a conversation (the tokenizer's template, else PLAIN_CHAT_TEMPLATE) with
    the request's template arguments (``template_kwargs``).

    Raises:
        ApiError: a refused template argument; the template refusing the conversation (e.g.
            continue_final_message without a final message it can continue).
    """
    from jinja2 import TemplateError

    template = None if getattr(tokenizer, "chat_template", None) else PLAIN_CHAT_TEMPLATE
    kwargs = template_kwargs(body, tokenizer)
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    except (ValueError, TypeError, TemplateError) as exc:  # transformers' refusals, the template's raise_exception
        raise ApiError(f"the chat template cannot render these messages with these options: {exc}",
                       param="messages") from None


def _max_prompt_bytes(context_length: int) -> int:
    return context_length * MAX_PROMPT_BYTES_PER_TOKEN


def _check_bytes(texts: list[str], param: str, context_length: int) -> None:
    """Refuse, before tokenizing, text longer than any prompt that could fit the context."""
    limit = _max_prompt_bytes(context_length)
    for text in texts:
        _utf8(text, param)
        if len(text) > limit or len(text.encode("utf-8")) > limit:  # len(text) first: no copy when huge
            raise ApiError(f"{param} is {len(text.encode('utf-8'))} bytes, more than any prompt that fits the "
                           f"context: {context_length} tokens (--context-length) x {MAX_PROMPT_BYTES_PER_TOKEN} bytes",
                           param=param, code="context_length_exceeded")


def prompt_inputs(body, tokenizer, context_length: int, vocab_size: int) -> tuple[list[list[int]], list[str], str]:
    """(prompt ids per prompt, prompt texts, the param name) of a completions or chat body
    (completions: a string, strings, token ids, or lists of token ids).

    Raises:
        ApiError: an empty prompt, a token id outside the vocabulary, or a prompt too long for the
            context (bytes before tokenizing, then tokens).
    """
    if isinstance(body, ChatCompletionRequest):
        messages = chat_messages(body.messages)
        _check_bytes(["".join(m["content"] for m in messages)], "messages", context_length)  # all together
        texts, param = [chat_prompt(tokenizer, messages, body)], "messages"
        ids = [tokenizer(t)["input_ids"] for t in texts]
    else:
        prompt, param = body.prompt, "prompt"
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
        if not prompts or len(prompts) > MAX_SEQUENCES:
            raise ApiError(f"prompt must hold 1 to {MAX_SEQUENCES} prompts, got {len(prompts)}", param=param)
        if isinstance(prompts[0], str):
            _check_bytes(prompts, param, context_length)
            texts, ids = prompts, [tokenizer(t)["input_ids"] if t else [] for t in prompts]
        else:
            for p in prompts:
                if len(p) >= context_length:
                    break  # refused below, before decoding it
                if any(not 0 <= t < vocab_size for t in p):
                    raise ApiError(f"prompt token ids must be in [0, {vocab_size}) (the vocabulary)", param=param)
            ids = [list(p) for p in prompts]
            texts = [tokenizer.decode(p) if len(p) < context_length else "" for p in ids]
    for p in ids:
        if not p:
            raise ApiError(f"{param} must not be empty", param=param)
        if len(p) >= context_length:
            raise ApiError(f"{param} is {len(p)} tokens; the context length is {context_length} (--context-length), "
                           "leaving no room to generate", param=param, code="context_length_exceeded")
    return ids, texts, param


def default_max_tokens(prompt_tokens: int, context_length: int, *, chat: bool) -> int:
    """max_tokens of a request that gives none: what the context leaves after the prompt for chat
    (and Responses), at most ``DEFAULT_COMPLETION_MAX_TOKENS`` of it for completions (OpenAI's and
    vLLM's defaults)."""
    room = context_length - prompt_tokens
    return room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)


def prepare(body, tokenizer, *, context_length: int, vocab_size: int) -> Prepared:
    """Check a parsed request against the server's limits and tokenize its prompts.

    ``context_length``: longest prompt + completion in tokens; ``vocab_size``: token ids
    must be below it. A request without max_tokens gets ``default_max_tokens``. Raises ApiError
    naming the first field out of range.
    """
    stop = check_ranges(body)
    bias = logit_bias(body, vocab_size)
    stop_ids = stop_token_ids(body, vocab_size)
    chat = isinstance(body, ChatCompletionRequest)
    echo = bool(getattr(body, "echo", False))
    max_tokens = body.max_completion_tokens if chat and body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None and (max_tokens < 0 or (max_tokens == 0 and not echo)):
        hint = "" if chat else " (0 only with echo, to score the prompt)"  # chat (and responses) have no echo
        raise ApiError(f"max_tokens must be > 0{hint}, got {max_tokens}", param="max_tokens")
    ids, texts, _ = prompt_inputs(body, tokenizer, context_length, vocab_size)
    longest = max(len(p) for p in ids)
    room = context_length - longest
    if max_tokens is not None and max_tokens > room:
        raise ApiError(f"max_tokens {max_tokens} + prompt {longest} tokens exceed the context length "
                       f"{context_length} (--context-length); ask for at most {room}",
                       param="max_tokens", code="context_length_exceeded")
    applied = [default_max_tokens(len(p), context_length, chat=chat) if max_tokens is None else max_tokens
               for p in ids]
    min_tokens = body.min_tokens or 0
    if min_tokens > min(applied):
        default = "" if max_tokens is not None else " (the default when none is given)"
        raise ApiError(f"min_tokens {min_tokens} is more than max_tokens {min(applied)}{default}", param="min_tokens")
    repetition = 1.0 if body.repetition_penalty is None else body.repetition_penalty
    n = body.n or 1
    if len(ids) * n > MAX_SEQUENCES:
        raise ApiError(f"prompts x n = {len(ids)} x {n} sequences; at most {MAX_SEQUENCES} per request", param="n")
    if chat:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    sequences = []
    for p, max_new_tokens in zip(ids, applied):
        for j in range(n):
            sequences.append(SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                seed=None if body.seed is None else (body.seed + j) % 2**64, stop=stop,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                logit_bias=bias, logprobs=logprobs, prompt_logprobs=echo and logprobs is not None,
                top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0, repetition_penalty=repetition,
                prompt_ids=tuple(p) if repetition != 1.0 else (), min_tokens=min_tokens, stop_token_ids=stop_ids,
                ignore_eos=bool(body.ignore_eos), include_stop_str_in_output=bool(body.include_stop_str_in_output),
                skip_special_tokens=body.skip_special_tokens is not False))
    so = body.stream_options
    include_usage = bool(so and (so.include_usage if so.include_usage is not None else so.continuous_usage_stats))
    continuous = include_usage and bool(so.continuous_usage_stats)  # vLLM: continuous usage needs include_usage
    ignored_fields(body)
    return Prepared(ids, texts, sequences, n, echo, bool(body.stream), include_usage, continuous)
