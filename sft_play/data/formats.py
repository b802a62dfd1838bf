"""Record formats: detect which one a dataset uses and normalise rows to one of three shapes
(preference data to a fourth or fifth, :func:`normalise_pair`).

Every supported format becomes one of:
  {"messages": [{"role": ..., "content": ...}, ...]}   chat (messages, sharegpt, alpaca; TRL's
                                                        conversational prompt/completion, with
                                                        "prompt_turns": the turns that are its prompt)
  {"prompt": str, "completion": str}                    prompt/completion pairs
  {"text": str}                                         plain text (continued pre-training)

Bad rows raise :class:`InvalidRow`, naming the file, the row and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sft_play.config.schema import DATA_FIELDS
from sft_play.data import images

FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion", "text")
PAIR_FORMATS = ("preference", "pairwise", "unpaired")
ROLES = ("system", "user", "assistant", "tool")

# ShareGPT speakers to chat roles (the names seen in the wild).
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function_response": "tool",
    "function_call": "assistant",  # its value is the call, as JSON text (LLaMA-Factory)
    "observation": "tool",
}

# Our field name -> the column it is read from, unless `data.columns` maps it elsewhere.
DEFAULT_COLUMNS = {field: field for field in DATA_FIELDS}


@dataclass(eq=False)
class InvalidRow(ValueError):
    """A row that cannot be turned into a training example."""

    source: str
    row: int
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source}, row {self.row}, field '{self.field}': {self.reason}"


SHOWN_BAD_ROWS = 20  # bad rows listed by name; the rest are counted


class InvalidRows(InvalidRow):
    """Every bad row of the data (the first :data:`SHOWN_BAD_ROWS` named, the rest counted)."""

    def __init__(self, rows: list[InvalidRow], count: int | None = None):
        first = rows[0]
        super().__init__(first.source, first.row, first.field, first.reason)
        self.rows = rows
        self.count = max(count or 0, len(rows))  # `rows` may be the first few of `count`

    def __str__(self) -> str:
        shown = "\n".join(f"  - {row}" for row in self.rows[:SHOWN_BAD_ROWS])
        more = self.count - min(len(self.rows), SHOWN_BAD_ROWS)
        tail = f"\n  ... and {more} more" if more > 0 else ""
        return (f"{self.count} bad row(s) in the data:\n{shown}{tail}\n"
                "Fix them, or set data.on_invalid=skip to leave them out (they are then listed by reason).")


class UnknownFormat(ValueError):
    """Data whose format cannot be detected from its columns."""


def column_map(columns: dict[str, str]) -> dict[str, str]:
    """Our field names mapped to the dataset's column names, with `data.columns` applied."""
    return {**DEFAULT_COLUMNS, **columns}


def detect_format(rows: list[dict[str, Any]], columns: dict[str, str]) -> str:
    """The format of `rows` (a few first rows of a dataset), from the columns they carry.

    Raises:
        UnknownFormat: when no format matches, naming the columns that were found.
    """
    cols = column_map(columns)
    keys = set().union(*(r.keys() for r in rows)) if rows else set()
    for field in ("messages", "conversations"):  # each holds turns of either kind: the first turn tells
        if cols[field] in keys:
            first = next((r[cols[field]] for r in rows if r.get(cols[field])), None)
            turn = first[0] if isinstance(first, list) and first and isinstance(first[0], dict) else {}
            if "from" in turn:
                return "sharegpt"
            return "messages" if "role" in turn or field == "messages" else "sharegpt"
    if cols["instruction"] in keys and cols["output"] in keys:
        return "alpaca"
    if cols["prompt"] in keys and cols["completion"] in keys:
        return "prompt_completion"
    if cols["text"] in keys:
        return "text"
    if cols["chosen"] in keys and cols["rejected"] in keys:
        raise UnknownFormat(f"the columns {cols['chosen']!r} and {cols['rejected']!r} are preference pairs, not "
                            "supervised examples: set finetune.objective=dpo to train on them (docs/PREFERENCE.md)")
    raise _unread(rows, columns, "cannot tell the data format", "expected 'messages', 'conversations', "
                  "'instruction'+'output', 'prompt'+'completion' or 'text'. Set data.format, or map your columns with "
                  "data.columns, e.g. data.columns.prompt=question data.columns.completion=answer")


