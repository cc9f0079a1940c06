"""The fingerprint of a model request: what the model was sent, hashed, so a
replay of a run can tell at which step the agent's request changed
(R-REPLAY-2) without the audit storing the prompt.

Each message is reduced to what a provider is sent and nothing of the run
that sent it: its type (a ``ChatMessage``'s role), its name, its content
(a string or content blocks), an AI message's tool calls (id, name,
arguments) and a tool message's call id and status. Message ids,
``response_metadata``, ``usage_metadata`` and ``additional_kwargs`` are
left out, as are the model's parameters (model name, temperature, stream):
the same conversation asked again, on another thread, fingerprints the
same; a changed prompt, tool schema or tool result does not. For the same
reason the run id in the workspace path of an offloaded result (R-TA-4)
is hashed as ``<run>``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, SystemMessage, ToolMessage

from core.workspace import LARGE_RESULTS_DIR, OUTBOX_DIR


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def _utf8(text: str) -> bytes:
    # Lone surrogates (content PostgreSQL cannot store as given) are hashed
    # as they are, not refused: the request was sent with them.
    return text.encode("utf-8", errors="surrogatepass")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


#: A workspace path of one run's files (``outputs/large_tool_results/<run
#: id>/…``, ``outbox/<run id>/…``, R-TA-7): the run id in it names the
#: run that wrote the file, not what the model was told.
_RUN_FILE = re.compile(
    "((?:" + "|".join(re.escape(d.as_posix()) for d in (LARGE_RESULTS_DIR, OUTBOX_DIR)) + r")/)[0-9a-fA-F-]{36}/"
)


def mask_run_paths(text: str) -> str:
    """``text`` with the run id of each workspace path of a run's files
    (``outputs/large_tool_results/<run id>/``, ``outbox/<run id>/``)
    replaced by ``<run>``: the same result written by another run."""
    return _RUN_FILE.sub(r"\1<run>/", text) if "/" in text else text


def _masked(content: Any) -> Any:
    """``content`` with the run ids of workspace paths replaced by
    ``<run>``: a result offloaded by another run (a replay, R-REPLAY-2)
    is the same result."""
    if isinstance(content, str) and "/" in content:
        return _RUN_FILE.sub(r"\1<run>/", content)
    return content


def _provider_content(content: Any) -> Any:
    """``content`` as the provider reads it: content blocks without what
    langchain-core adds for itself (a streamed block's ``index``, a block
    ``id``) and without ``tool_call`` blocks (sent as the message's tool
    calls); text blocks alone become their joined text, so an answer held
    as blocks (a checkpoint's, ``output_version`` v1) and as a string (the
    history rebuilt from the audit, R-READ-2) are the same content."""
    if not isinstance(content, list):
        return _masked(content)
    blocks = []
    for block in content:
        if isinstance(block, str):
            blocks.append({"type": "text", "text": block})
        elif isinstance(block, Mapping):
            if block.get("type") in ("tool_call", "tool_call_chunk", "invalid_tool_call"):
                continue
            blocks.append({k: v for k, v in block.items() if k not in ("index", "id")})
        else:
            blocks.append(block)
    if all(isinstance(b, Mapping) and b.get("type") == "text" and set(b) <= {"type", "text"} for b in blocks):
        return _masked("".join(str(b.get("text") or "") for b in blocks))
    return blocks


def _message_facts(message: BaseMessage) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "type": message.role if isinstance(message, ChatMessage) else message.type,
        "content": _provider_content(message.content),
    }
    if message.name:
        facts["name"] = message.name
    if isinstance(message, AIMessage):
        if message.tool_calls:
            facts["tool_calls"] = [[call.get("id"), call["name"], call["args"]] for call in message.tool_calls]
        if message.invalid_tool_calls:
            # Sent too (as their raw arguments): a provider sees them.
            facts["invalid_tool_calls"] = [
                [call.get("id"), call.get("name"), call.get("args")] for call in message.invalid_tool_calls
            ]
    elif isinstance(message, ToolMessage):
        facts["tool_call_id"] = message.tool_call_id
        facts["status"] = message.status
    return facts


def _tool_name(schema: Any) -> str:
    if not isinstance(schema, Mapping):
        return str(schema)
    function = schema.get("function")
    if isinstance(function, Mapping) and "name" in function:
        return str(function["name"])
    return str(schema.get("name", ""))


def request_fingerprint(messages: Sequence[BaseMessage], invocation_params: Mapping[str, Any] | None) -> dict:
    """The fingerprint of one model request (R-REPLAY-2).

    ``messages``: the LangChain messages sent, in order (``messages[0]`` of
    the chat-model start callback; a ``create_agent`` agent's system prompt
    comes first as a ``SystemMessage``). ``invocation_params``: the
    callback's invocation parameters; only ``tools`` is read, the bound tool
    schemas (OpenAI-formatted: ``{"type": "function", "function": {"name":
    ...}}``; a schema with a top-level ``name`` is read too).

    Returns ``{"digest", "system", "tools", "tool_names", "tool_digests", "messages",
    "message_count"}``:

    - ``system``: sha256 (hex) of the system prompt's text, the contents of
      the system messages joined by a newline (block content as canonical
      JSON) — for one system message, ``sha256(prompt)``; ``""`` without
      one;
    - ``tools``: sha256 of the canonical JSON of the tool schemas, in the
      order bound; ``""`` without tools; ``tool_names``: their names, sorted;
      ``tool_digests``: each tool's name → the first 16 hex digits of the
      sha256 of its schema (which tool's definition changed);
    - ``messages``: sha256 of the other messages, one canonical JSON line
      each, in order; ``message_count``: how many;
    - ``digest``: sha256 of the whole request: the tool schemas' line, then
      every message's line in order, system messages where they stand.

    Canonical JSON: ``sort_keys``, no ASCII escaping, compact separators,
    encoded UTF-8 with lone surrogates passed through. Hashed in one pass
    over the messages, nothing copied. Raises what an unreadable message
    raises (the caller records no fingerprint then).
    """
    tools = list((invocation_params or {}).get("tools") or ())
    tools_line = _utf8(_canonical_json(tools))
    whole = hashlib.sha256(tools_line)
    rest = hashlib.sha256()
    system_texts: list[str] = []
    count = 0
    for message in messages:
        line = b"\n" + _utf8(_canonical_json(_message_facts(message)))
        whole.update(line)
        if isinstance(message, SystemMessage):
            content = message.content
            system_texts.append(content if isinstance(content, str) else _canonical_json(content))
        else:
            rest.update(line)
            count += 1
    return {
        "digest": whole.hexdigest(),
        "system": _sha256(_utf8("\n".join(system_texts))) if system_texts else "",
        "tools": _sha256(tools_line) if tools else "",
        "tool_names": sorted(_tool_name(schema) for schema in tools),
        "tool_digests": {_tool_name(schema): _sha256(_utf8(_canonical_json(schema)))[:16] for schema in tools},
        "messages": rest.hexdigest(),
        "message_count": count,
    }
