"""Source rows -> the conversations whose assistant turns the teacher answers."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_common.errors import BadRowError
from dflash_corpus import (
    CorpusRow,
    parse_messages,
    row_id,
)
from dflash_regenerate.part_plan import plan_turns


def chat_of_row(row: CorpusRow) -> list[dict]:
    """The row's chat as [{role, content}] (canonical roles); raises BadRowError.

    parse_messages validates roles and contents but requires an assistant turn; prompt-only
    rows are fine input here, so a placeholder answer is appended for the check and dropped.
    """
    if row.problem is not None or row.data is None:
        raise BadRowError(row.path, row.row, row.problem or "row has no data")
    data = dict(row.data)
    chat_field = next((f for f in ("messages", "conversations") if data.get(f) is not None), None)
    if chat_field is not None and isinstance(data[chat_field], (list, tuple)):
        placeholder = {"role": "assistant", "content": ""} if chat_field == "messages" else {"from": "gpt", "value": ""}
        data[chat_field] = list(data[chat_field]) + [placeholder]
    content = parse_messages(CorpusRow(index=row.index, path=row.path, row=row.row, data=data, problem=None))
    if isinstance(content, str):
        raise BadRowError(row.path, row.row, "plain 'text' row has no user turn to regenerate (use chat rows)")
    return content[:-1] if chat_field is not None else content


@dataclass
class Conversation:
    """One source row being regenerated turn by turn."""

    row: CorpusRow
    id: str
    groups: list[list[dict]]
    messages: list[dict] = field(default_factory=list)
    turn: int = 0
    failed: str | None = None

    @property
    def done(self) -> bool:
        return self.failed is not None or self.turn == len(self.groups)


def conversation_or_problem(row: CorpusRow, keep_turns: str) -> Conversation:
    chat = chat_of_row(row)
    try:
        groups = plan_turns(chat, keep_turns)
    except ValueError as err:
        raise BadRowError(row.path, row.row, str(err)) from None
    conversation = Conversation(row=row, id=row_id(row.data), groups=groups)
    conversation.messages.extend(groups[0])
    return conversation