def _unread(rows: list[dict[str, Any]], columns: dict[str, str], what: str, expected: str) -> UnknownFormat:
    """The error for rows no format reads: the mapped columns that are absent, or what was expected."""
    keys = set().union(*(r.keys() for r in rows)) if rows else set()
    absent = mapped_but_absent(rows, columns)
    return UnknownFormat(f"{what} from the columns {sorted(keys)}" + (f": {absent}" if absent else f"; {expected}"))


def mapped_but_absent(rows: list[dict[str, Any]], columns: dict[str, str]) -> str | None:
    """What is wrong with ``data.columns`` when it maps our fields to columns that none of `rows`
    has (a typo, or another file's names); None when every mapped column is there."""
    keys = set().union(*(r.keys() for r in rows)) if rows else set()
    absent = {ours: theirs for ours, theirs in columns.items() if theirs not in keys}
    if not absent:
        return None
    named = ", ".join(f"data.columns.{ours}={theirs}" for ours, theirs in absent.items())
    return f"{named} name{'s' if len(absent) == 1 else ''} no column of this file (its columns: {sorted(keys)})"


# An answer of nothing (or only whitespace) would teach the model to stop at once
EMPTY_ANSWER = "empty answer"


def _string(row: dict, column: str, source: str, index: int, optional: bool = False) -> str:
    value = row.get(column)
    if value is None:
        if optional:
            return ""
        raise InvalidRow(source, index, column, "missing")
    if not isinstance(value, str):
        raise InvalidRow(source, index, column, f"expected a string, got {type(value).__name__}")
    return value


def _chat(messages: Any, source: str, index: int, field: str, role_key: str, content_key: str,
          role_map: dict[str, str] | None, needs_answer: bool = True) -> list[dict[str, str]]:
    if messages is None:
        raise InvalidRow(source, index, field, "missing")
    if not isinstance(messages, list):
        raise InvalidRow(source, index, field, f"expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise InvalidRow(source, index, field, "empty conversation")
    out = []
    for turn, message in enumerate(messages):
        where = f"{field}[{turn}]"
        if not isinstance(message, dict):
            raise InvalidRow(source, index, where, f"expected a message object, got {type(message).__name__}")
        if role_key not in message:
            raise InvalidRow(source, index, f"{where}.{role_key}", "missing")
        role = message[role_key]
        role = role_map.get(str(role).lower(), role) if role_map else role
        if role not in ROLES:
            allowed = ", ".join(sorted(role_map)) if role_map else ", ".join(ROLES)
            raise InvalidRow(source, index, f"{where}.{role_key}", f"unknown role {message[role_key]!r} (allowed: {allowed})")
        content = message.get(content_key)
        calls = message.get("tool_calls")
        if role_map and str(message[role_key]).lower() == "function_call":  # LLaMA-Factory: the call as JSON text
            calls, content = _json_value(content, source, index, f"{where}.{content_key}"), ""
            calls = calls if isinstance(calls, list) else [calls]
        if calls:  # (an empty list on every turn, as some exports write it, is none)
            if role != "assistant":
                raise InvalidRow(source, index, f"{where}.tool_calls", f"tool calls in a {role} turn (the assistant's)")
            calls = _tool_calls(calls, source, index, f"{where}.tool_calls")
            content = "" if content is None else content
        if content is None:
            raise InvalidRow(source, index, f"{where}.{content_key}", "missing")
        if isinstance(content, list):
            content = _content_parts(content, source, index, f"{where}.{content_key}")
        elif not isinstance(content, str):
            raise InvalidRow(source, index, f"{where}.{content_key}", f"expected a string or a list of parts, got "
                             f"{type(content).__name__}")
        if role == "assistant" and not text_of(content).strip() and not calls:
            raise InvalidRow(source, index, f"{where}.{content_key}", EMPTY_ANSWER)
        turn_out: dict[str, Any] = {"role": role, "content": content}
        if calls:
            turn_out["tool_calls"] = calls
        if role == "tool":  # which call it answers, where the data says (templates render them)
            turn_out.update({k: message[k] for k in ("name", "tool_call_id") if isinstance(message.get(k), str)})
        out.append(turn_out)
    if needs_answer and not any(m["role"] == "assistant" for m in out):
        raise InvalidRow(source, index, field, "no assistant turn to learn from")
    return out


def _content_parts(parts: list[Any], source: str, index: int, field: str) -> list[dict[str, Any]]:
    """A message's content given as parts (OpenAI's and TRL's vision form): text and images."""
    out = []
    for i, part in enumerate(parts):
        where = f"{field}[{i}]"
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        if not isinstance(part, dict):
            raise InvalidRow(source, index, where, f"expected a content part object, got {type(part).__name__}")
        kind = part.get("type") or ("text" if "text" in part else "image" if "image" in part else None)
        if kind == "image_url":
            kind = "image"
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise InvalidRow(source, index, f"{where}.text", "missing, or not a string")
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            out.append({k: v for k, v in part.items() if k != "type"} | {"type": "image"})
        else:
            raise InvalidRow(source, index, f"{where}.type", f"{kind!r}: only text and image parts are read")
    return out


def text_of(content: Any) -> str:
    """The text of a message's content (a string, or the text parts of a list)."""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _with_images(record: dict[str, Any], row: dict[str, Any], cols: dict[str, str], source: str,
                 index: int) -> dict[str, Any]:
    """`record` with the images of its row in place (:func:`sft_play.data.images.attach`); a record
    without any keeps string content."""
    field = cols["image"] if row.get(cols["image"]) not in (None, "", []) or cols["images"] not in row else cols["images"]
    listed = row.get(field)
    given = cols["images"] in row or cols["image"] in row  # (an empty list: its "<image>" marks are places)
    has_parts = any(isinstance(m["content"], list) for m in record["messages"])
    if listed in (None, "", []) and not has_parts and not (given and any(
            isinstance(m["content"], str) and images.PLACEHOLDER in m["content"] for m in record["messages"])):
        return record
    base = Path(source).parent if Path(source).is_file() else None
    try:
        return images.attach(record, listed, base, field, given)
    except images.ImageProblem as exc:
        raise InvalidRow(source, index, exc.field, exc.reason) from None


def _conversational_pair(row: dict[str, Any], cols: dict[str, str], source: str, index: int) -> dict[str, Any]:
    """TRL's conversational prompt-completion record (``{"prompt": [messages], "completion":
    [messages]}``) as one conversation, with the number of turns that are the prompt: those are
    context, learned from only with ``data.train_on: all`` (as TRL trains the completion)."""
    prompt, completion = row.get(cols["prompt"]), row.get(cols["completion"])
    for column, value in ((cols["prompt"], prompt), (cols["completion"], completion)):
        if not isinstance(value, list):
            raise InvalidRow(source, index, column, f"expected a list of messages like the other field's (TRL's "
                             f"conversational prompt-completion), got {type(value).__name__}")
    context = _chat(prompt, source, index, cols["prompt"], "role", "content", None, needs_answer=False)
    answer = _chat(completion, source, index, cols["completion"], "role", "content", None)
    return _with_tools(_with_images({"messages": context + answer, "prompt_turns": len(context)}, row, cols, source,
                                    index), tools_of(row, cols["tools"], source, index))


def _json_value(value: Any, source: str, index: int, field: str) -> Any:
    """`value`, or what the JSON text in it says (data that stores structures as strings)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidRow(source, index, field, f"not valid JSON: {exc.msg} at column {exc.colno}") from None


def _tool_calls(calls: Any, source: str, index: int, field: str) -> list[dict[str, Any]]:
    """An assistant turn's tool calls as chat templates take them, ``{"type": "function", "function":
    {"name", "arguments"}}``, from OpenAI's form or the flat ``{"name", "arguments"}``; arguments
    given as JSON text (as OpenAI's API returns them) become the mapping templates expect."""
    if not isinstance(calls, list):
        raise InvalidRow(source, index, field, f"expected a list of tool calls, got {type(calls).__name__}")
    out = []
    for i, call in enumerate(calls):
        where = f"{field}[{i}]"
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRow(source, index, where, "expected {\"function\": {\"name\": ..., \"arguments\": ...}} or "
                                                   "{\"name\": ..., \"arguments\": ...}")
        arguments = _json_value(function.get("arguments", {}), source, index, f"{where}.arguments")
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def tools_of(row: dict[str, Any], column: str, source: str, index: int) -> list[dict[str, Any]] | None:
    """A record's tool definitions (a list of JSON schemas, or the JSON text of one), for the template."""
    value = row.get(column)
    if value is None or value == "" or value == []:
        return None
    value = _json_value(value, source, index, column)
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise InvalidRow(source, index, column, "expected a list of tool definitions (JSON schemas)")
    return value


def _history(value: Any, source: str, index: int, field: str) -> list[dict[str, str]]:
    """Alpaca's earlier turns (LLaMA-Factory's ``history``: ``[[instruction, answer], ...]``) as chat turns."""
    if value is None or (isinstance(value, list) and not value):
        return []
    if not isinstance(value, list):
        raise InvalidRow(source, index, field, f"expected a list of [instruction, answer] pairs, got {type(value).__name__}")
    turns = []
    for i, pair in enumerate(value):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise InvalidRow(source, index, f"{field}[{i}]", "expected an [instruction, answer] pair of strings")
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return turns


def _with_tools(record: dict[str, Any], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {**record, "tools": tools} if tools else record


def normalise(row: dict[str, Any], fmt: str, columns: dict[str, str], source: str, index: int) -> dict[str, Any]:
    """One raw row in `fmt` as a canonical record (see the module docstring).

    Raises:
        InvalidRow: naming the source, row and field at fault.
    """
    cols = column_map(columns)
    if fmt == "messages":
        field = cols["messages"] if cols["messages"] in row or cols["conversations"] not in row else cols["conversations"]
        record = {"messages": _chat(row.get(field), source, index, field, "role", "content", None)}
        return _with_tools(_with_images(record, row, cols, source, index), tools_of(row, cols["tools"], source, index))
    if fmt == "sharegpt":
        field = cols["conversations"] if cols["conversations"] in row else cols["messages"]
        messages = _chat(row.get(field), source, index, field, "from", "value", SHAREGPT_ROLES)
        system = row.get(cols["system"])
        if isinstance(system, str) and system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        return _with_tools(_with_images({"messages": messages}, row, cols, source, index),
                           tools_of(row, cols["tools"], source, index))
    if fmt == "alpaca":
        instruction = _string(row, cols["instruction"], source, index)
        extra = _string(row, cols["input"], source, index, optional=True)
        output = _string(row, cols["output"], source, index)
        if not instruction.strip():
            raise InvalidRow(source, index, cols["instruction"], "empty")
        if not output.strip():
            raise InvalidRow(source, index, cols["output"], EMPTY_ANSWER)
        messages = []
        system = _string(row, cols["system"], source, index, optional=True)
        if system:
            messages.append({"role": "system", "content": system})
        messages += _history(row.get(cols["history"]), source, index, cols["history"])
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        return {"messages": messages}
    if fmt == "prompt_completion":
        if isinstance(row.get(cols["prompt"]), list) or isinstance(row.get(cols["completion"]), list):
            return _conversational_pair(row, cols, source, index)
        prompt = _string(row, cols["prompt"], source, index)
        completion = _string(row, cols["completion"], source, index)
        if not completion.strip():
            raise InvalidRow(source, index, cols["completion"], EMPTY_ANSWER)
        return {"prompt": prompt, "completion": completion}
    if fmt == "text":
        text = _string(row, cols["text"], source, index)
        if not text.strip():
            raise InvalidRow(source, index, cols["text"], "empty")
        return {"text": text}
    raise ValueError(f"unknown data format {fmt!r}; expected one of {', '.join(FORMATS)}")


def detect_pair_format(rows: list[dict[str, Any]], columns: dict[str, str]) -> str:
    """The format of preference `rows`: ``preference`` (TRL's: ``prompt``/``chosen``/``rejected``,
    strings or message lists, the prompt implicit when left out), ``pairwise`` (LLaMA-Factory's:
    the conversation so far in ``conversations``/``messages``, or Alpaca's ``instruction``/``input``,
    beside ``chosen``/``rejected`` answers) or ``unpaired`` (TRL's for KTO: ``prompt``/``completion``
    with a boolean ``label``, true for a desirable answer).

    Raises:
        UnknownFormat: naming the columns found.
    """
    cols = column_map(columns)
    keys = set().union(*(r.keys() for r in rows)) if rows else set()
    if cols["chosen"] in keys and cols["rejected"] in keys:
        # (a prompt column wins: UltraFeedback's pairs also carry the chosen conversation as messages)
        if cols["prompt"] not in keys and (cols["conversations"] in keys or cols["messages"] in keys
                                           or cols["instruction"] in keys):
            return "pairwise"
        return "preference"
    if cols["prompt"] in keys and cols["completion"] in keys and cols["label"] in keys:
        return "unpaired"
    raise _unread(rows, columns, "cannot read preference data", "expected 'chosen' and 'rejected' (with 'prompt', "
                  "or beside 'conversations'/'messages'/'instruction'), or KTO's 'prompt', 'completion' and 'label'. "
                  "Map your columns with data.columns, e.g. "
                  "data.columns.prompt=question data.columns.chosen=chosen_response "
                  "data.columns.rejected=rejected_response")


SAME_ANSWERS = "chosen equal to rejected"  # no preference to learn


def _unpaired(row: dict[str, Any], cols: dict[str, str], source: str, index: int) -> dict[str, Any]:
    """One KTO row: a prompt, one answer and whether it is desirable (true/false, or 1/0)."""
    label = row.get(cols["label"])
    if isinstance(label, int) and not isinstance(label, bool) and label in (0, 1):
        label = bool(label)
    if not isinstance(label, bool):
        raise InvalidRow(source, index, cols["label"], "missing" if label is None else
                         f"expected true (a desirable answer) or false, got {label!r}")
    prompt, completion = row.get(cols["prompt"]), row.get(cols["completion"])
    conversational = isinstance(prompt, list) or isinstance(completion, list)
    if conversational:
        if not isinstance(prompt, list):
            raise InvalidRow(source, index, cols["prompt"], f"expected a list of messages like the completion "
                             f"(TRL's conversational unpaired data), got {type(prompt).__name__}")
        prompt = _chat(prompt, source, index, cols["prompt"], "role", "content", None, needs_answer=False)
    else:
        prompt = _string(row, cols["prompt"], source, index)
    record = {"prompt": prompt, "completion": _answer(completion, source, index, cols["completion"], conversational),
              "label": label}
    tools = tools_of(row, cols["tools"], source, index)
    return {**record, "tools": tools} if tools else record


def _answer(value: Any, source: str, index: int, field: str, conversational: bool) -> Any:
    """One side of a pair: the answer's text (standard data), or its turns (conversational; a
    single message is one turn, LLaMA-Factory's way)."""
    if not conversational:
        if not isinstance(value, str):
            raise InvalidRow(source, index, field, "missing" if value is None else
                             f"expected a string like the other fields, got {type(value).__name__}")
        if not value.strip():
            raise InvalidRow(source, index, field, EMPTY_ANSWER)
        return value
    if isinstance(value, str):
        value = [{"role": "assistant", "content": value}]
    elif isinstance(value, dict):
        value = [value]
    from_key = "from" if isinstance(value, list) and value and isinstance(value[0], dict) and "from" in value[0] else "role"
    turns = _chat(value, source, index, field, from_key, "value" if from_key == "from" else "content",
                  SHAREGPT_ROLES if from_key == "from" else None)
    if turns[-1]["role"] != "assistant":
        raise InvalidRow(source, index, field, "the answer must end with an assistant turn")
    return turns


def normalise_pair(row: dict[str, Any], fmt: str, columns: dict[str, str], source: str, index: int) -> dict[str, Any]:
    """One raw preference row in `fmt` as ``{"prompt", "chosen", "rejected"}``: three strings
    (standard) or three lists of turns (conversational), as TRL's ``DPOTrainer`` takes them; an
    ``unpaired`` row as ``{"prompt", "completion", "label"}``, as TRL's ``KTOTrainer`` takes it.

    Raises:
        InvalidRow: naming the source, row and field at fault.
    """
    cols = column_map(columns)
    if fmt == "unpaired":
        return _unpaired(row, cols, source, index)
    chosen, rejected = row.get(cols["chosen"]), row.get(cols["rejected"])
    if fmt == "preference":
        prompt = row.get(cols["prompt"])
        conversational = isinstance(prompt, list) or isinstance(chosen, list) or isinstance(rejected, list)
        if isinstance(prompt, str) and isinstance(chosen, list) and isinstance(rejected, list):
            prompt = None  # whole conversations beside the prompt's text (UltraFeedback's): they carry it
        if prompt is None:  # implicit: the turns (or characters) both sides share
            from trl.data_utils import extract_prompt

            pair = {"chosen": _answer(chosen, source, index, cols["chosen"], conversational),
                    "rejected": _answer(rejected, source, index, cols["rejected"], conversational)}
            pair = extract_prompt(pair)
            if not pair["prompt"] or (not conversational and not pair["prompt"].strip()):
                raise InvalidRow(source, index, cols["chosen"], "no prompt: chosen and rejected share no turn "
                                 "(no leading text) and no prompt column is given")
            for side in ("chosen", "rejected"):
                if not pair[side]:
                    raise InvalidRow(source, index, cols[side], EMPTY_ANSWER)
        elif conversational:
            if not isinstance(prompt, list):
                raise InvalidRow(source, index, cols["prompt"], f"expected a list of messages like the answers "
                                 f"(TRL's conversational preference), got {type(prompt).__name__}")
            pair = {"prompt": _chat(prompt, source, index, cols["prompt"], "role", "content", None, needs_answer=False),
                    "chosen": _answer(chosen, source, index, cols["chosen"], True),
                    "rejected": _answer(rejected, source, index, cols["rejected"], True)}
        else:
            pair = {"prompt": _string(row, cols["prompt"], source, index),
                    "chosen": _answer(chosen, source, index, cols["chosen"], False),
                    "rejected": _answer(rejected, source, index, cols["rejected"], False)}
    elif fmt == "pairwise":
        if cols["instruction"] in row:
            instruction = _string(row, cols["instruction"], source, index)
            extra = _string(row, cols["input"], source, index, optional=True)
            prompt = [{"role": "user", "content": f"{instruction}\n\n{extra}" if extra.strip() else instruction}]
            system = _string(row, cols["system"], source, index, optional=True)
            prompt = [{"role": "system", "content": system}] * bool(system) + prompt
        else:
            field = cols["conversations"] if cols["conversations"] in row else cols["messages"]
            turns = row.get(field)
            sharegpt = isinstance(turns, list) and turns and isinstance(turns[0], dict) and "from" in turns[0]
            prompt = _chat(turns, source, index, field, "from" if sharegpt else "role",
                           "value" if sharegpt else "content", SHAREGPT_ROLES if sharegpt else None, needs_answer=False)
            system = row.get(cols["system"])
            if isinstance(system, str) and system and prompt[0]["role"] != "system":
                prompt.insert(0, {"role": "system", "content": system})
            if prompt[-1]["role"] == "assistant":
                raise InvalidRow(source, index, field, "the conversation before the answers ends with an assistant "
                                 "turn: it is the prompt, and the answers are chosen/rejected")
        pair = {"prompt": prompt, "chosen": _answer(chosen, source, index, cols["chosen"], True),
                "rejected": _answer(rejected, source, index, cols["rejected"], True)}
    else:
        raise ValueError(f"unknown preference format {fmt!r}; expected one of {', '.join(PAIR_FORMATS)}")
    if pair["chosen"] == pair["rejected"]:
        raise InvalidRow(source, index, cols["rejected"], SAME_ANSWERS)
    tools = tools_of(row, cols["tools"], source, index)
    return {**pair, "tools": tools} if tools else pair
